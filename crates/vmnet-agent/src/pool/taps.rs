//! The link side of pool mode as the agent needs it: instance taps on the bridge with their tap
//! guard, the host's own addresses, and (for sandboxes) the bridge itself. [`PoolTaps`] is the
//! seam; [`KernelTaps`] is the real implementation: taps and their BPF guard through
//! [`GuardedTaps`] (the same code the kernel tests drive), addresses over rtnetlink; fakes
//! implement it in tests.

use std::net::IpAddr;
use std::sync::Arc;

use futures::TryStreamExt;
use futures::future::BoxFuture;
use netlink_packet_route::address::AddressAttribute;
use rtnetlink::{Handle, LinkBridge};
use vmnet_kernel::pool::guard::TapGuard;
use vmnet_kernel::pool::host::{GuardedTaps, InstanceTaps, PoolHostError};
use vmnet_kernel::pool::tap::{TapAction, Taps};
use vmnet_kernel::tap::TapOwner;
use vmnet_model::Error;
use vmnet_model::error::chain;
use vmnet_model::nic::IfName;
use vmnet_plan::pool::nft::{HostAddrs, TapEntry};

use crate::status::GuardStatus;

/// Taps and host addresses of one host namespace: the tap side of an instance
/// ([`InstanceTaps`], which the one orchestrator [`vmnet_kernel::pool::host`] drives) and what
/// the agent's passes need besides.
pub trait PoolTaps: InstanceTaps {
    /// Tells the guard the host's own addresses (guests may reach only the gateways among
    /// them). A no-op without a guard.
    ///
    /// # Errors
    /// `UNAVAILABLE` when the guard's maps cannot be written.
    fn set_host<'a>(&'a self, host: &'a HostAddrs) -> BoxFuture<'a, Result<(), Error>> {
        let _ = host;
        Box::pin(async { Ok(()) })
    }

    /// The guard's counters; `None` without a guard.
    fn guard_status(&self) -> Option<GuardStatus> {
        None
    }

    /// Names of every link starting with `bc` (instance taps).
    ///
    /// # Errors
    /// `UNAVAILABLE` when the links cannot be listed.
    fn list(&self) -> BoxFuture<'_, Result<Vec<String>, Error>>;

    /// Every address of the host namespace except loopback ones, sorted; IPv6 link-local ones
    /// only on interfaces that carry another address too (guests may not reach the host on
    /// those either; a tap's own link-local address is unreachable from its guest anyway).
    ///
    /// # Errors
    /// `UNAVAILABLE` when the addresses cannot be listed.
    fn host_addresses(&self) -> BoxFuture<'_, Result<Vec<IpAddr>, Error>>;
}

fn unavailable(what: impl std::fmt::Display, e: &dyn std::error::Error) -> Error {
    Error::unavailable(format!("{what}: {}", chain(e)))
}

/// The real [`PoolTaps`]: taps and their guard through [`GuardedTaps`], addresses through
/// rtnetlink.
#[derive(Debug, Clone)]
pub struct KernelTaps {
    taps: GuardedTaps,
    handle: Handle,
}

/// Runs a blocking guard call off the async runtime, mapping its error to `UNAVAILABLE`.
async fn guard_call<T: Send + 'static>(
    what: String,
    f: impl FnOnce() -> Result<T, vmnet_kernel::pool::guard::GuardError> + Send + 'static,
) -> Result<T, Error> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::internal(format!("{what}: {e}")))?
        .map_err(|e| unavailable(what, &e))
}

impl KernelTaps {
    /// Taps in named namespace `netns`, or in the agent's own namespace with `None`; new taps
    /// get `owner`. Call inside a tokio runtime.
    ///
    /// # Errors
    /// `UNAVAILABLE` when the netlink socket cannot be opened.
    pub fn new(netns: Option<&str>, owner: TapOwner) -> Result<Self, Error> {
        let (taps, handle) = match netns {
            Some(ns) => {
                let h = vmnet_kernel::netns::netlink_in(ns)
                    .map_err(|e| unavailable(format!("netns {ns}"), &e))?;
                (Taps::new(ns, h.clone()), h)
            }
            None => {
                let (conn, h, _) =
                    rtnetlink::new_connection().map_err(|e| unavailable("rtnetlink socket", &e))?;
                tokio::spawn(conn);
                (Taps::here(h.clone()), h)
            }
        };
        Ok(Self {
            taps: GuardedTaps {
                taps,
                netns: netns.map(str::to_owned),
                owner,
                guard: None,
            },
            handle,
        })
    }

    /// Loads the tap guard for this namespace and uses it for every tap from now on.
    ///
    /// # Errors
    /// `UNAVAILABLE` when the BPF programs cannot be loaded (no BPF support or privileges).
    pub fn with_guard(mut self, netns: Option<&str>) -> Result<Self, Error> {
        let g = TapGuard::load(netns).map_err(|e| unavailable("tap guard", &e))?;
        self.taps.guard = Some(Arc::new(g));
        Ok(self)
    }

    /// Creates bridge `bridge` (up) when it does not exist; `true` when it was created. For
    /// sandboxes (`vmnet serve --create-bridge`): a real host's bridge exists already.
    ///
    /// # Errors
    /// `UNAVAILABLE` when netlink fails.
    pub async fn ensure_bridge(&self, bridge: &IfName) -> Result<bool, Error> {
        if self
            .taps
            .taps
            .link(bridge)
            .await
            .map_err(|e| unavailable(format!("bridge {bridge}"), &e))?
            .is_some()
        {
            return Ok(false);
        }
        self.handle
            .link()
            .add(LinkBridge::new(bridge.as_str()).up().build())
            .execute()
            .await
            .map_err(|e| unavailable(format!("bridge {bridge}: create"), &e))?;
        Ok(true)
    }
}

impl InstanceTaps for KernelTaps {
    fn ensure<'a>(
        &'a self,
        entry: &'a TapEntry,
        bridge: &'a IfName,
    ) -> BoxFuture<'a, Result<TapAction, PoolHostError>> {
        self.taps.ensure(entry, bridge)
    }

    fn delete<'a>(&'a self, tap: &'a IfName) -> BoxFuture<'a, Result<bool, PoolHostError>> {
        self.taps.delete(tap)
    }

    fn exists<'a>(&'a self, tap: &'a IfName) -> BoxFuture<'a, Result<bool, PoolHostError>> {
        self.taps.exists(tap)
    }
}

impl PoolTaps for KernelTaps {
    fn set_host<'a>(&'a self, host: &'a HostAddrs) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            if let Some(g) = &self.taps.guard {
                let (g, h) = (Arc::clone(g), host.clone());
                guard_call("tap guard host addresses".into(), move || g.set_host(&h)).await?;
            }
            Ok(())
        })
    }

    fn guard_status(&self) -> Option<GuardStatus> {
        let g = self.taps.guard.as_ref()?;
        let (drops, error) = match g.drops() {
            Ok(d) => (
                d.into_iter().map(|(k, v)| (k.to_owned(), v)).collect(),
                None,
            ),
            Err(e) => (Default::default(), Some(chain(&e))),
        };
        Some(GuardStatus {
            taps: g.taps().len() as u64,
            drops,
            error,
        })
    }

    fn list(&self) -> BoxFuture<'_, Result<Vec<String>, Error>> {
        Box::pin(async move {
            self.taps
                .taps
                .list_taps()
                .await
                .map_err(|e| unavailable("pool", &e))
        })
    }

    fn host_addresses(&self) -> BoxFuture<'_, Result<Vec<IpAddr>, Error>> {
        Box::pin(async move {
            let mut found = Vec::new();
            let mut s = self.handle.address().get().execute();
            while let Some(m) = s
                .try_next()
                .await
                .map_err(|e| unavailable("list host addresses", &e))?
            {
                // The host's own address is IFA_LOCAL when present (on point-to-point links
                // IFA_ADDRESS is the peer's), else IFA_ADDRESS.
                let local = m.attributes.iter().find_map(|a| match a {
                    AddressAttribute::Local(ip) => Some(*ip),
                    _ => None,
                });
                let address = m.attributes.iter().find_map(|a| match a {
                    AddressAttribute::Address(ip) => Some(*ip),
                    _ => None,
                });
                if let Some(ip) = local.or(address)
                    && !ip.is_loopback()
                {
                    found.push((m.header.index, ip));
                }
            }
            // IPv6 link-local addresses count on interfaces that also carry another address
            // (the bridge, the uplink): a link-local address is reachable only on its own link,
            // and the instance taps' own link-local addresses would change the set with every
            // tap.
            let is_ll = |ip: &IpAddr| matches!(ip, IpAddr::V6(v) if v.is_unicast_link_local());
            let addressed: std::collections::BTreeSet<u32> = found
                .iter()
                .filter(|(_, ip)| !is_ll(ip))
                .map(|(i, _)| *i)
                .collect();
            let mut out = Vec::new();
            for (index, ip) in found {
                if (!is_ll(&ip) || addressed.contains(&index)) && !out.contains(&ip) {
                    out.push(ip);
                }
            }
            out.sort();
            Ok(out)
        })
    }
}
