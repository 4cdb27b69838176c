//! The link side of pool mode as the agent needs it: instance taps on the bridge, the host's own
//! addresses, and (for sandboxes) the bridge itself. [`PoolTaps`] is the seam; [`KernelTaps`] is
//! the real implementation over rtnetlink and tap ioctls ([`vmnet_kernel::pool::tap`]), fakes
//! implement it in tests.

use std::net::IpAddr;

use futures::TryStreamExt;
use futures::future::BoxFuture;
use netlink_packet_route::address::AddressAttribute;
use rtnetlink::{Handle, LinkBridge};
use vmnet_kernel::pool::tap::{TapOwner, Taps};
use vmnet_model::Error;
use vmnet_model::nic::{IfName, MacAddr};

/// Taps and host addresses of one host namespace.
pub trait PoolTaps: Send + Sync {
    /// Makes tap `tap` exist, persistent, on `bridge` as a locked port for `mac`, and up
    /// (an existing tap is reused).
    ///
    /// # Errors
    /// `UNAVAILABLE` naming the tap (a missing bridge included).
    fn ensure<'a>(
        &'a self,
        tap: &'a IfName,
        bridge: &'a IfName,
        mac: MacAddr,
    ) -> BoxFuture<'a, Result<(), Error>>;

    /// Deletes tap `tap`; `false` when it did not exist.
    ///
    /// # Errors
    /// `UNAVAILABLE` naming the tap.
    fn delete<'a>(&'a self, tap: &'a IfName) -> BoxFuture<'a, Result<bool, Error>>;

    /// Names of every link starting with `bc` (instance taps).
    ///
    /// # Errors
    /// `UNAVAILABLE` when the links cannot be listed.
    fn list(&self) -> BoxFuture<'_, Result<Vec<String>, Error>>;

    /// Every address of the host namespace except loopback and IPv6 link-local ones.
    ///
    /// # Errors
    /// `UNAVAILABLE` when the addresses cannot be listed.
    fn host_addresses(&self) -> BoxFuture<'_, Result<Vec<IpAddr>, Error>>;
}

fn unavailable(what: impl std::fmt::Display, e: &dyn std::error::Error) -> Error {
    let mut msg = format!("{what}: {e}");
    let mut cur = e.source();
    while let Some(c) = cur {
        msg.push_str(&format!(": {c}"));
        cur = c.source();
    }
    Error::unavailable(msg)
}

/// The real [`PoolTaps`]: taps through [`Taps`], addresses through rtnetlink.
#[derive(Debug, Clone)]
pub struct KernelTaps {
    taps: Taps,
    handle: Handle,
    owner: TapOwner,
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
            taps,
            handle,
            owner,
        })
    }

    /// Creates bridge `bridge` (up) when it does not exist; `true` when it was created. For
    /// sandboxes (`vmnet serve --create-bridge`): a real host's bridge exists already.
    ///
    /// # Errors
    /// `UNAVAILABLE` when netlink fails.
    pub async fn ensure_bridge(&self, bridge: &IfName) -> Result<bool, Error> {
        if self
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

impl PoolTaps for KernelTaps {
    fn ensure<'a>(
        &'a self,
        tap: &'a IfName,
        bridge: &'a IfName,
        mac: MacAddr,
    ) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            self.taps
                .ensure(tap, bridge, mac, self.owner)
                .await
                .map(drop)
                .map_err(|e| unavailable("pool", &e))
        })
    }

    fn delete<'a>(&'a self, tap: &'a IfName) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            self.taps
                .delete(tap)
                .await
                .map_err(|e| unavailable("pool", &e))
        })
    }

    fn list(&self) -> BoxFuture<'_, Result<Vec<String>, Error>> {
        Box::pin(async move {
            self.taps
                .list_taps()
                .await
                .map_err(|e| unavailable("pool", &e))
        })
    }

    fn host_addresses(&self) -> BoxFuture<'_, Result<Vec<IpAddr>, Error>> {
        Box::pin(async move {
            let mut out = Vec::new();
            let mut s = self.handle.address().get().execute();
            while let Some(m) = s
                .try_next()
                .await
                .map_err(|e| unavailable("list host addresses", &e))?
            {
                for a in &m.attributes {
                    if let AddressAttribute::Address(ip) = a {
                        let skip = match ip {
                            IpAddr::V4(v) => v.is_loopback(),
                            IpAddr::V6(v) => v.is_loopback() || v.is_unicast_link_local(),
                        };
                        if !skip && !out.contains(ip) {
                            out.push(*ip);
                        }
                    }
                }
            }
            out.sort();
            Ok(out)
        })
    }
}
