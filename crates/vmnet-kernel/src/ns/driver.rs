//! [`NetlinkNsDriver`]: the real [`NsDriver`] over rtnetlink, tap ioctls, sysctls and `nft -j`.

use std::collections::{BTreeMap, BTreeSet};

use futures::StreamExt;
use rtnetlink::{Handle, IpVersion};
use std::net::IpAddr;

use ipnet::Ipv6Net;
use vmnet_plan::ns::public::proxy_addresses;
use vmnet_plan::ns::{
    HostPlan, NameKind, NsSettings, PublicNeighbors, VmPlan, parse_uid, plan_host,
};

use super::host::{self, HostNs};
use super::nftcheck::ListingMemo;
use super::routes;
use super::{BoxFuture, Change, NsDriver, NsError, ObservedVm, apply, proxy};
use crate::netns;

/// The real namespace-mode driver for one host.
///
/// The "host" is the process's own network namespace (`host_netns = None`, the agent on a real
/// host or inside a sandbox it entered at start) or a named namespace (`Some(name)`, e.g. a test
/// sandbox): every host-side link, route, rule, sysctl and nft table is made there, never in
/// the namespace of the calling process.
pub struct NetlinkNsDriver {
    pub(super) settings: NsSettings,
    pub(super) host_ns: HostNs,
    pub(super) host: Handle,
    host_plan: Option<HostPlan>,
    host_ready: tokio::sync::Mutex<bool>,
    pub(super) nft_memo: ListingMemo,
    /// The uplinks found so far (see `host::ra_uplinks`).
    uplinks_seen: std::sync::Mutex<BTreeSet<String>>,
    /// Public addresses whose conntrack entries are to be deleted, handed to a background task.
    conntrack: tokio::sync::mpsc::UnboundedSender<Vec<IpAddr>>,
}

impl std::fmt::Debug for NetlinkNsDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetlinkNsDriver")
            .field("settings", &self.settings)
            .field("host_ns", &self.host_ns)
            .finish()
    }
}

impl NetlinkNsDriver {
    /// A driver managing VMs under `settings`, with the host being `host_netns` (a named netns)
    /// or, when `None`, the calling process's namespace.
    ///
    /// # Errors
    /// [`NsError::NoRuntime`] outside a tokio runtime; invalid settings
    /// ([`NsError::Invalid`] with the validation message); the host netns cannot be entered.
    pub fn new(settings: NsSettings, host_netns: Option<String>) -> Result<Self, NsError> {
        tokio::runtime::Handle::try_current().map_err(|_| NsError::NoRuntime)?;
        settings
            .validate()
            .map_err(|e| NsError::Invalid(e.message))?;
        let host_ns = host_netns.map_or(HostNs::Current, HostNs::Named);
        let host = host_ns.netlink()?;
        let worker_ns = host_ns.clone();
        Ok(Self {
            host_plan: plan_host(&settings),
            settings,
            host_ns,
            host,
            host_ready: tokio::sync::Mutex::new(false),
            nft_memo: ListingMemo::default(),
            uplinks_seen: std::sync::Mutex::new(BTreeSet::new()),
            conntrack: conntrack_worker(worker_ns),
        })
    }

    /// The settings this driver was built with.
    #[must_use]
    pub fn settings(&self) -> &NsSettings {
        &self.settings
    }

    /// Checks the host-wide state against the plan and re-applies it on any difference, once per
    /// driver and again after every gc and [`NsDriver::repair_host`] (so every reconcile pass
    /// repairs it) or a drift report that found it wrong. Returns what was repaired.
    pub(super) async fn ensure_host(&self) -> Result<Option<String>, NsError> {
        let mut ready = self.host_ready.lock().await;
        if *ready {
            return Ok(None);
        }
        let mut repaired = None;
        if let Some(p) = &self.host_plan {
            let uplinks =
                host::ra_uplinks(&self.host, &self.settings.name_prefix, &self.uplinks_seen)
                    .await?;
            if let Some(what) = host::host_drift(&self.host_ns, p, &self.nft_memo, &uplinks)? {
                tracing::warn!(drift = %what, "host-wide state not as planned; re-applying it");
                host::apply_host(&self.host_ns, p, &self.nft_memo, &uplinks)?;
                repaired = Some(what);
            }
        }
        *ready = true;
        Ok(repaired)
    }

    /// The host-wide drift (`None` when in sync, or when the driver does not manage the host).
    /// Finding some makes the next apply re-check and repair it.
    pub(super) async fn host_drift(&self) -> Result<Option<String>, NsError> {
        let Some(p) = &self.host_plan else {
            return Ok(None);
        };
        let uplinks =
            host::ra_uplinks(&self.host, &self.settings.name_prefix, &self.uplinks_seen).await?;
        let drift = host::host_drift(&self.host_ns, p, &self.nft_memo, &uplinks)?;
        if drift.is_some() {
            *self.host_ready.lock().await = false;
        }
        Ok(drift)
    }

    fn name(&self, kind: NameKind, uid: u32) -> String {
        vmnet_plan::ns::name(&self.settings.name_prefix, kind, uid)
    }

    /// Removes everything of `uid`: host rules, the host table, the veth pair (and with it the
    /// routes through it), the netns (and with it the tap). Goes on past failures and reports all.
    pub(super) async fn remove_uid(&self, uid: u32) -> Result<Vec<Change>, NsError> {
        let mut errors = Vec::new();
        let mut found = false;
        let host_veth = self.name(NameKind::HostVeth, uid);
        match super::public::remove(self, uid) {
            Ok(held) => {
                found |= !held.is_empty();
                let block = match self.uplink().await {
                    Ok(Some(_)) => self.routed_block_of(&host_veth).await.unwrap_or(None),
                    _ => None,
                };
                if let Err(e) = self.drop_proxies(&held, block, &[]).await {
                    errors.push(e);
                }
                self.flush_conntrack(&held).await;
            }
            Err(e) => errors.push(e),
        }
        let table = self.settings.host_table_base + uid;
        match routes::dump_rules(&self.host).await {
            Ok(rules) => {
                for r in rules.iter().filter(|r| r.iif == host_veth) {
                    found = true;
                    if let Err(e) = routes::del_rule(&self.host, r, "host").await {
                        errors.push(e);
                    }
                }
            }
            Err(e) => errors.push(e),
        }
        for v in [IpVersion::V4, IpVersion::V6] {
            match routes::dump_routes(&self.host, v, Some(table), None).await {
                Ok(rs) => {
                    for r in &rs {
                        found = true;
                        if let Err(e) = routes::del_route(&self.host, r, "host").await {
                            errors.push(e);
                        }
                    }
                }
                Err(e) => errors.push(e),
            }
        }
        match routes::link_by_name(&self.host, &host_veth).await {
            Ok(Some(l)) => {
                found = true;
                match self.host.link().del(l.index).execute().await {
                    Ok(()) => {}
                    Err(e) if routes::errno(&e) == Some(libc::ENODEV) => {}
                    Err(e) => errors.push(routes::nl(format!("host: delete link {host_veth}"))(e)),
                }
            }
            Ok(None) => {}
            Err(e) => errors.push(e),
        }
        let ns = self.name(NameKind::Netns, uid);
        self.nft_memo.forget_netns(&ns);
        if netns::exists(&ns) {
            found = true;
            if let Err(e) = netns::delete(&ns) {
                errors.push(e.into());
            }
        }
        match errors.len() {
            0 => Ok(if found {
                vec![Change::RemoveVm { user_id: uid }]
            } else {
                Vec::new()
            }),
            1 => Err(errors.remove(0)),
            _ => Err(NsError::Many(errors)),
        }
    }

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

    /// The routed public block of the VM whose host veth is `host_veth`, from its host routes.
    async fn routed_block_of(&self, host_veth: &str) -> Result<Option<Ipv6Net>, NsError> {
        let Some(l) = routes::link_by_name(&self.host, host_veth).await? else {
            return Ok(None);
        };
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
    async fn drop_proxies(
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

    /// Every user id with an object of ours on the host.
    pub(super) async fn observe_all(&self) -> Result<Vec<ObservedVm>, NsError> {
        let p = &self.settings.name_prefix;
        let mut by_uid: BTreeMap<u32, ObservedVm> = BTreeMap::new();
        let entry = |m: &mut BTreeMap<u32, ObservedVm>, uid: u32| {
            m.entry(uid)
                .or_insert_with(|| ObservedVm {
                    user_id: uid,
                    ..ObservedVm::default()
                })
                .user_id
        };
        for n in netns::list(p)? {
            if let Some(uid) = parse_uid(p, NameKind::Netns, &n) {
                entry(&mut by_uid, uid);
                by_uid.get_mut(&uid).expect("inserted").netns = Some(n);
            }
        }
        for l in routes::dump_links(&self.host).await? {
            if let Some(uid) = parse_uid(p, NameKind::HostVeth, &l.name) {
                entry(&mut by_uid, uid);
                by_uid.get_mut(&uid).expect("inserted").host_veth = Some((l.name, l.index));
            }
        }
        for r in routes::dump_rules(&self.host).await? {
            if let Some(uid) = parse_uid(p, NameKind::HostVeth, &r.iif) {
                entry(&mut by_uid, uid);
                by_uid.get_mut(&uid).expect("inserted").host_rules.push(
                    vmnet_plan::ns::PlannedRule {
                        iif: r.iif.clone(),
                        table: r.table,
                        priority: r.priority,
                    },
                );
            }
        }
        let base = self.settings.host_table_base;
        for v in [IpVersion::V4, IpVersion::V6] {
            for r in routes::dump_routes(&self.host, v, None, None).await? {
                if let Some(uid) = r
                    .table
                    .checked_sub(base)
                    .filter(|u| *u <= vmnet_model::vm::MAX_USER_ID)
                {
                    entry(&mut by_uid, uid);
                }
            }
        }
        Ok(by_uid.into_values().collect())
    }

    async fn gc_inner(&self, keep: &[u32]) -> Result<Vec<u32>, NsError> {
        let want: BTreeSet<u32> = keep.iter().copied().collect();
        let orphans: Vec<u32> = self
            .observe_all()
            .await?
            .into_iter()
            .map(|o| o.user_id)
            .filter(|u| !want.contains(u))
            .collect();
        // A bounded number at a time: teardown waits on the kernel, not on us.
        let results: Vec<_> = futures::stream::iter(
            orphans
                .clone()
                .into_iter()
                .map(|u| async move { (u, self.remove_uid(u).await) }),
        )
        .buffer_unordered(16)
        .collect()
        .await;
        let mut errors: Vec<NsError> = Vec::new();
        for (uid, r) in results {
            let netns = self.name(NameKind::Netns, uid);
            match r {
                Ok(changes) => tracing::info!(
                    user_id = uid, netns = %netns,
                    removed = ?changes.iter().map(ToString::to_string).collect::<Vec<_>>(),
                    reason = "no stored VM plans to this user id",
                    "namespace mode: collected an orphaned VM"),
                Err(e) => {
                    tracing::warn!(user_id = uid, netns = %netns, error = %e,
                        "namespace mode: collecting an orphaned VM failed");
                    errors.push(e);
                }
            }
        }
        if want.is_empty()
            && let Some(p) = &self.host_plan
        {
            let mut ready = self.host_ready.lock().await;
            host::remove_host(&self.host_ns, p)?;
            if *ready {
                tracing::info!(table = %p.nft_table, reason = "no VM is left on this host",
                    "namespace mode: removed the host masquerade table");
            }
            *ready = false;
        } else if !want.is_empty() {
            let mut ready = self.host_ready.lock().await;
            *ready = false;
            drop(ready);
            self.ensure_host().await?;
        }
        if !errors.is_empty() {
            return Err(NsError::Many(errors));
        }
        Ok(orphans)
    }
}

/// The background task deleting conntrack entries of public addresses. A dump of the conntrack
/// table walks the kernel's whole hash table (262144 buckets here, several ms, whatever the
/// number of VMs), so it runs beside the applies instead of inside each: the applies return as
/// soon as the mapping is in place, and requests that arrive meanwhile share the next dump. A
/// failure is logged: the mapping itself is in place.
fn conntrack_worker(host_ns: HostNs) -> tokio::sync::mpsc::UnboundedSender<Vec<IpAddr>> {
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

impl NsDriver for NetlinkNsDriver {
    fn apply<'a>(&'a self, plan: &'a VmPlan) -> BoxFuture<'a, Result<Vec<Change>, NsError>> {
        Box::pin(apply::apply(self, plan))
    }

    fn drift<'a>(&'a self, plan: &'a VmPlan) -> BoxFuture<'a, Result<Vec<Change>, NsError>> {
        Box::pin(apply::drift(self, plan))
    }

    fn remove(&self, user_id: u32) -> BoxFuture<'_, Result<Vec<Change>, NsError>> {
        Box::pin(self.remove_uid(user_id))
    }

    fn observe(&self) -> BoxFuture<'_, Result<Vec<ObservedVm>, NsError>> {
        Box::pin(self.observe_all())
    }

    fn gc<'a>(&'a self, keep: &'a [u32]) -> BoxFuture<'a, Result<Vec<u32>, NsError>> {
        Box::pin(self.gc_inner(keep))
    }

    fn repair_host(&self) -> BoxFuture<'_, Result<Vec<Change>, NsError>> {
        Box::pin(async {
            *self.host_ready.lock().await = false;
            Ok(self
                .ensure_host()
                .await?
                .map(|what| Change::Repair { what })
                .into_iter()
                .collect())
        })
    }
}
