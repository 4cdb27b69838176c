//! Packet activity: the shared BPF program that records, per VM user id, when the guest last
//! received TCP from the host side (spec: namespaced-vm-networking.md, "Packet activity and
//! wake"; the program is `bpf/activity.bpf.c`).
//!
//! # Design
//! - One program for the whole host: [`ActivityRecorder::open`] loads `activity_xmit` and
//!   attaches it once to the kernel tracepoint `net_dev_queue` (a BTF tracepoint program, run
//!   for every frame queued on any device), and the program looks only at frames queued on a
//!   registered VM's tap. A VM is one entry in map `activity_vm`: the inode number of its netns
//!   → its user id and the ifindexes of its veth end and its tap ([`ActivityPlan`],
//!   [`VmEntry`]). Registering or forgetting a VM is one map write, and no kernel object is
//!   made per VM: a tc filter per tap (what earlier versions did) gives each VM two tc blocks,
//!   and the kernel searches a list of every block on the host whenever one is bound, so each
//!   new VM cost a little more than the one before.
//! - Maps and the program's link are pinned under a configurable root in bpffs
//!   (`<root>/activity_vm`, `<root>/activity_last`, `<root>/activity_link`). A starting agent
//!   reuses the pinned maps (aya's pin-by-name: the kernel object is opened, not re-created),
//!   attaches its own program and then renames its link's pin over the earlier one, so
//!   "configure on start replaces the program and keeps its map": between the two steps both
//!   programs record (the same times), after it the earlier program is detached. Recorded
//!   times survive agent restarts and upgrades, and the pinned link keeps the kernel recording
//!   while no agent runs. If the root is not on a bpffs, one is mounted there.
//! - The program finds the VM by the namespace of the device the frame is queued on (ifindexes
//!   repeat across namespaces; a namespace's inode number does not while it lives), then checks
//!   that the device is the VM's tap and that the frame entered the namespace through the VM's
//!   veth end (its ingress ifindex): host traffic does; what the namespace sends itself (the
//!   metadata service) has no ingress device. Several agents on one kernel (sandboxes, tests)
//!   each have their own program and maps, and each finds only its own namespaces.
//! - Times are `CLOCK_BOOTTIME` nanoseconds (`bpf_ktime_get_boot_ns`: monotonic, and counting a
//!   host suspend, so an idle time never shrinks over one). [`ActivityRecorder::last`]
//!   converts them to wall-clock time from one reading of both clocks.
//! - Observe and repair by content: the VM netns's entry must hold the plan's user id and the
//!   current ifindexes of the veth end and the tap (observed by the caller); anything else is
//!   rewritten (`drift` reports it first). A tap that still has an earlier version's activity
//!   filter has it deleted (an upgrade step, not drift).
//!
//! # Limitations
//! - A packet delivered while a VM's namespace is being set up (before its registration is
//!   written) is not recorded: clients must retry, as the spec says of a starting VM.
//! - IPv6 packets with more than six extension headers before TCP, or whose IP headers are not
//!   in the linear part of the kernel's packet buffer, are not counted.
//! - The time is stored at most once per millisecond per VM (most packets of a busy flow only
//!   read it), so it is exact to 1 ms.
//! - The program runs for every frame queued on the host (one field read and, for frames that
//!   arrived on some device, one hash lookup, when the frame is not a VM's).

mod clock;
mod entry;
mod filter;
mod held;
mod pins;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use aya::maps::{Array, HashMap as BpfHashMap, MapData};
use aya::programs::BtfTracePoint;
use aya::programs::links::FdLink;
use aya::{Btf, Ebpf, EbpfLoader};
use rtnetlink::Handle;
use vmnet_plan::ns::activity::{ActivityPlan, PROGRAM, TRACEPOINT};

use crate::netns::NetnsError;

use clock::boottime_ns;
pub use clock::wall_time;
pub use entry::{Registration, VmEntry, netns_inode};
pub use filter::{ObservedFilter, detach_filter, leftover_filter};
pub use held::{Drained, HeldFrame, HeldReader};
pub use pins::remove_root;

/// The compiled BPF object.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/activity.o"));

/// The map of VM netns inode numbers → [`VmEntry`].
pub(crate) const VM_MAP: &str = "activity_vm";
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
    /// Deleting an earlier version's activity filter from a tap failed.
    #[error("{netns}: delete the earlier activity filter of {dev}")]
    Detach {
        /// The VM namespace.
        netns: String,
        /// The device.
        dev: String,
        /// What failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Reading a device or its filters failed.
    #[error("{netns}: read {dev}")]
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
    /// The namespace's inode number could not be read.
    #[error("{netns}: read the namespace's inode number")]
    NetnsInode {
        /// The VM namespace.
        netns: String,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
}

fn map_err(map: &'static str) -> impl Fn(aya::maps::MapError) -> ActivityError {
    move |source| ActivityError::Map { map, source }
}

/// The loaded activity program with its pinned maps and link. All methods are blocking (bpf(2),
/// netlink from a thread inside the namespace) except [`Self::drift`] and [`Self::sync`], which
/// read devices and filters over the namespace's rtnetlink handle.
pub struct ActivityRecorder {
    root: PathBuf,
    bpf: Mutex<Ebpf>,
    /// The VM map's registrations by user id (user id → netns inode numbers), read from the map
    /// once at load and kept with every write since, so registering or forgetting one VM never
    /// walks the map (a walk is two bpf(2) calls per VM of the host). Locked after `bpf`.
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
    /// The tap still has an earlier version's per-tap activity filter: delete it (an upgrade
    /// step, not drift).
    Upgrade(String),
    /// The VM netns has no entry, or one other than the plan's user id with the current
    /// ifindexes of the veth end and the tap: write it.
    Register(Registration, String),
}

impl ActivityFix {
    /// What differs, in words.
    #[must_use]
    pub fn what(&self) -> &str {
        match self {
            Self::Upgrade(w) | Self::Register(_, w) => w,
        }
    }
}

impl ActivityRecorder {
    /// Loads the activity program with its maps pinned under `root` (created, and a bpffs
    /// mounted on it when it is not on one), attaches it to the tracepoint and pins its link
    /// there: maps already pinned are reused with their contents, the link pin of an earlier
    /// agent is replaced (which detaches that agent's program). The pins of earlier versions'
    /// per-tap filter (its program and device map) are removed.
    ///
    /// # Errors
    /// [`ActivityError::Root`], [`ActivityError::Load`] (no BPF or BTF support, not root, a
    /// pinned map of another shape).
    pub fn open(root: &Path) -> Result<Self, ActivityError> {
        pins::prepare_root(root)?;
        pins::remove_legacy(root)?;
        let mut bpf = EbpfLoader::new()
            .default_map_pin_directory(root)
            .load(OBJECT)
            .map_err(|e| ActivityError::Load(Box::new(e)))?;
        let btf = Btf::from_sys_fs().map_err(|e| ActivityError::Load(Box::new(e)))?;
        let prog = program(&mut bpf)?;
        prog.load(TRACEPOINT, &btf)
            .map_err(|e| ActivityError::Load(Box::new(e)))?;
        let info = prog.info().map_err(|e| ActivityError::Load(Box::new(e)))?;
        attach_and_pin(prog, root)?;
        let by_uid = index_by_uid(&vm_map(&mut bpf)?);
        Ok(Self {
            root: root.to_owned(),
            bpf: Mutex::new(bpf),
            by_uid: Mutex::new(by_uid),
            prog_id: info.id(),
            prog_tag: info.tag(),
        })
    }

    /// Turns on wake on packet: from now on the program copies each frame from the host side
    /// that the kernel is about to drop on a VM's tap without its VMM (at most `max_frame`
    /// bytes; longer ones are reported without their bytes) to perf buffers of `pages` pages
    /// per CPU, which the returned reader reads. Once per recorder.
    ///
    /// # Errors
    /// [`ActivityError::Map`] when the maps are gone (called twice) or cannot be written,
    /// [`ActivityError::Load`] when the buffers cannot be opened.
    pub fn hold(&self, max_frame: u32, pages: usize) -> Result<HeldReader, ActivityError> {
        let mut bpf = self.lock();
        let frames = bpf
            .take_map(held::FRAMES_MAP)
            .ok_or(aya::maps::MapError::InvalidName {
                name: held::FRAMES_MAP.to_owned(),
            })
            .map_err(map_err("wake_frames"))?;
        let frames = aya::maps::PerfEventArray::try_from(frames).map_err(map_err("wake_frames"))?;
        let reader =
            HeldReader::open(frames, pages).map_err(|e| ActivityError::Load(Box::new(e)))?;
        let cfg = bpf
            .map_mut(held::CFG_MAP)
            .ok_or(aya::maps::MapError::InvalidName {
                name: held::CFG_MAP.to_owned(),
            })
            .map_err(map_err("wake_cfg"))?;
        let mut cfg: Array<_, [u32; 2]> = Array::try_from(cfg).map_err(map_err("wake_cfg"))?;
        cfg.set(0, [1, max_frame], 0).map_err(map_err("wake_cfg"))?;
        Ok(reader)
    }

    /// The kernel id of the loaded program (what the pinned link runs).
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

    /// Checks that the link pinned under the root runs this recorder's program, and attaches
    /// the program and pins its link again when not (a pin removed by hand detaches the
    /// program). Returns what was repaired, `None` when nothing was.
    ///
    /// # Errors
    /// [`ActivityError::Load`] when attaching fails, [`ActivityError::Root`] when pinning does.
    pub fn ensure_link(&self) -> Result<Option<String>, ActivityError> {
        let found = pins::linked_program(&self.root);
        if found == Some(self.prog_id) {
            return Ok(None);
        }
        attach_and_pin(program(&mut self.lock())?, &self.root)?;
        Ok(Some(match found {
            None => format!(
                "no link of the activity program pinned under {}: attached and pinned",
                self.root.display()
            ),
            Some(other) => format!(
                "the link pinned under {} runs program {other}, not {}: attached and pinned again",
                self.root.display(),
                self.prog_id
            ),
        }))
    }

    /// Removes the pin of the program's link, which detaches the program: no frame is looked
    /// at until [`Self::ensure_link`] attaches it again (benchmarks). `Ok(false)` when it was
    /// not pinned.
    ///
    /// # Errors
    /// [`ActivityError::Root`] when the pin cannot be removed.
    pub fn detach_link(&self) -> Result<bool, ActivityError> {
        let _bpf = self.lock();
        pins::unpin_link(&self.root)
    }

    /// What differs between the kernel and `plan` for the VM in namespace `netns` (whose
    /// rtnetlink handle is `ns`), `want` being the plan's entry with the ifindexes its devices
    /// have now (the caller observed them); empty when in sync.
    ///
    /// # Errors
    /// [`ActivityError::Observe`], [`ActivityError::NetnsInode`], map errors.
    pub async fn drift(
        &self,
        netns: &str,
        ns: &Handle,
        plan: &ActivityPlan,
        want: VmEntry,
    ) -> Result<Vec<ActivityFix>, ActivityError> {
        let mut fixes = Vec::new();
        if let Some(f) = leftover_filter(netns, ns, &plan.dev).await? {
            fixes.push(ActivityFix::Upgrade(format!(
                "{} egress still has an earlier version's activity filter ({f}): deleted",
                plan.dev
            )));
        }
        let (veth, tap) = (want.veth, want.tap);
        let inode = netns_inode(netns)?;
        let registered = self.registered(inode)?;
        if registered != Some(want) {
            let shown = registered.map_or_else(
                || "no entry".to_owned(),
                |e| {
                    format!(
                        "user id {} with veth ifindex {} and tap ifindex {}",
                        e.uid, e.veth, e.tap
                    )
                },
            );
            fixes.push(ActivityFix::Register(
                Registration {
                    netns: inode,
                    entry: want,
                },
                format!(
                    "netns inode {inode} has {shown}, not user id {} with {} (ifindex {veth}) and {} (ifindex {tap})",
                    plan.user_id, plan.ingress_dev, plan.dev
                ),
            ));
        }
        Ok(fixes)
    }

    /// Makes the kernel match `plan` (see [`Self::drift`]) and returns what was fixed.
    ///
    /// # Errors
    /// As [`Self::drift`], and [`ActivityError::Detach`].
    pub async fn sync(
        &self,
        netns: &str,
        ns: &Handle,
        plan: &ActivityPlan,
        want: VmEntry,
    ) -> Result<Vec<ActivityFix>, ActivityError> {
        let fixes = self.drift(netns, ns, plan, want).await?;
        for f in &fixes {
            match f {
                ActivityFix::Register(r, _) => self.register(r.netns, r.entry)?,
                ActivityFix::Upgrade(_) => {
                    detach_filter(netns, &plan.dev)?;
                }
            }
        }
        Ok(fixes)
    }

    /// The entry registered for the netns with inode number `index`.
    fn registered(&self, index: u32) -> Result<Option<VmEntry>, ActivityError> {
        let bpf = self.lock();
        let map = bpf.map(VM_MAP).ok_or(ActivityError::Map {
            map: VM_MAP,
            source: aya::maps::MapError::InvalidName {
                name: VM_MAP.into(),
            },
        })?;
        let m = BpfHashMap::<_, u32, VmEntry>::try_from(map).map_err(map_err(VM_MAP))?;
        match m.get(&index, 0) {
            Ok(u) => Ok(Some(u)),
            Err(aya::maps::MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(map_err(VM_MAP)(e)),
        }
    }

    /// Registers the VM netns with inode number `index` as `entry`, dropping any other netns
    /// registered under the same user id (a VM made again has a new namespace). One map write,
    /// whatever the number of VMs.
    ///
    /// # Errors
    /// A map error.
    pub fn register(&self, index: u32, entry: VmEntry) -> Result<(), ActivityError> {
        let uid = entry.uid;
        let mut bpf = self.lock();
        let mut m = vm_map(&mut bpf)?;
        let previous = m.get(&index, 0).ok().map(|e| e.uid);
        if let Some(other) = previous
            && other != uid
        {
            tracing::warn!(
                netns_inode = index,
                user_id = uid,
                previous = other,
                "packet activity: a netns was registered for another VM; it is now this one's"
            );
        }
        m.insert(index, entry, 0).map_err(map_err(VM_MAP))?;
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
            ignore_missing(m.remove(&c)).map_err(map_err(VM_MAP))?;
            mine.remove(&c);
        }
        mine.insert(index);
        Ok(())
    }

    /// Forgets user id `uid`: its time is cleared and its registrations removed (call
    /// when the VM is deleted).
    ///
    /// # Errors
    /// A map error.
    pub fn forget(&self, uid: u32) -> Result<(), ActivityError> {
        let mut bpf = self.lock();
        let mut m = vm_map(&mut bpf)?;
        let mine = self.by_uid().remove(&uid).unwrap_or_default();
        for c in mine {
            // Only while it is still this VM's: another may have taken the entry over since.
            if m.get(&c, 0).ok().map(|e| e.uid) == Some(uid) {
                ignore_missing(m.remove(&c)).map_err(map_err(VM_MAP))?;
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
        let mut m = vm_map(&mut bpf)?;
        let gone: Vec<(u32, u32)> = m
            .iter()
            .filter_map(Result::ok)
            .filter(|(_, e)| !keep.contains(&e.uid))
            .map(|(c, e)| (c, e.uid))
            .collect();
        for (c, _) in &gone {
            ignore_missing(m.remove(c)).map_err(map_err(VM_MAP))?;
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

    /// The last activity of each of `uids` that has any, as wall-clock times: one map lookup
    /// per user id, not a walk of the whole array (65,536 lookups, tens of ms, with the map's
    /// lock held against [`Self::register`]).
    ///
    /// # Errors
    /// A map error (also for a user id beyond the array).
    pub fn last_of_each(
        &self,
        uids: impl IntoIterator<Item = u32>,
    ) -> Result<BTreeMap<u32, SystemTime>, ActivityError> {
        let mut bpf = self.lock();
        let last = last_map(&mut bpf)?;
        let (now_boot, now_wall) = (boottime_ns(), SystemTime::now());
        let mut out = BTreeMap::new();
        for uid in uids {
            let t = last.get(&uid, 0).map_err(map_err(LAST_MAP))?;
            if t != 0 {
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

/// The activity program of the object `bpf`.
fn program(bpf: &mut Ebpf) -> Result<&mut BtfTracePoint, ActivityError> {
    bpf.program_mut(PROGRAM)
        .ok_or_else(|| ActivityError::Load(format!("no program {PROGRAM}").into()))?
        .try_into()
        .map_err(|e| ActivityError::Load(Box::new(e)))
}

/// Attaches the loaded `prog` to its tracepoint and pins the link under `root`.
fn attach_and_pin(prog: &mut BtfTracePoint, root: &Path) -> Result<(), ActivityError> {
    let id = prog
        .attach()
        .map_err(|e| ActivityError::Load(Box::new(e)))?;
    let link = prog
        .take_link(id)
        .map_err(|e| ActivityError::Load(Box::new(e)))?;
    pins::pin_link(root, FdLink::from(link))
}

fn vm_map(bpf: &mut Ebpf) -> Result<BpfHashMap<&mut MapData, u32, VmEntry>, ActivityError> {
    let map = bpf.map_mut(VM_MAP).ok_or(ActivityError::Map {
        map: VM_MAP,
        source: aya::maps::MapError::InvalidName {
            name: VM_MAP.into(),
        },
    })?;
    BpfHashMap::try_from(map).map_err(map_err(VM_MAP))
}

/// The registrations of the VM map by user id (one walk of the map).
fn index_by_uid(m: &BpfHashMap<&mut MapData, u32, VmEntry>) -> BTreeMap<u32, BTreeSet<u32>> {
    let mut out: BTreeMap<u32, BTreeSet<u32>> = BTreeMap::new();
    for (index, e) in m.iter().filter_map(Result::ok) {
        out.entry(e.uid).or_default().insert(index);
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
