//! Namespace mode apply layer: one VM's [`VmPlan`] → netns, veth pair, tap, addresses, routes,
//! rules and the netns nftables table; observe, diff, apply, remove and garbage collection.
//!
//! The agent holds an `Arc<dyn NsDriver>`; the real implementation is [`NetlinkNsDriver`]
//! (rtnetlink, tap ioctls, sysctls, nft JSON through libnftables or `nft -j`), constructed
//! explicitly with the host namespace it manages. Tests of the agent use a fake implementing the
//! same trait.
//!
//! # Design
//! - [`NsDriver::apply`] converges one VM: a VM whose netns does not exist yet is created in one
//!   pass (netns, veth pair with the peer created directly inside the netns, tap, sysctls,
//!   addresses, routes, rules, nft); an existing VM is observed, diffed against the plan and only
//!   the differences are applied, in place: a missing tap is made again in the netns, a veth
//!   pair missing or missing one end is made again (a mesh address added adds it, one removed
//!   deletes it), MTU and addresses are set and stale addresses removed — the netns and an
//!   existing tap are never deleted to repair something, so a VMM holding the tap keeps it. Only
//!   a netns path that is not a namespace at all (a create interrupted by a crash) is removed and
//!   created again. A failure while creating removes everything of that VM; a failure while
//!   converging restores the routes and rules observed before (the previous good state) and
//!   reports the error.
//! - Everything the driver touches carries a derived name from `vmnet_plan::ns::names`, so
//!   [`NsDriver::observe`] and [`NsDriver::gc`] find objects by prefix and user id only.
//! - Namespaces are entered on short-lived dedicated threads; netlink sockets opened there stay
//!   bound to the namespace (see [`crate::netns`]). A create does all in-netns synchronous work
//!   (unshare + mount, tap ioctls, sysctls, the nft transaction, opening the netlink socket) on
//!   the one thread that made the namespace; the rest are concurrent netlink requests.
//! - The nft tables (each VM's netns table, the host table) are read back and compared with the
//!   plan by content (`vmnet_plan::nftdiff::diff_plan`: chains with hook, priority and policy,
//!   rules in order, sets, elements; listing details normalized away); any difference replaces
//!   the table in one transaction. The plan's fingerprint is still the comment of the first rule,
//!   for people reading the ruleset.
//! - Public addresses: after the links, routes and netns table, the VM's elements in the host
//!   table `inet <prefix>_pub` are read by key and changed in one transaction (`public`), its
//!   proxy neighbour entries on the uplink are added or deleted one at a time (`proxy`), and the
//!   host's conntrack entries of every public address whose mapping changed are deleted over
//!   ctnetlink ([`crate::conntrack`]). Removing a VM does the same for what it held.
//! - A mesh-via route (`2000::/3 via fdaa:1::56`) is resolved when applied: the host's FIB entry
//!   for the gateway's mesh address (only an entry inside `fdaa::/16`, never the default route)
//!   gives next hop and device. Next to it sits an `unreachable` route of the same destination
//!   with metric 0xffff0000, so a gateway that disappears (its veth and the routes
//!   through it deleted by the kernel) never lets the traffic fall through to the uplink. While
//!   the gateway cannot be resolved the route itself is `unreachable`; `drift` reports the
//!   difference until an apply finds the gateway.
//!
//! # Limitations
//! - The veth peer cannot be created already up in the target namespace (the kernel answers
//!   `ENOTCONN`); it is brought up with a second request.
//! - Teardown is kernel-bound: deleting a veth pair waits for the kernel (≈ 30–40 ms).
//!   [`NsDriver::remove_deferred`] (the agent's DELETE) does not wait: it unmounts the netns and
//!   lets the kernel destroy the namespace and its devices afterwards.
//! - A listing shape the nft comparison does not normalize (another nft version) costs one
//!   re-apply of that table per plan and driver, then that listing is remembered as the plan's
//!   form (logged, see `nftcheck`).
//! - Gateway resolution happens on apply; the agent's periodic reconcile re-resolves.
//! - Per-VM work is kept independent of the number of VMs where the driver controls it:
//!   sysctls go through a private detached procfs instance (a lookup of `/proc/sys/net` walks
//!   one cached entry per namespace: ~1.5 ms with 1000 namespaces), `/run/netns` is made shared
//!   once per process, and veth ends get derived ifindexes (host end `0x30000000 + uid`, VM end
//!   `0x38000000 + uid`, or a second derived pair when the host index is taken: equal ones
//!   would make the kernel queue their carrier changes as not urgent, see `create`) so nothing
//!   is read back. What still grows is kernel work under RTNL
//!   (README, "Namespace mode: the agent at 1,000 VMs"): above all the walk of every host IPv6
//!   route when a host end's carrier comes on. So the host end carries no IPv6 address
//!   (`addrgenmode none`, set while it is down; the two ends reach each other through permanent
//!   neighbour entries, `links`), its kernel `ff00::/8` route is deleted, and it is read back
//!   while down, so that the walk happens once per VM, in the kernel's link-watch work, not in
//!   our request. One host IPv6 route per VM is left: its mesh /128.
//! - Each VM with a mesh-via route adds one host rule (`iif <host veth>`); the kernel walks
//!   rules linearly, so thousands of such VMs cost per-packet rule checks on the host.

mod activity;
mod apply;
mod create;
mod dnatbatch;
mod driver;
mod firewall;
mod fwbatch;
mod gens;
mod gens_saved;
mod guard;
mod guestneigh;
mod host;
mod hostnft;
mod inns;
mod kinds;
mod links;
mod lookup;
mod nftcheck;
mod observe;
mod proxy;
mod public;
mod public_change;
mod public_driver;
mod routecache;
mod routes;
mod rulecache;
mod rules;
mod spare;
mod tc;

use std::fmt;
use std::future::Future;
use std::pin::Pin;

use vmnet_plan::ns::{PlannedRule, VmPlan};

pub use driver::{NetlinkNsDriver, TEARDOWN_GRACE};
pub use kinds::ObjectKind;
pub use lookup::HostUse;
pub use tc::LimitCounters;

/// A boxed future, so [`NsDriver`] is object safe (`Arc<dyn NsDriver>`).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The namespace-mode apply layer for one host.
///
/// Different VMs may be applied or removed concurrently; calls for the same user id must not
/// overlap (the agent serializes them per VM).
pub trait NsDriver: Send + Sync {
    /// Creates or converges one VM. Idempotent: a second apply of the same plan returns no
    /// changes. On failure the VM's partial apply is rolled back (a new VM is removed; an
    /// existing VM keeps its previous routes, rules and nft table).
    fn apply<'a>(&'a self, plan: &'a VmPlan) -> BoxFuture<'a, Result<Vec<Change>, NsError>>;

    /// The differences between the kernel and `plan` (empty when in sync): the drift report.
    fn drift<'a>(&'a self, plan: &'a VmPlan) -> BoxFuture<'a, Result<Vec<Change>, NsError>>;

    /// Removes everything of the VM with this user id (netns, veth pair, tap, host routes and
    /// rules). Removing a VM that does not exist succeeds with no changes.
    fn remove(&self, user_id: u32) -> BoxFuture<'_, Result<Vec<Change>, NsError>>;

    /// Like [`NsDriver::remove`], but may answer before the kernel has destroyed the VM's
    /// devices: when it returns, the netns is gone (unmounted) and the host rules and the VM's
    /// host table are deleted; the kernel destroys the namespace, the tap, the veth pair and the
    /// routes through it in its own cleanup work soon after. Meanwhile an apply of the same user
    /// id works (a host veth end still present is deleted first), and [`NsDriver::gc`] leaves the
    /// remaining devices to the kernel for a grace period, then deletes whatever is left (e.g.
    /// of a namespace some process still holds, which the kernel never destroys).
    ///
    /// The default is [`NsDriver::remove`].
    fn remove_deferred(&self, user_id: u32) -> BoxFuture<'_, Result<Vec<Change>, NsError>> {
        self.remove(user_id)
    }

    /// After a VM's user id changed from `user_id` to another and the new one applied: drops
    /// the old user id's own entries of the host's public maps (those keyed by its transit
    /// address) and leaves the entries keyed by the VM's public and mesh addresses, which now
    /// belong to the new user id. Call before removing the old user id's objects, which would
    /// otherwise take those shared entries with them.
    ///
    /// The default does nothing (a driver without a host).
    fn release_public(&self, user_id: u32) -> Result<(), NsError> {
        let _ = user_id;
        Ok(())
    }

    /// What exists on the host with our prefix, by user id.
    fn observe(&self) -> BoxFuture<'_, Result<Vec<ObservedVm>, NsError>>;

    /// Why one of `addrs`, or an address inside `block`, may not be a VM's public address on
    /// this host: the first such address and what the host uses it for ([`HostUse`]), one route
    /// lookup per address (more only for an address on one of the host's subnets). `None` when
    /// all are free, and always for a driver that does not manage a host.
    fn host_use<'a>(
        &'a self,
        addrs: &'a [std::net::IpAddr],
        block: Option<ipnet::Ipv6Net>,
    ) -> BoxFuture<'a, Result<Option<(std::net::IpAddr, HostUse)>, NsError>> {
        let _ = (addrs, block);
        Box::pin(async { Ok(None) })
    }

    /// The change notifications this driver listens to, when it does
    /// ([`NetlinkNsDriver::watch_kernel`]); `None` by default.
    fn watcher(&self) -> Option<crate::watch::Watcher> {
        None
    }

    /// Checks the host-wide state (forwarding and router-advertisement sysctls, the host nft
    /// table) and repairs what differs; returns the repairs (empty when in sync, and always for
    /// a driver that does not manage the host). A host whose last VM garbage collection removed
    /// is left alone until the next VM's apply.
    fn repair_host(&self) -> BoxFuture<'_, Result<Vec<Change>, NsError>> {
        Box::pin(async { Ok(Vec::new()) })
    }

    /// Checks the proxy ARP/NDP entries `plan` wants on the uplink (`--public-neighbors
    /// proxy`) and adds the missing ones, as an apply's comparison of them does: one lookup per
    /// entry, nothing written when all are there. The entries of other VMs and those of the
    /// VM's earlier addresses are left alone (an apply deletes the latter). Returns the
    /// repairs; always none for a driver that does not manage a host (the default).
    fn repair_proxies<'a>(
        &'a self,
        plan: &'a VmPlan,
    ) -> BoxFuture<'a, Result<Vec<Change>, NsError>> {
        let _ = plan;
        Box::pin(async { Ok(Vec::new()) })
    }

    /// Removes every VM object with our prefix whose user id is not in `keep` (the user ids of
    /// the desired VMs); with none kept also the host-wide objects. Returns the user ids removed.
    ///
    /// It takes user ids, not plans: a caller collecting many VMs need not hold every VM's plan
    /// (each carries its nft ruleset, tens of KiB) at once.
    fn gc<'a>(&'a self, keep: &'a [u32]) -> BoxFuture<'a, Result<Vec<u32>, NsError>>;

    /// Applies a plan that differs from the applied one in its throughput limits only: the HTB
    /// classes are changed in place, without the full observe of [`NsDriver::apply`]; when that
    /// cannot do it (a tree must be added or removed) it is a full `apply`. The next reconcile
    /// pass reads everything back as usual.
    fn apply_limits<'a>(&'a self, plan: &'a VmPlan) -> BoxFuture<'a, Result<Vec<Change>, NsError>> {
        self.apply(plan)
    }

    /// Applies a plan that differs from the applied one in its netns nft table only (a changed
    /// firewall): when the table is known to be the previous plan's, of the same shape, at the
    /// netns's current nf_tables generation, the firewall's two rule chains are flushed and
    /// written in one batch over netlink; otherwise the table is replaced in one transaction. Either
    /// way with the conntrack sweep of [`NsDriver::audit_table`], without the full observe of
    /// [`NsDriver::apply`]; a VM whose netns does not exist is a full `apply`. The next
    /// reconcile pass or audit reads everything back.
    fn apply_table<'a>(&'a self, plan: &'a VmPlan) -> BoxFuture<'a, Result<Vec<Change>, NsError>> {
        self.apply(plan)
    }

    /// Applies a plan that differs from the applied one in its public IPv4 or mapped public IPv6
    /// only (no routed block on either side): the netns table's public DNAT rule rewritten in
    /// one rule batch (the whole table replaced when it is not known to be of the plan's shape),
    /// the host routes through the VM's host veth made as planned, the VM's public elements on
    /// the host changed in one transaction, its proxy entries synced and the conntrack entries
    /// of the addresses it gained or lost deleted, all without the full observe of
    /// [`NsDriver::apply`] (spec "Routes", the public address table). A VM whose netns or host
    /// veth does not exist is a full `apply`. The next reconcile pass reads everything back.
    fn apply_public<'a>(&'a self, plan: &'a VmPlan) -> BoxFuture<'a, Result<Vec<Change>, NsError>> {
        self.apply(plan)
    }

    /// Audits the VM's netns table (its firewall with it): compares it with `plan` by content and
    /// replaces it when it differs, removing the tracked connections the planned firewall does
    /// not admit. Returns the differences replaced; `None` when in sync, when the VM's netns
    /// does not exist (the reconcile pass makes it), and always for a driver without tables.
    fn audit_table<'a>(
        &'a self,
        plan: &'a VmPlan,
    ) -> BoxFuture<'a, Result<Option<Vec<String>>, NsError>> {
        let _ = plan;
        Box::pin(async { Ok(None) })
    }

    /// The guest guard's drops of the VM of `plan` by kind
    /// ([`vmnet_plan::ns::guard::DROP_KINDS`]); `None` when the plan has no guard entry or the
    /// VM is not registered (and always for a driver without the guard).
    ///
    /// # Errors
    /// A map error.
    fn guard_drops(
        &self,
        plan: &VmPlan,
    ) -> Result<Option<std::collections::BTreeMap<&'static str, u64>>, NsError> {
        let _ = plan;
        Ok(None)
    }

    /// The guest guard's drops of the whole host; `None` for a driver without the guard.
    ///
    /// # Errors
    /// A map error.
    fn guard_totals(&self) -> Result<Option<crate::guard::GuardTotals>, NsError> {
        Ok(None)
    }

    /// The throughput limits of the VM of `plan` with their counters, per class and direction
    /// (empty for a driver that does not shape, and for a VM whose netns does not exist).
    fn limit_counters<'a>(
        &'a self,
        plan: &'a VmPlan,
    ) -> BoxFuture<'a, Result<Vec<LimitCounters>, NsError>> {
        let _ = plan;
        Box::pin(async { Ok(Vec::new()) })
    }

    /// The class counters of every VM with limits in force (by user id), as the VM's last
    /// converge (a full reconcile pass, a check on a notification, a full apply) observed
    /// them: no kernel read, so a scrape of every VM costs nothing in the kernel; the values lag
    /// by at most one reconcile interval. Empty for a driver that does not shape.
    fn kept_limit_counters(&self) -> std::collections::HashMap<u32, Vec<LimitCounters>> {
        std::collections::HashMap::new()
    }
}

/// What [`NsDriver::observe`] found for one user id.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ObservedVm {
    /// The user id encoded in the names.
    pub user_id: u32,
    /// The netns name, if it exists.
    pub netns: Option<String>,
    /// The host veth name and ifindex, if it exists.
    pub host_veth: Option<(String, u32)>,
    /// The host rules (`iif <host veth>`) found.
    pub host_rules: Vec<PlannedRule>,
}

/// Where a change happens.
pub use vmnet_plan::ns::diff::Side;

/// One ordered change the driver made (or, in a drift report, would make).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Created the netns and everything inside it that is fixed per VM (tap, sysctls, lo,
    /// addresses, veth pair).
    CreateVm {
        /// The netns name.
        netns: String,
    },
    /// A fixed part was missing or wrong and was repaired in place (e.g. the tap deleted by
    /// hand, one end of the veth pair gone, an MTU or address changed, the host table edited).
    Repair {
        /// What was repaired.
        what: String,
    },
    /// Added the veth pair to an existing netns (a mesh address added, or the pair deleted).
    AddVeth {
        /// The host end.
        host: String,
        /// The netns end.
        peer: String,
    },
    /// Deleted the veth pair of a VM that has no mesh address any more.
    DelVeth {
        /// The host end.
        host: String,
    },
    /// Added (or replaced) a route, described as `dst table T kind`.
    AddRoute(Side, String),
    /// Deleted a route.
    DelRoute(Side, String),
    /// Added a rule, described as `iif X lookup T pref P`.
    AddRule(Side, String),
    /// Deleted a rule.
    DelRule(Side, String),
    /// Made or deleted a permanent neighbour entry (the guest's on its tap), described as
    /// `IP dev TAP permanent` or `del IP dev TAP`.
    Neighbour(Side, String),
    /// Replaced the netns nft table (one transaction).
    ReplaceNft {
        /// The fingerprint applied.
        fingerprint: String,
        /// How the table differed from the plan, one line each.
        differences: Vec<String>,
    },
    /// Wrote tc objects of the throughput limits (a limit change is a class change).
    Tc {
        /// The device in the VM netns.
        dev: String,
        /// What was done.
        what: String,
    },
    /// Wrote the VM's entry in the guest guard's map or attached the guard to its tap
    /// ([`crate::guard`]).
    Guard {
        /// The VM's tap.
        dev: String,
        /// What was done.
        what: String,
    },
    /// Wrote the VM's entry in the packet-activity program's map ([`crate::activity`]).
    Activity {
        /// The VM's tap.
        dev: String,
        /// What was done.
        what: String,
    },
    /// Replaced an object an earlier agent wrote with this agent's version of it, as
    /// configure on start does (e.g. the per-tap activity filter of an earlier version
    /// deleted after an upgrade). Not drift: nothing was changed behind the agent's back
    /// ([`Change::is_drift`]).
    Upgrade {
        /// The device in the VM netns.
        dev: String,
        /// What was replaced.
        what: String,
    },
    /// Removed the VM's objects.
    RemoveVm {
        /// The user id.
        user_id: u32,
    },
}

impl Change {
    /// Whether this change repairs drift (something changed behind the agent's back) when made
    /// to a VM whose config was already applied: every change but [`Change::Upgrade`].
    #[must_use]
    pub fn is_drift(&self) -> bool {
        !matches!(self, Self::Upgrade { .. })
    }
}

impl fmt::Display for Change {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::CreateVm { netns } => write!(f, "create vm netns {netns}"),
            Self::Repair { what } => write!(f, "repair {what}"),
            Self::AddVeth { host, peer } => write!(f, "host: add veth {host}/{peer}"),
            Self::DelVeth { host } => write!(f, "host: delete veth {host}"),
            Self::AddRoute(s, r) => write!(f, "{s}: add route {r}"),
            Self::DelRoute(s, r) => write!(f, "{s}: delete route {r}"),
            Self::AddRule(s, r) => write!(f, "{s}: add rule {r}"),
            Self::DelRule(s, r) => write!(f, "{s}: delete rule {r}"),
            Self::Neighbour(s, n) => write!(f, "{s}: neighbour {n}"),
            Self::ReplaceNft {
                fingerprint,
                differences,
            } => write!(
                f,
                "vm: replace nft table ({fingerprint}): {}",
                differences.join("; ")
            ),
            Self::Tc { dev, what } => write!(f, "vm: tc {dev}: {what}"),
            Self::Activity { dev, what } => write!(f, "vm: activity {dev}: {what}"),
            Self::Guard { dev, what } => write!(f, "vm: guard {dev}: {what}"),
            Self::Upgrade { dev, what } => write!(f, "vm: upgrade {dev}: {what}"),
            Self::RemoveVm { user_id } => write!(f, "remove vm user id {user_id}"),
        }
    }
}

/// Errors of the namespace-mode driver; each names the object.
#[derive(Debug, thiserror::Error)]
pub enum NsError {
    /// A namespace operation failed.
    #[error(transparent)]
    Netns(#[from] crate::netns::NetnsError),
    /// A netlink request failed.
    #[error("{what}")]
    Netlink {
        /// What was attempted, naming the object (`add route 10.0.0.0/8 in vmnn0007`).
        what: String,
        /// The netlink error.
        #[source]
        source: rtnetlink::Error,
    },
    /// Creating or configuring the tap failed.
    #[error("tap {name}: {op}")]
    Tap {
        /// The tap name.
        name: String,
        /// The ioctl or step.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Writing a sysctl failed.
    #[error("sysctl {path} in {netns}")]
    Sysctl {
        /// The namespace.
        netns: String,
        /// The path under /proc/sys.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// `nft` failed.
    #[error("nft in {netns}: {message}")]
    Nft {
        /// The namespace (`host` for the host netns).
        netns: String,
        /// nft's stderr or the spawn error.
        message: String,
    },
    /// An object we expected is missing (e.g. a link just created).
    #[error("{0}")]
    Missing(String),
    /// The settings or the plan do not fit this driver (invalid settings, another name prefix).
    #[error("{0}")]
    Invalid(String),
    /// Several failures during a teardown, all reported.
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Many(Vec<NsError>),
    /// The driver needs a tokio runtime.
    #[error("the namespace driver needs a tokio runtime")]
    NoRuntime,
    /// The packet-activity maps, link or an earlier version's filter ([`crate::activity`]).
    #[error(transparent)]
    Activity(#[from] crate::activity::ActivityError),
    /// The guest guard's maps or its attachment to a tap ([`crate::guard`]).
    #[error(transparent)]
    Guard(#[from] crate::guard::GuestGuardError),
}
