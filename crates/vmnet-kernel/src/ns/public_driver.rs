//! The driver's part in public addresses on the host: the VMs' proxy ARP/NDP entries on the
//! uplink (`--public-neighbors proxy`) and the background deletion of the conntrack entries of
//! changed public mappings.

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::Ipv6Net;
use rtnetlink::IpVersion;
use vmnet_plan::ns::public::proxy_addresses;
use vmnet_plan::ns::{PublicNeighbors, VmPlan};

use super::driver::NetlinkNsDriver;
use super::host::HostNs;
use super::{Change, NsError, proxy, routes};

impl NetlinkNsDriver {
    /// The uplink's name and index when proxy entries are managed (`--public-neighbors proxy`).
    pub(super) async fn uplink(&self) -> Result<Option<(String, u32)>, NsError> {
        let Some(u) = self
            .settings
            .uplink
            .as_ref()
            .filter(|_| self.settings.public_neighbors == PublicNeighbors::Proxy)
        else {
            return Ok(None);
        };
        match routes::link_by_name(&self.host, u).await? {
            Some(l) => Ok(Some((u.clone(), l.index))),
            None => Err(NsError::Missing(format!(
                "{}: uplink {u} not found (--uplink)",
                self.host_ns.label()
            ))),
        }
    }

    /// Has `w` read the host's proxy entries periodically in proxy mode (they have no change
    /// notifications: [`crate::watch::Watcher::poll_proxies`]).
    pub(super) fn poll_proxies(
        &self,
        w: &crate::watch::Watcher,
        host: Option<&str>,
    ) -> Result<(), NsError> {
        if self.settings.uplink.is_none()
            || self.settings.public_neighbors != PublicNeighbors::Proxy
        {
            return Ok(());
        }
        w.poll_proxies(host, crate::watch::PROXY_POLL)
            .map_err(|e| NsError::Missing(format!("host: read proxy entries: {e}")))
    }

    /// The routed public block of the VM whose host veth is `host_veth`, from its host routes.
    pub(super) async fn routed_block_of(
        &self,
        host_veth: &str,
    ) -> Result<Option<Ipv6Net>, NsError> {
        let Some(l) = routes::link_by_name(&self.host, host_veth).await? else {
            return Ok(None);
        };
        let _dumps = self.host_dumps.lock().await;
        let rs = routes::dump_routes(
            &self.host,
            IpVersion::V6,
            Some(vmnet_plan::ns::MAIN_TABLE),
            Some(l.index),
        )
        .await?;
        Ok(super::apply::routed_block(&rs.into_iter().collect()))
    }

    /// Deletes the proxy entries of `addrs` and of `block`, except those in `keep`.
    pub(super) async fn drop_proxies(
        &self,
        addrs: &[IpAddr],
        block: Option<Ipv6Net>,
        keep: &[IpAddr],
    ) -> Result<Vec<Change>, NsError> {
        let Some((uplink, index)) = self.uplink().await? else {
            return Ok(Vec::new());
        };
        let mut stale: BTreeSet<IpAddr> = addrs.iter().copied().collect();
        stale.extend(proxy_addresses(None, None, block));
        let mut changes = Vec::new();
        for a in stale.into_iter().filter(|a| !keep.contains(a)) {
            if proxy::exists(&self.host, index, a).await? {
                proxy::del(&self.host, index, &uplink, a).await?;
                changes.push(Change::Repair {
                    what: format!("host: delete proxy neighbour {a} dev {uplink}"),
                });
            }
        }
        Ok(changes)
    }

    /// Makes the VM's proxy entries on the uplink what `plan` wants: the planned ones added
    /// when missing, those of `old` addresses (its previous public addresses and routed
    /// `old_block`) deleted when no longer planned. Nothing without proxy mode.
    pub(super) async fn sync_proxies(
        &self,
        plan: &VmPlan,
        old: &[IpAddr],
        old_block: Option<Ipv6Net>,
    ) -> Result<Vec<Change>, NsError> {
        let Some((uplink, index)) = self.uplink().await? else {
            return Ok(Vec::new());
        };
        let want = planned_proxies(plan);
        let mut changes = self.drop_proxies(old, old_block, &want).await?;
        for a in want {
            if !proxy::exists(&self.host, index, a).await? {
                proxy::add(&self.host, index, &uplink, a).await?;
                changes.push(Change::Repair {
                    what: format!("host: add proxy neighbour {a} dev {uplink}"),
                });
            }
        }
        Ok(changes)
    }

    /// The planned proxy entries that are missing (drift).
    pub(super) async fn proxy_drift(&self, plan: &VmPlan) -> Result<Vec<Change>, NsError> {
        let Some((uplink, index)) = self.uplink().await? else {
            return Ok(Vec::new());
        };
        let mut changes = Vec::new();
        for a in planned_proxies(plan) {
            if !proxy::exists(&self.host, index, a).await? {
                changes.push(Change::Repair {
                    what: format!("host: add proxy neighbour {a} dev {uplink}"),
                });
            }
        }
        Ok(changes)
    }

    /// Has the host's conntrack entries of `addrs` (public addresses whose mapping changed)
    /// deleted by the background task, right after the change.
    pub(super) async fn flush_conntrack(&self, addrs: &[IpAddr]) {
        if !addrs.is_empty() {
            // The task lives as long as the driver; a send fails only while it shuts down.
            let _ = self.conntrack.send(addrs.to_vec());
        }
    }
}

/// The background task deleting conntrack entries of public addresses. A dump of the conntrack
/// table walks the kernel's whole hash table (262144 buckets here, several ms, whatever the
/// number of VMs), so it runs beside the applies instead of inside each: the applies return as
/// soon as the mapping is in place, and requests that arrive meanwhile share the next dump. A
/// failure is logged: the mapping itself is in place.
pub(super) fn conntrack_worker(host_ns: HostNs) -> tokio::sync::mpsc::UnboundedSender<Vec<IpAddr>> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Vec<IpAddr>>();
    tokio::spawn(async move {
        while let Some(mut addrs) = rx.recv().await {
            while let Ok(more) = rx.try_recv() {
                addrs.extend(more);
            }
            addrs.sort_unstable();
            addrs.dedup();
            let ns = host_ns.clone();
            let list = addrs.clone();
            let done = tokio::task::spawn_blocking(move || {
                ns.run(move || {
                    // Nothing tracked in this namespace: nothing to delete, no table walk.
                    let count =
                        super::inns::read_sysctls(&["net/netfilter/nf_conntrack_count".to_owned()]);
                    if count.first().and_then(Option::as_deref) == Some("0") {
                        return Ok(0);
                    }
                    crate::conntrack::flush_addresses(&list)
                })
            })
            .await;
            match done {
                Ok(Ok(Ok(n))) => {
                    tracing::debug!(addresses = ?addrs, deleted = n, "conntrack entries of changed public mappings deleted");
                }
                Ok(Ok(Err(e))) => {
                    tracing::warn!(addresses = ?addrs, error = %e, "deleting conntrack entries failed");
                }
                Ok(Err(e)) => {
                    tracing::warn!(addresses = ?addrs, error = %e, "deleting conntrack entries failed");
                }
                Err(e) => {
                    tracing::warn!(addresses = ?addrs, error = %e, "the conntrack task panicked");
                }
            }
        }
    });
    tx
}

/// The proxy entries `plan` wants.
fn planned_proxies(plan: &VmPlan) -> Vec<IpAddr> {
    plan.public
        .as_ref()
        .and_then(|p| p.proxy.as_ref())
        .map(|(_, a)| a.clone())
        .unwrap_or_default()
}
