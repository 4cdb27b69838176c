//! Packet activity: the shared BPF program that records, per VM user id, when the guest last
//! received TCP from the host side (spec: namespaced-vm-networking.md, "Packet activity and
//! wake"; the program is `bpf/activity.bpf.c`).
//!
//! # Design
//! - One program object per agent: [`ActivityRecorder::open`] loads `activity_out` once and
//!   every VM's tap gets a `cls_bpf` direct-action filter running it (the plan's
//!   [`ActivityPlan`]: clsact egress of the tap, fixed priority and handle). Filters are written
//!   with `RTM_NEWTFILTER` without `NLM_F_EXCL`, so a filter an earlier agent left is swapped to
//!   the new program atomically: no moment without a filter.
//! - Maps and program are pinned under a configurable root in bpffs (`<root>/activity_dev`,
//!   `<root>/activity_last`, `<root>/activity_out`). A starting agent reuses the pinned maps
//!   (aya's pin-by-name: the kernel object is opened, not re-created) and replaces the program
//!   pin, so "configure on start replaces the program and keeps its map": recorded times
//!   survive agent restarts and upgrades. The filters keep the kernel recording while no agent
//!   runs. If the root is not on a bpffs, one is mounted there.
//! - The program finds the VM by the packet's ingress device: host traffic enters the VM
//!   namespace through the VM's veth end, whose ifindex the agent registers → user id in
//!   `activity_dev`; what the namespace sends itself (the metadata service) has none. Tap
//!   ifindexes repeat across namespaces; the veth ends get derived, distinct ones (`0x30000000
//!   + uid`). A netns cookie would name the namespace itself, but measured here, forwarded
//!   packets on the tap's egress were not found under the cookie `SO_NETNS_COOKIE` gives for
//!   the VM namespace (`bpf_get_netns_cookie` in a tc program goes by the packet's socket, and
//!   a forwarded packet has none).
//! - Times are `CLOCK_BOOTTIME` nanoseconds (`bpf_ktime_get_boot_ns`: monotonic, and counting a
//!   host suspend, so an idle time never shrinks over one). [`ActivityRecorder::last`]
//!   converts them to wall-clock time from one reading of both clocks.
//! - Observe and repair by content: the filter at our priority and handle must be a direct-action
//!   `bpf` filter running this recorder's program id, and the veth end's ifindex must map to the
//!   plan's user id; anything else is rewritten (`drift` reports it first).
//!
//! # Limitations
//! - A packet delivered while a VM's namespace is being set up (before its filter and
//!   registration are written) is not recorded: clients must retry, as the spec says of a starting VM.
//! - IPv6 packets with more than six extension headers before TCP are not counted.
//! - A VM whose veth pair could not get its derived ifindex (the host had it in use) has a
//!   kernel-chosen index in its namespace, which may equal another such VM's: the later
//!   registration wins and the earlier VM's activity is recorded under the later one's id
//!   (logged when it happens).
//! - The time is stored at most once per millisecond per VM (most packets of a busy flow only
//!   read it), so it is exact to 1 ms.

mod clock;
mod filter;
mod pins;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use aya::maps::{Array, HashMap as BpfHashMap, MapData};
use aya::programs::SchedClassifier;
use aya::{Ebpf, EbpfLoader};
use rtnetlink::Handle;
use vmnet_plan::ns::activity::{ActivityPlan, PROGRAM};

use crate::netns::NetnsError;

use clock::boottime_ns;
pub use clock::wall_time;
pub use filter::ObservedFilter;
pub use pins::remove_root;

/// The compiled BPF object.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/activity.o"));

/// The map of VM veth ifindexes → user ids.
pub(crate) const DEV_MAP: &str = "activity_dev";
/// The array of last-activity times by user id.
pub(crate) const LAST_MAP: &str = "activity_last";

/// An activity failure, naming the object.
#[derive(Debug, thiserror::Error)]
pub enum ActivityError {
    /// The pin root could not be prepared (not creatable, bpffs not mountable).
    #[error("activity pin root {path}: {what}")]
    Root {
        /// The root.
        path: PathBuf,
        /// What failed.
        what: String,
    },
    /// The BPF object could not be loaded (no BPF support, not root, incompatible pinned map).
    #[error("load the activity program")]
    Load(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// Attaching the filter to a tap failed.
    #[error("{netns}: attach the activity filter to {dev}")]
    Attach {
        /// The VM namespace.
        netns: String,
        /// The device.
        dev: String,
        /// What failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Reading the filters of a device failed.
    #[error("{netns}: read the filters of {dev}")]
    Observe {
        /// The VM namespace.
        netns: String,
        /// The device.
        dev: String,
        /// The netlink error.
        #[source]
        source: rtnetlink::Error,
    },
    /// A map operation failed.
    #[error("activity map {map}")]
    Map {
        /// The map.
        map: &'static str,
        /// What failed.
        #[source]
        source: aya::maps::MapError,
    },
    /// The device does not exist in the namespace.
    #[error("{netns}: no device {dev}")]
    NoDevice {
        /// The VM namespace.
        netns: String,
        /// The device.
        dev: String,
    },
    /// The namespace could not be entered.
    #[error("netns")]
    Netns(#[from] NetnsError),
}

fn map_err(map: &'static str) -> impl Fn(aya::maps::MapError) -> ActivityError {
    move |source| ActivityError::Map { map, source }
}

/// The loaded activity program with its pinned maps. All methods are blocking (bpf(2), netlink
/// from a thread inside the namespace) except [`Self::drift`] and [`Self::sync`], which read
/// filters over the namespace's rtnetlink handle.
pub struct ActivityRecorder {
    root: PathBuf,
    bpf: Mutex<Ebpf>,
    /// The device map's registrations by user id (user id → VM veth ifindexes), read from the
    /// map once at load and kept with every write since, so registering or forgetting one VM
    /// never walks the map (a walk is two bpf(2) calls per VM of the host). Locked after `bpf`.
    by_uid: Mutex<BTreeMap<u32, BTreeSet<u32>>>,
    prog_id: u32,
    prog_tag: u64,
}

impl std::fmt::Debug for ActivityRecorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActivityRecorder")
            .field("root", &self.root)
            .field("prog_id", &self.prog_id)
            .finish_non_exhaustive()
    }
}

/// One step towards a VM's planned activity state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ActivityFix {
    /// The filter is missing or not ours: write it (create or replace).
    Filter(String),
    /// The filter runs the activity program an earlier agent loaded (an agent restart): swap
    /// it to this recorder's program, as configure on start does. Not drift.
    Upgrade(String),
    /// The VM veth end is not registered under the plan's user id: register ifindex `.0`.
    Register(u32, String),
}

impl ActivityFix {
    /// What differs, in words.
    #[must_use]
    pub fn what(&self) -> &str {
        match self {
            Self::Filter(w) | Self::Upgrade(w) | Self::Register(_, w) => w,
        }
    }
}

/// The activity filter (a direct-action `bpf` filter running a program named
/// [`PROGRAM`], at the planned priority and handle) on the egress of `tap` in `netns` (whose
/// rtnetlink handle is `ns`), whichever agent loaded its program; `None` when there is none or
/// no such device. Needs no loaded program: a host with packet activity off finds the filters
/// an earlier agent left.
///
/// # Errors
/// [`ActivityError::Observe`].
pub async fn leftover_filter(
    netns: &str,
    ns: &Handle,
    tap: &str,
) -> Result<Option<ObservedFilter>, ActivityError> {
    let p = vmnet_plan::ns::activity::plan(tap, "", 0);
    match filter::observe(netns, ns, &p).await {
        Ok(Some(f)) if f.is_activity_program() => Ok(Some(f)),
        Ok(_) | Err(ActivityError::NoDevice { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Removes the activity filter of `plan` from its device in `netns` (no loaded program
/// needed). `Ok(false)` when there was none.
///
/// # Errors
/// [`ActivityError::Attach`] when listing or deleting the filter fails.
pub fn detach_filter(netns: &str, plan: &ActivityPlan) -> Result<bool, ActivityError> {
    crate::netns::run_in(netns, || filter::detach(plan))?.map_err(|source| ActivityError::Attach {
        netns: netns.to_owned(),
        dev: plan.dev.clone(),
        source,
    })
}

impl ActivityRecorder {
    /// Loads the activity program with its maps pinned under `root` (created, and a bpffs
    /// mounted on it when it is not on one): maps already pinned there are reused with their
    /// contents, the program pin is replaced by the new program.
    ///
    /// # Errors
    /// [`ActivityError::Root`], [`ActivityError::Load`] (no BPF support, not root, a pinned map
    /// of another shape).
    pub fn open(root: &Path) -> Result<Self, ActivityError> {
        pins::prepare_root(root)?;
        let mut bpf = EbpfLoader::new()
            .default_map_pin_directory(root)
            .load(OBJECT)
            .map_err(|e| ActivityError::Load(Box::new(e)))?;
        let prog: &mut SchedClassifier = bpf
            .program_mut(PROGRAM)
            .ok_or_else(|| ActivityError::Load(format!("no program {PROGRAM}").into()))?
            .try_into()
            .map_err(|e| ActivityError::Load(Box::new(e)))?;
        prog.load().map_err(|e| ActivityError::Load(Box::new(e)))?;
        let info = prog.info().map_err(|e| ActivityError::Load(Box::new(e)))?;
        pins::pin_program(root, prog)?;
        let by_uid = index_by_uid(&dev_map(&mut bpf)?);
        Ok(Self {
            root: root.to_owned(),
            bpf: Mutex::new(bpf),
            by_uid: Mutex::new(by_uid),
            prog_id: info.id(),
            prog_tag: info.tag(),
        })
    }

    /// The kernel id of the loaded program (what every filter must run).
    #[must_use]
    pub fn program_id(&self) -> u32 {
        self.prog_id
    }

    /// The tag of the loaded program (a hash of its instructions).
    #[must_use]
    pub fn program_tag(&self) -> u64 {
        self.prog_tag
    }

    /// The pin root.
    #[must_use]
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ebpf> {
        self.bpf
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn by_uid(&self) -> std::sync::MutexGuard<'_, BTreeMap<u32, BTreeSet<u32>>> {
        self.by_uid
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// What differs between the kernel and `plan` for the VM in namespace `netns` (whose
    /// rtnetlink handle is `ns`); empty when in sync.
    ///
    /// # Errors
    /// [`ActivityError::NoDevice`], [`ActivityError::Observe`], map errors.
    pub async fn drift(
        &self,
        netns: &str,
        ns: &Handle,
        plan: &ActivityPlan,
    ) -> Result<Vec<ActivityFix>, ActivityError> {
        let mut fixes = Vec::new();
        match filter::observe(netns, ns, plan).await? {
            None => fixes.push(ActivityFix::Filter(format!(
                "no activity filter on {} egress",
                plan.dev
            ))),
            Some(f) if !f.is_program(self.prog_id) && f.is_activity_program() => {
                fixes.push(ActivityFix::Upgrade(format!(
                    "activity filter on {} egress runs {f}, an earlier agent's program: swapped to program {}",
                    plan.dev, self.prog_id
                )));
            }
            Some(f) if !f.is_program(self.prog_id) => fixes.push(ActivityFix::Filter(format!(
                "activity filter on {} egress runs {f}, not program {}",
                plan.dev, self.prog_id
            ))),
            Some(_) => {}
        }
        let index = filter::ifindex(netns, ns, &plan.ingress_dev).await?;
        let registered = self.registered(index)?;
        if registered != Some(plan.user_id) {
            fixes.push(ActivityFix::Register(
                index,
                format!(
                    "{} (ifindex {index}) registered as {registered:?}, not user id {}",
                    plan.ingress_dev, plan.user_id
                ),
            ));
        }
        Ok(fixes)
    }

    /// Makes the kernel match `plan` (see [`Self::drift`]) and returns what was fixed.
    ///
    /// # Errors
    /// As [`Self::drift`], and [`ActivityError::Attach`].
    pub async fn sync(
        &self,
        netns: &str,
        ns: &Handle,
        plan: &ActivityPlan,
    ) -> Result<Vec<ActivityFix>, ActivityError> {
        let fixes = self.drift(netns, ns, plan).await?;
        for f in &fixes {
            match f {
                ActivityFix::Register(index, _) => self.register(*index, plan.user_id)?,
                ActivityFix::Filter(_) | ActivityFix::Upgrade(_) => self.attach(netns, plan)?,
            }
        }
        Ok(fixes)
    }

    /// The user id registered for VM veth ifindex `index`.
    fn registered(&self, index: u32) -> Result<Option<u32>, ActivityError> {
        let bpf = self.lock();
        let map = bpf.map(DEV_MAP).ok_or(ActivityError::Map {
            map: DEV_MAP,
            source: aya::maps::MapError::InvalidName {
                name: DEV_MAP.into(),
            },
        })?;
        let m = BpfHashMap::<_, u32, u32>::try_from(map).map_err(map_err(DEV_MAP))?;
        match m.get(&index, 0) {
            Ok(u) => Ok(Some(u)),
            Err(aya::maps::MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(map_err(DEV_MAP)(e)),
        }
    }

    /// Registers the VM veth end with ifindex `index` under `uid`, dropping any other index
    /// registered under the same user id (a veth pair made again may have another).
    ///
    /// # Errors
    /// A map error.
    pub fn register(&self, index: u32, uid: u32) -> Result<(), ActivityError> {
        let mut bpf = self.lock();
        let mut m = dev_map(&mut bpf)?;
        let previous = m.get(&index, 0).ok();
        if let Some(other) = previous
            && other != uid
        {
            tracing::warn!(
                ifindex = index,
                user_id = uid,
                previous = other,
                "packet activity: a VM veth ifindex was registered for another VM; it is now this one's"
            );
        }
        m.insert(index, uid, 0).map_err(map_err(DEV_MAP))?;
        let mut by_uid = self.by_uid();
        if let Some(other) = previous.filter(|o| *o != uid)
            && let Some(theirs) = by_uid.get_mut(&other)
        {
            theirs.remove(&index);
            if theirs.is_empty() {
                by_uid.remove(&other);
            }
        }
        let mine = by_uid.entry(uid).or_default();
        let stale: Vec<u32> = mine.iter().copied().filter(|c| *c != index).collect();
        for c in stale {
            ignore_missing(m.remove(&c)).map_err(map_err(DEV_MAP))?;
            mine.remove(&c);
        }
        mine.insert(index);
        Ok(())
    }

    /// The ifindex of `plan`'s VM veth end in `netns`, whose rtnetlink handle is `ns`.
    ///
    /// # Errors
    /// [`ActivityError::NoDevice`], [`ActivityError::Observe`].
    pub async fn ingress_index(
        &self,
        netns: &str,
        ns: &Handle,
        plan: &ActivityPlan,
    ) -> Result<u32, ActivityError> {
        filter::ifindex(netns, ns, &plan.ingress_dev).await
    }

    /// Writes the activity filter of `plan` on its device in `netns` (creating the clsact
    /// qdisc if needed), replacing whatever filter has our priority and handle.
    ///
    /// # Errors
    /// [`ActivityError::Attach`].
    pub fn attach(&self, netns: &str, plan: &ActivityPlan) -> Result<(), ActivityError> {
        self.attach_from(netns, plan, false)
    }

    /// As [`Self::attach`], from a thread that is already inside the VM's netns `netns` (the
    /// one that made it, at create).
    ///
    /// # Errors
    /// [`ActivityError::Attach`].
    pub fn attach_here(&self, netns: &str, plan: &ActivityPlan) -> Result<(), ActivityError> {
        self.attach_from(netns, plan, true)
    }

    /// Attaches under the program's lock, from this thread when it is inside `netns` (`here`),
    /// else from a thread that enters it.
    fn attach_from(
        &self,
        netns: &str,
        plan: &ActivityPlan,
        here: bool,
    ) -> Result<(), ActivityError> {
        let mut bpf = self.lock();
        let attach_err = |source| ActivityError::Attach {
            netns: netns.to_owned(),
            dev: plan.dev.clone(),
            source,
        };
        let prog: &mut SchedClassifier = bpf
            .program_mut(PROGRAM)
            .ok_or_else(|| attach_err(format!("no program {PROGRAM}").into()))?
            .try_into()
            .map_err(|e: aya::programs::ProgramError| attach_err(Box::new(e)))?;
        let attached = if here {
            filter::attach(prog, plan)
        } else {
            crate::netns::run_in(netns, || filter::attach(prog, plan))?
        };
        attached.map_err(attach_err)
    }

    /// Removes the activity filter of `plan` from its device in `netns` (benchmarks, and a
    /// host turning activity off). `Ok(false)` when there was none.
    ///
    /// # Errors
    /// [`ActivityError::Attach`] when listing or deleting the filter fails.
    pub fn detach(&self, netns: &str, plan: &ActivityPlan) -> Result<bool, ActivityError> {
        detach_filter(netns, plan)
    }

    /// Forgets user id `uid`: its time is cleared and its veth registrations removed (call
    /// when the VM is deleted; its filter goes with its tap).
    ///
    /// # Errors
    /// A map error.
    pub fn forget(&self, uid: u32) -> Result<(), ActivityError> {
        let mut bpf = self.lock();
        let mut m = dev_map(&mut bpf)?;
        let mine = self.by_uid().remove(&uid).unwrap_or_default();
        for c in mine {
            // Only while it is still this VM's: another may have taken the index over since.
            if m.get(&c, 0).ok() == Some(uid) {
                ignore_missing(m.remove(&c)).map_err(map_err(DEV_MAP))?;
            }
        }
        let mut last = last_map(&mut bpf)?;
        last.set(uid, 0, 0).map_err(map_err(LAST_MAP))
    }

    /// Removes the registrations of every user id not in `keep` and clears their times (garbage
    /// collection after a crash). Returns how many registrations went.
    ///
    /// # Errors
    /// A map error.
    pub fn retain(&self, keep: &[u32]) -> Result<usize, ActivityError> {
        let keep: std::collections::BTreeSet<u32> = keep.iter().copied().collect();
        let mut bpf = self.lock();
        let mut m = dev_map(&mut bpf)?;
        let gone: Vec<(u32, u32)> = m
            .iter()
            .filter_map(Result::ok)
            .filter(|(_, u)| !keep.contains(u))
            .collect();
        for (c, _) in &gone {
            ignore_missing(m.remove(c)).map_err(map_err(DEV_MAP))?;
        }
        // The walk also re-reads the index, so a map edited behind the agent's back is known
        // again after one garbage collection.
        *self.by_uid() = index_by_uid(&m);
        let mut last = last_map(&mut bpf)?;
        for (_, u) in &gone {
            last.set(*u, 0, 0).map_err(map_err(LAST_MAP))?;
        }
        Ok(gone.len())
    }

    /// The last activity of every user id that has any, as wall-clock times.
    ///
    /// # Errors
    /// A map error.
    pub fn last(&self) -> Result<BTreeMap<u32, SystemTime>, ActivityError> {
        let mut bpf = self.lock();
        let last = last_map(&mut bpf)?;
        let (now_boot, now_wall) = (boottime_ns(), SystemTime::now());
        let mut out = BTreeMap::new();
        for (uid, t) in last.iter().filter_map(Result::ok).enumerate() {
            if t != 0 {
                let uid = u32::try_from(uid).unwrap_or(u32::MAX);
                out.insert(uid, wall_time(t, now_boot, now_wall));
            }
        }
        Ok(out)
    }

    /// The last activity of user id `uid` as the program stored it: `CLOCK_BOOTTIME` ns
    /// (`None`: never). Exact, for comparing two readings; [`Self::last_of`] converts it.
    ///
    /// # Errors
    /// A map error.
    pub fn last_boot_ns(&self, uid: u32) -> Result<Option<u64>, ActivityError> {
        let mut bpf = self.lock();
        let last = last_map(&mut bpf)?;
        let t = last.get(&uid, 0).map_err(map_err(LAST_MAP))?;
        Ok((t != 0).then_some(t))
    }

    /// The last activity of user id `uid`, as wall-clock time (`None`: never, since it was
    /// registered or the pinned map was made).
    ///
    /// # Errors
    /// A map error.
    pub fn last_of(&self, uid: u32) -> Result<Option<SystemTime>, ActivityError> {
        let mut bpf = self.lock();
        let last = last_map(&mut bpf)?;
        let t = last.get(&uid, 0).map_err(map_err(LAST_MAP))?;
        Ok((t != 0).then(|| wall_time(t, boottime_ns(), SystemTime::now())))
    }
}

fn dev_map(bpf: &mut Ebpf) -> Result<BpfHashMap<&mut MapData, u32, u32>, ActivityError> {
    let map = bpf.map_mut(DEV_MAP).ok_or(ActivityError::Map {
        map: DEV_MAP,
        source: aya::maps::MapError::InvalidName {
            name: DEV_MAP.into(),
        },
    })?;
    BpfHashMap::try_from(map).map_err(map_err(DEV_MAP))
}

/// The registrations of the device map by user id (one walk of the map).
fn index_by_uid(m: &BpfHashMap<&mut MapData, u32, u32>) -> BTreeMap<u32, BTreeSet<u32>> {
    let mut out: BTreeMap<u32, BTreeSet<u32>> = BTreeMap::new();
    for (index, uid) in m.iter().filter_map(Result::ok) {
        out.entry(uid).or_default().insert(index);
    }
    out
}

fn last_map(bpf: &mut Ebpf) -> Result<Array<&mut MapData, u64>, ActivityError> {
    let map = bpf.map_mut(LAST_MAP).ok_or(ActivityError::Map {
        map: LAST_MAP,
        source: aya::maps::MapError::InvalidName {
            name: LAST_MAP.into(),
        },
    })?;
    Array::try_from(map).map_err(map_err(LAST_MAP))
}

use crate::bpffs::ignore_missing;
