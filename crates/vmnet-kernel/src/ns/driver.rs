//! [`NetlinkNsDriver`]: the real [`NsDriver`] over rtnetlink, tap ioctls, sysctls and `nft -j`.

mod gc;
mod teardown;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::Mutex as StdMutex;
use std::time::{Duration, Instant};

use futures::StreamExt;
use netlink_packet_route::link::{InfoKind, LinkAttribute, LinkInfo};
use rtnetlink::{Handle, IpVersion};

use vmnet_plan::ns::{HostPlan, NameKind, NsSettings, VmPlan, parse_uid, plan_host};

use super::gens::NftGens;
use super::host::{self, HostNs};
use super::nftcheck::ListingMemo;
use super::routecache::RouteCache;
use super::rulecache::RuleCache;
use super::{BoxFuture, Change, NsDriver, NsError, ObservedVm, apply, lookup, routes};
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
    host_ready: tokio::sync::Mutex<HostState>,
    /// Held for every dump over [`Self::host`]: a netlink socket runs one dump at a time (a
    /// second one started meanwhile fails with `EBUSY`), and VMs are applied concurrently.
    pub(super) host_dumps: tokio::sync::Mutex<()>,
    pub(super) nft_memo: ListingMemo,
    /// The kept generation socket of each VM netns and its in-sync record (see `gens`).
    pub(super) nft_gens: NftGens,
    /// The host's VM rules, kept from the kernel's notifications (see [`super::rulecache`]).
    pub(super) host_rules: RuleCache,
    /// The host's main-table routes through links, kept from the kernel's notifications (see
    /// [`super::routecache`]).
    pub(super) route_cache: RouteCache,
    /// The uplinks found so far (see `host::ra_uplinks`).
    uplinks_seen: std::sync::Mutex<BTreeSet<String>>,
    /// User ids removed with a deferred teardown, and when: [`NsDriver::gc`] leaves their
    /// remaining devices to the kernel for [`TEARDOWN_GRACE`].
    deferred: StdMutex<HashMap<u32, Instant>>,
    /// Public addresses whose conntrack entries are to be deleted, handed to a background task.
    pub(super) conntrack: tokio::sync::mpsc::UnboundedSender<Vec<IpAddr>>,
    /// The kept nf_tables sockets of the host namespace (public maps).
    pub(super) host_nft: super::hostnft::HostNft,
    /// The packet-activity program, when the agent loaded it ([`Self::with_activity`]).
    pub(super) activity: Option<std::sync::Arc<crate::activity::ActivityRecorder>>,
    /// The guest guard, when the agent loaded it ([`Self::with_guard`]).
    pub(super) guard: Option<std::sync::Arc<crate::guard::GuestGuard>>,
    /// The next VM's namespace, made ahead (see [`super::spare`]).
    pub(super) spares: std::sync::Arc<super::spare::Spares>,
    /// The change notifications of the host and every VM netns, when the agent listens to
    /// them ([`Self::watch_kernel`]).
    watcher: Option<crate::watch::Watcher>,
    /// The class counters of each VM as its last converge observed them.
    pub(super) tc_counters: super::tc::KeptCounters,
}

/// Where the driver stands with the host-wide state (forwarding, router advertisements, the host
/// nft table).
#[derive(Debug, Default, Clone, Copy)]
struct HostState {
    /// Checked (and made as planned) since the last reason to doubt it.
    ready: bool,
    /// This driver has set the host-wide state up at least once since it started (or since it
    /// removed it with the last VM): a difference found after that is drift and counted as a
    /// repair. Before that, a difference is drift only when the host table exists (an earlier
    /// agent made it); making it on a host without one is the set-up, not a repair.
    established: bool,
    /// Garbage collection found no VM and removed the host-wide state: reconcile passes leave
    /// the host alone (no table made only to be removed again) until the next VM's apply.
    idle: bool,
}

/// How long after a deferred removal ([`NsDriver::remove_deferred`]) garbage collection leaves
/// a VM's remaining devices to the kernel's own teardown before it deletes them itself (a
/// namespace some process still holds is never destroyed by the kernel).
pub const TEARDOWN_GRACE: Duration = Duration::from_secs(5);

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
            .map_err(|e| NsError::Invalid(e.message()))?;
        let host_ns = host_netns.map_or(HostNs::Current, HostNs::Named);
        let host = host_ns.netlink()?;
        let worker_ns = host_ns.clone();
        let host_nft = super::hostnft::HostNft::new(host_ns.clone());
        let host_rules = RuleCache::new(host_ns.clone());
        let route_cache = RouteCache::new(host_ns.clone());
        Ok(Self {
            host_plan: plan_host(&settings),
            settings,
            host_ns,
            host,
            host_ready: tokio::sync::Mutex::new(HostState::default()),
            host_dumps: tokio::sync::Mutex::new(()),
            nft_memo: ListingMemo::default(),
            nft_gens: NftGens::default(),
            uplinks_seen: std::sync::Mutex::new(BTreeSet::new()),
            deferred: StdMutex::new(HashMap::new()),
            conntrack: super::public_driver::conntrack_worker(worker_ns),
            host_nft,
            host_rules,
            route_cache,
            activity: None,
            guard: None,
            spares: std::sync::Arc::default(),
            watcher: None,
            tc_counters: super::tc::KeptCounters::default(),
        })
    }

    /// Makes this driver listen to the kernel's change notifications in the host namespace and
    /// in the netns of every VM it applies ([`crate::watch`]): an applied VM's netns is
    /// watched from the end of its apply, and its sockets are closed before its removal
    /// deletes the netns. Returns the events.
    ///
    /// # Errors
    /// The host's notification sockets cannot be opened (the driver works on without).
    pub fn watch_kernel(
        &mut self,
    ) -> Result<tokio::sync::mpsc::UnboundedReceiver<crate::watch::Event>, NsError> {
        let host = match &self.host_ns {
            HostNs::Current => None,
            HostNs::Named(n) => Some(n.as_str()),
        };
        let (w, events) = crate::watch::Watcher::start(host).map_err(|source| {
            NsError::Netns(netns::NetnsError::Io {
                name: self.host_ns.label().to_owned(),
                op: "open notification sockets",
                source,
            })
        })?;
        self.poll_proxies(&w, host)?;
        self.watcher = Some(w);
        Ok(events)
    }

    /// Whether the driver watches the kernel's notifications.
    pub(super) fn watcher_on(&self) -> bool {
        self.watcher.is_some()
    }

    /// Watches `netns` with sockets a create opened inside it.
    pub(super) fn adopt_watch(&self, netns: &str, pair: crate::watch::Pair) {
        if let Some(w) = &self.watcher
            && let Err(e) = w.adopt(netns, pair)
        {
            tracing::warn!(netns, error = %e, "cannot watch the netns's notifications; the periodic pass covers it");
        }
    }

    /// Watches the netns of an applied VM (a no-op without a watcher). A failure is logged:
    /// the periodic pass still covers the VM.
    pub(super) fn watch_netns(&self, netns: &str) {
        if let Some(w) = &self.watcher
            && let Err(e) = w.watch(netns)
        {
            tracing::warn!(netns, error = %e, "cannot watch the netns's notifications; the periodic pass covers it");
        }
    }

    /// This driver, writing each planned activity entry ([`VmPlan::activity`]) in the maps
    /// of `recorder`. Without one, a plan with an activity entry fails as
    /// [`NsError::Invalid`].
    #[must_use]
    pub fn with_activity(
        mut self,
        recorder: std::sync::Arc<crate::activity::ActivityRecorder>,
    ) -> Self {
        self.activity = Some(recorder);
        self
    }

    /// This driver, registering each planned guard entry ([`VmPlan::guard`]) with `guard` and
    /// attaching its program to the VM's tap. Without one, a plan with a guard entry fails as
    /// [`NsError::Invalid`].
    #[must_use]
    pub fn with_guard(mut self, guard: std::sync::Arc<crate::guard::GuestGuard>) -> Self {
        self.guard = Some(guard);
        self
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
        let mut state = self.host_ready.lock().await;
        if state.ready {
            return Ok(None);
        }
        let mut repaired = None;
        if let Some(p) = &self.host_plan {
            let uplinks = {
                let _dumps = self.host_dumps.lock().await;
                host::ra_uplinks(&self.host, &self.settings.name_prefix, &self.uplinks_seen).await?
            };
            if let Some(d) = host::host_drift(&self.host_ns, p, &self.nft_memo, &uplinks)? {
                host::apply_host(&self.host_ns, p, &self.nft_memo, &uplinks)?;
                if state.established || d.table_present {
                    tracing::warn!(drift = %d.what, "host-wide state not as planned; re-applied it");
                    repaired = Some(d.what);
                } else {
                    tracing::info!(changes = %d.what, "namespace mode: set up the host-wide state");
                }
            }
        }
        *state = HostState {
            ready: true,
            established: true,
            idle: false,
        };
        Ok(repaired)
    }

    /// The host-wide drift (`None` when in sync, or when the driver does not manage the host).
    /// Finding some makes the next apply re-check and repair it.
    pub(super) async fn host_drift(&self) -> Result<Option<String>, NsError> {
        let Some(p) = &self.host_plan else {
            return Ok(None);
        };
        let uplinks = {
            let _dumps = self.host_dumps.lock().await;
            host::ra_uplinks(&self.host, &self.settings.name_prefix, &self.uplinks_seen).await?
        };
        let drift = host::host_drift(&self.host_ns, p, &self.nft_memo, &uplinks)?;
        if drift.is_some() {
            self.host_ready.lock().await.ready = false;
        }
        Ok(drift.map(|d| d.what))
    }

    fn name(&self, kind: NameKind, uid: u32) -> String {
        vmnet_plan::ns::name(&self.settings.name_prefix, kind, uid)
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
        let dumps = self.host_dumps.lock().await;
        for l in routes::dump_links(&self.host).await? {
            if let Some(uid) = parse_uid(p, NameKind::HostVeth, &l.name) {
                entry(&mut by_uid, uid);
                by_uid.get_mut(&uid).expect("inserted").host_veth = Some((l.name, l.index));
            }
        }
        drop(dumps);
        for r in self.host_rules.all().await? {
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
        // A per-VM routing table carries no prefix (it is numbered by user id): it counts as
        // ours only beside an object that carries ours (its netns, veth or rule), so an agent
        // with another prefix in the same namespace never finds its tables orphaned here. A
        // table left alone (no rule selects it any more) routes nothing.
        let base = self.settings.host_table_base;
        let mut tables: BTreeSet<u32> = BTreeSet::new();
        for v in [IpVersion::V4, IpVersion::V6] {
            let _dumps = self.host_dumps.lock().await;
            for r in routes::dump_routes(&self.host, v, None, None).await? {
                if let Some(uid) = r
                    .table
                    .checked_sub(base)
                    .filter(|u| *u <= vmnet_model::vm::MAX_USER_ID)
                {
                    tables.insert(uid);
                }
            }
        }
        for uid in tables {
            if by_uid.contains_key(&uid) {
                entry(&mut by_uid, uid);
            }
        }
        // A VM whose netns and veth pair are gone (removed by hand, or by a reboot) while its
        // public mapping stayed in the host table.
        for uid in super::public::element_owners(self)? {
            entry(&mut by_uid, uid);
        }
        Ok(by_uid.into_values().collect())
    }
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

    fn remove_deferred(&self, user_id: u32) -> BoxFuture<'_, Result<Vec<Change>, NsError>> {
        Box::pin(self.remove_with(user_id, true))
    }

    fn release_public(&self, user_id: u32) -> Result<(), NsError> {
        super::public::release(self, user_id)
    }

    fn host_use<'a>(
        &'a self,
        addrs: &'a [IpAddr],
        block: Option<ipnet::Ipv6Net>,
    ) -> BoxFuture<'a, Result<Option<(IpAddr, lookup::HostUse)>, NsError>> {
        Box::pin(lookup::host_use(&self.host, addrs, block))
    }

    fn observe(&self) -> BoxFuture<'_, Result<Vec<ObservedVm>, NsError>> {
        Box::pin(self.observe_all())
    }

    fn gc<'a>(&'a self, keep: &'a [u32]) -> BoxFuture<'a, Result<Vec<u32>, NsError>> {
        Box::pin(self.gc_inner(keep))
    }

    fn apply_limits<'a>(&'a self, plan: &'a VmPlan) -> BoxFuture<'a, Result<Vec<Change>, NsError>> {
        Box::pin(async move {
            match super::tc::change_classes(plan).await? {
                Some(changes) => Ok(changes),
                None => apply::apply(self, plan).await,
            }
        })
    }

    fn apply_public<'a>(&'a self, plan: &'a VmPlan) -> BoxFuture<'a, Result<Vec<Change>, NsError>> {
        Box::pin(super::public_change::apply_public(self, plan))
    }

    fn guard_drops(&self, plan: &VmPlan) -> Result<Option<BTreeMap<&'static str, u64>>, NsError> {
        super::guard::drops(self, plan)
    }

    fn guard_totals(&self) -> Result<Option<crate::guard::GuardTotals>, NsError> {
        super::guard::totals(self)
    }

    fn limit_counters<'a>(
        &'a self,
        plan: &'a VmPlan,
    ) -> BoxFuture<'a, Result<Vec<super::LimitCounters>, NsError>> {
        Box::pin(super::tc::counters(plan))
    }

    fn kept_limit_counters(&self) -> HashMap<u32, Vec<super::LimitCounters>> {
        self.tc_counters.all()
    }

    fn apply_table<'a>(&'a self, plan: &'a VmPlan) -> BoxFuture<'a, Result<Vec<Change>, NsError>> {
        Box::pin(async move {
            super::apply::check_prefix(self, plan)?;
            if !netns::exists(&plan.netns) {
                return super::apply::apply(self, plan).await;
            }
            let what = if super::firewall::change_rules(self, plan)? {
                "the firewall changed (its rules, in one batch)"
            } else {
                super::firewall::replace_table(self, plan)?;
                "the firewall changed"
            };
            Ok(vec![Change::ReplaceNft {
                fingerprint: plan.nft_fingerprint.clone(),
                differences: vec![what.into()],
            }])
        })
    }

    fn audit_table<'a>(
        &'a self,
        plan: &'a VmPlan,
    ) -> BoxFuture<'a, Result<Option<Vec<String>>, NsError>> {
        Box::pin(async move {
            super::apply::check_prefix(self, plan)?;
            super::firewall::audit(self, plan).await
        })
    }

    fn watcher(&self) -> Option<crate::watch::Watcher> {
        self.watcher.clone()
    }

    fn repair_proxies<'a>(
        &'a self,
        plan: &'a VmPlan,
    ) -> BoxFuture<'a, Result<Vec<Change>, NsError>> {
        Box::pin(self.sync_proxies(plan, &[], None))
    }

    fn repair_host(&self) -> BoxFuture<'_, Result<Vec<Change>, NsError>> {
        Box::pin(async {
            {
                let mut state = self.host_ready.lock().await;
                if state.idle {
                    return Ok(Vec::new());
                }
                state.ready = false;
            }
            Ok(self
                .ensure_host()
                .await?
                .map(|what| Change::Repair { what })
                .into_iter()
                .collect())
        })
    }
}
