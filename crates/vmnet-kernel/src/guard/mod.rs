//! The guest guard of namespace mode: the BPF program that drops, at the first hook a guest's
//! frame reaches (the ingress of the VM's tap), everything the guest may not send, and counts
//! the drops per VM and kind (the rule: [`vmnet_plan::ns::guard`]; the program:
//! `bpf/guest_guard.bpf.c`).
//!
//! # Design
//! - One program for the host ([`GuestGuard::load`]), attached to each VM's tap as a `cls_bpf`
//!   direct-action filter on the clsact ingress ([`FILTER_PRIORITY`], [`FILTER_HANDLE`]: first,
//!   before any other filter). The filter stays when the agent exits (the link is released, not
//!   detached), so the kernel keeps guarding while no agent runs, and needs no pin per VM.
//! - A VM is one entry in map `guard_vms`, keyed by the inode number of its netns (what the
//!   program reads from the tap's namespace; tap ifindexes repeat across namespaces): its user
//!   id and what it may send from. Its drops are counted per CPU in `guard_drops`, keyed by
//!   user id, one counter per kind ([`DROP_KINDS`]); a frame on a tap whose namespace has no
//!   entry is dropped and counted in `guard_unknown`.
//! - The maps live as long as a program uses them, and are not pinned: a new agent loads its
//!   own program and maps, registers every VM and swaps its program into each tap's filter
//!   (one netlink request, atomic: an upgrade step). The counters count from the agent's start,
//!   or from the VM's creation by this agent.
//! - Observe and repair by content: the VM's entry must be the plan's, the tap's filter must run
//!   this guard's program (read back by the driver with a filter dump of the tap).
//!
//! # Why a tc filter
//! Measured on this project's 2-core test machine (kernel 6.18), for one VM's tap: a clsact
//! qdisc and this filter take 72 µs over netlink on a fresh host and 160 µs with 1,000 other
//! taps filtered (the kernel keeps every bound tc block in one list, searched at each bind); a
//! TCX attachment needs no qdisc but waits for an RCU grace period under RTNL (8 ms here, and
//! every other netlink request of the host waits with it); an nft netdev chain with the same
//! rules took 850 µs through libnftables, and nft's `inet` ingress hook does not see ARP.
//!
//! # Limitations
//! - The program reads the tap's namespace from the kernel's socket buffer with
//!   `bpf_probe_read_kernel` (CO-RE offsets), which needs `CAP_PERFMON` to load and costs three
//!   reads per frame.
//! - The program checks what the guest sends; it does not look inside neighbour
//!   advertisements: an advertisement can only change the namespace's entries on the tap, which
//!   are the guest's own addresses.
//! - Binding a tap's tc block costs a little more with every filtered device on the host (the
//!   kernel's list of blocks; see above).

use std::collections::BTreeMap;
use std::sync::Mutex;

use aya::maps::{HashMap as BpfHashMap, MapData, PerCpuArray, PerCpuHashMap, PerCpuValues};
use aya::programs::links::Link as _;
use aya::programs::tc::{NlOptions, SchedClassifierLink, TcAttachOptions, TcHandle};
use aya::programs::{SchedClassifier, TcAttachType};
use aya::{Ebpf, EbpfLoader, Pod};
use vmnet_plan::ns::guard::{DROP_KINDS, GUARD_MARK, GuardPlan, PROGRAM};

use crate::bpffs::ignore_missing;

mod cost;
pub use cost::GuardRunCost;

/// The compiled BPF object.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/guest_guard.o"));

/// tc filter priority of the guard on a tap's ingress (1: before any other filter).
pub const FILTER_PRIORITY: u16 = 1;
/// tc filter handle of the guard.
pub const FILTER_HANDLE: TcHandle = TcHandle::new(0, 0x9a4d);

const VMS: &str = "guard_vms";
const DROPS: &str = "guard_drops";
const UNKNOWN: &str = "guard_unknown";

const F_MESH: u32 = 1;
const F_BLOCK: u32 = 2;
const F_GATEWAY: u32 = 4;

/// The number of drop kinds (`K_COUNT`).
const KINDS: usize = DROP_KINDS.len();

/// `struct guard_vm` of the program: one VM's entry.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuardEntry {
    /// The user id its drops are counted under.
    pub uid: u32,
    /// `F_MESH`, `F_BLOCK`, `F_GATEWAY`.
    pub flags: u32,
    /// Its mesh address (zero without one).
    pub mesh: [u8; 16],
    /// The upper half of its routed block, host order.
    pub block_hi: u64,
    /// The lower half of its routed block, host order.
    pub block_lo: u64,
    /// The block's prefix length.
    pub block_len: u32,
    /// Zero.
    pub pad: u32,
}

// SAFETY: `repr(C)` integers and a byte array laid out without implicit padding (48 bytes, the
// C struct's layout): every bit pattern is a valid value.
unsafe impl Pod for GuardEntry {}

impl GuardEntry {
    /// The entry `plan` describes.
    #[must_use]
    pub fn of(plan: &GuardPlan) -> Self {
        let mut flags = 0;
        let mut mesh = [0; 16];
        if let Some(m) = plan.mesh {
            flags |= F_MESH;
            mesh = m.octets();
        }
        let (mut block_hi, mut block_lo, mut block_len) = (0, 0, 0);
        if let Some(b) = plan.block {
            flags |= F_BLOCK;
            let n = u128::from(b.network());
            block_hi = u64::try_from(n >> 64).unwrap_or(0);
            block_lo = u64::try_from(n & u128::from(u64::MAX)).unwrap_or(0);
            block_len = u32::from(b.prefix_len());
        }
        if plan.gateway {
            flags |= F_GATEWAY;
        }
        Self {
            uid: plan.user_id,
            flags,
            mesh,
            block_hi,
            block_lo,
            block_len,
            pad: 0,
        }
    }
}

/// A guard failure, naming the map, device or step.
#[derive(Debug, thiserror::Error)]
pub enum GuestGuardError {
    /// The BPF object could not be loaded (no BPF or BTF support, not root).
    #[error("load the guest guard")]
    Load(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// A map operation failed.
    #[error("guest guard map {map}")]
    Map {
        /// The map.
        map: &'static str,
        /// What failed.
        #[source]
        source: aya::maps::MapError,
    },
    /// Attaching, detaching or reading the program on a tap failed.
    #[error("tap {tap}: {op} the guest guard")]
    Tap {
        /// The tap.
        tap: String,
        /// `attach`, `detach` or `read`.
        op: &'static str,
        /// What failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The number of CPUs (for the per-CPU counters) could not be read.
    #[error("guest guard: the number of possible CPUs")]
    Cpus(#[source] std::io::Error),
    /// The namespace's inode number could not be read.
    #[error("{netns}: read the namespace's inode number")]
    NetnsInode {
        /// The namespace.
        netns: String,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
}

fn map_err(map: &'static str) -> impl Fn(aya::maps::MapError) -> GuestGuardError {
    move |source| GuestGuardError::Map { map, source }
}

/// The drops of the whole host (`GET /v1/status`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GuardTotals {
    /// VMs registered.
    pub vms: u64,
    /// Drops of every registered VM by kind ([`DROP_KINDS`]).
    pub drops: BTreeMap<&'static str, u64>,
    /// Frames dropped on a tap whose namespace has no entry.
    pub unregistered: u64,
    /// Drops of each registered VM by kind, by user id (the agent's spoof-drop summaries).
    pub per_vm: BTreeMap<u32, BTreeMap<&'static str, u64>>,
}

/// The loaded guest guard. All methods are blocking (`bpf(2)`); the `*_here` ones work on the
/// tap of the calling thread's network namespace.
pub struct GuestGuard {
    bpf: Mutex<Ebpf>,
    prog_id: u32,
    /// Registrations by user id (user id → netns inode number), kept with every write so
    /// registering or forgetting one VM never walks the map.
    by_uid: Mutex<BTreeMap<u32, u32>>,
    /// The user ids whose tap this guard found or put its program on.
    attached: Mutex<std::collections::BTreeSet<u32>>,
}

impl std::fmt::Debug for GuestGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuestGuard")
            .field("prog_id", &self.prog_id)
            .finish_non_exhaustive()
    }
}

/// The inode number of the named netns `name` (what the program reads from a tap's namespace).
///
/// # Errors
/// [`GuestGuardError::NetnsInode`] when the namespace is not there.
pub fn netns_inode(name: &str) -> Result<u32, GuestGuardError> {
    inode_of(&crate::netns::path(name)).map_err(|source| GuestGuardError::NetnsInode {
        netns: name.to_owned(),
        source,
    })
}

/// The inode number of the calling thread's network namespace.
///
/// # Errors
/// [`GuestGuardError::NetnsInode`] (`here` names it).
pub fn netns_inode_here(here: &str) -> Result<u32, GuestGuardError> {
    inode_of(std::path::Path::new("/proc/thread-self/ns/net")).map_err(|source| {
        GuestGuardError::NetnsInode {
            netns: here.to_owned(),
            source,
        }
    })
}

fn inode_of(path: &std::path::Path) -> std::io::Result<u32> {
    use std::os::unix::fs::MetadataExt as _;
    let ino = std::fs::metadata(path)?.ino();
    u32::try_from(ino).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("inode number {ino} does not fit in 32 bits"),
        )
    })
}

impl GuestGuard {
    /// Loads the program with fresh maps.
    ///
    /// # Errors
    /// [`GuestGuardError::Load`] without BPF support, BTF or privileges.
    pub fn load() -> Result<Self, GuestGuardError> {
        let load = |e: Box<dyn std::error::Error + Send + Sync>| GuestGuardError::Load(e);
        let mut bpf = EbpfLoader::new()
            .override_global("GUARD_MARK", &GUARD_MARK, true)
            .load(OBJECT)
            .map_err(|e| load(Box::new(e)))?;
        let prog: &mut SchedClassifier = bpf
            .program_mut(PROGRAM)
            .ok_or_else(|| load(format!("no program {PROGRAM}").into()))?
            .try_into()
            .map_err(|e| load(Box::new(e)))?;
        prog.load().map_err(|e| load(Box::new(e)))?;
        let prog_id = prog.info().map_err(|e| load(Box::new(e)))?.id();
        Ok(Self {
            bpf: Mutex::new(bpf),
            prog_id,
            by_uid: Mutex::new(BTreeMap::new()),
            attached: Mutex::new(std::collections::BTreeSet::new()),
        })
    }

    /// The kernel id of the loaded program.
    #[must_use]
    pub fn program_id(&self) -> u32 {
        self.prog_id
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ebpf> {
        self.bpf
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn by_uid(&self) -> std::sync::MutexGuard<'_, BTreeMap<u32, u32>> {
        self.by_uid
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn vms<T>(
        &self,
        f: impl FnOnce(&mut BpfHashMap<&mut MapData, u32, GuardEntry>) -> Result<T, aya::maps::MapError>,
    ) -> Result<T, GuestGuardError> {
        let mut bpf = self.lock();
        let map = bpf.map_mut(VMS).ok_or(GuestGuardError::Map {
            map: VMS,
            source: aya::maps::MapError::InvalidName { name: VMS.into() },
        })?;
        let mut m = BpfHashMap::try_from(map).map_err(map_err(VMS))?;
        f(&mut m).map_err(map_err(VMS))
    }

    fn drops_map<T>(
        &self,
        f: impl FnOnce(
            &mut PerCpuHashMap<&mut MapData, u32, [u64; KINDS]>,
        ) -> Result<T, aya::maps::MapError>,
    ) -> Result<T, GuestGuardError> {
        let mut bpf = self.lock();
        let map = bpf.map_mut(DROPS).ok_or(GuestGuardError::Map {
            map: DROPS,
            source: aya::maps::MapError::InvalidName { name: DROPS.into() },
        })?;
        let mut m = PerCpuHashMap::try_from(map).map_err(map_err(DROPS))?;
        f(&mut m).map_err(map_err(DROPS))
    }

    /// The entry registered for the netns with inode number `inode`, if any.
    ///
    /// # Errors
    /// A map error.
    pub fn registered(&self, inode: u32) -> Result<Option<GuardEntry>, GuestGuardError> {
        self.vms(|m| match m.get(&inode, 0) {
            Ok(v) => Ok(Some(v)),
            Err(e) => ignore_missing(Err(e)).map(|()| None),
        })
    }

    /// Registers the VM of `plan` in the netns with inode number `inode` (replacing an entry
    /// of the same user id under another netns). Its drop counters start at zero with `fresh`
    /// (a VM just created), else they are kept (made when missing).
    ///
    /// # Errors
    /// A map error.
    pub fn register(
        &self,
        inode: u32,
        plan: &GuardPlan,
        fresh: bool,
    ) -> Result<(), GuestGuardError> {
        let uid = plan.user_id;
        let zeros = aya::util::nr_cpus()
            .map_err(|(_, e)| e)
            .and_then(|n| PerCpuValues::try_from(vec![[0u64; KINDS]; n]))
            .map_err(GuestGuardError::Cpus)?;
        self.drops_map(|m| {
            let values = zeros;
            // BPF_NOEXIST (1): keep the counters of a VM registered again.
            match m.insert(uid, values, if fresh { 0 } else { 1 }) {
                Err(aya::maps::MapError::SyscallError(e))
                    if e.io_error.raw_os_error() == Some(libc::EEXIST) =>
                {
                    Ok(())
                }
                other => other,
            }
        })?;
        self.vms(|m| m.insert(inode, GuardEntry::of(plan), 0))?;
        let old = self.by_uid().insert(uid, inode);
        if let Some(old) = old.filter(|o| *o != inode) {
            self.vms(|m| {
                // Only when it is still that VM's: another VM may have that inode by now.
                if m.get(&old, 0).ok().is_some_and(|e| e.uid == uid) {
                    ignore_missing(m.remove(&old))
                } else {
                    Ok(())
                }
            })?;
        }
        Ok(())
    }

    /// Records that the tap of user id `uid` runs this guard's program.
    pub fn attached(&self, uid: u32) {
        self.attached
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(uid);
    }

    /// Whether this guard found or put its program on the tap of user id `uid` before (a
    /// filter running another program is then drift, not an earlier agent's).
    #[must_use]
    pub fn was_attached(&self, uid: u32) -> bool {
        self.attached
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(&uid)
    }

    /// Forgets user id `uid` (its entry and counters); a missing one is fine.
    ///
    /// # Errors
    /// A map error.
    pub fn forget(&self, uid: u32) -> Result<(), GuestGuardError> {
        self.attached
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&uid);
        if let Some(inode) = self.by_uid().remove(&uid) {
            self.vms(|m| {
                if m.get(&inode, 0).ok().is_some_and(|e| e.uid == uid) {
                    ignore_missing(m.remove(&inode))
                } else {
                    Ok(())
                }
            })?;
        }
        self.drops_map(|m| ignore_missing(m.remove(&uid)))
    }

    /// Attaches the program to the ingress of `tap` in the calling thread's namespace (a clsact
    /// qdisc made when missing), replacing the program of a filter of ours already there (an
    /// earlier agent's): one netlink request, atomic. The filter stays when the agent exits.
    ///
    /// # Errors
    /// [`GuestGuardError::Tap`].
    pub fn attach_here(&self, tap: &str) -> Result<(), GuestGuardError> {
        let mut bpf = self.lock();
        let mut run = || -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
            let prog: &mut SchedClassifier = bpf
                .program_mut(PROGRAM)
                .ok_or_else(|| format!("no program {PROGRAM}"))?
                .try_into()?;
            // An existing clsact qdisc (an earlier agent, other tools) is fine.
            let _ = aya::programs::tc::qdisc_add_clsact(tap);
            let opts = || {
                TcAttachOptions::Netlink(NlOptions {
                    priority: FILTER_PRIORITY,
                    handle: FILTER_HANDLE,
                    ..NlOptions::default()
                })
            };
            let kind = TcAttachType::Ingress;
            let id = match prog.attach_with_options(tap, kind, opts()) {
                Ok(id) => id,
                Err(first) => {
                    let old = SchedClassifierLink::attached(
                        tap,
                        kind,
                        FILTER_PRIORITY,
                        FILTER_HANDLE,
                        None,
                    )?;
                    prog.attach_to_link(old)
                        .map_err(|e| format!("{first}; replacing: {e}"))?
                }
            };
            // Released, not detached: the filter stays when this process exits.
            std::mem::forget(prog.take_link(id)?);
            Ok(())
        };
        run().map_err(|source| GuestGuardError::Tap {
            tap: tap.to_owned(),
            op: "attach",
            source,
        })
    }

    /// The drops of user id `uid` by kind ([`DROP_KINDS`]), summed over CPUs; `None` when it
    /// is not registered.
    ///
    /// # Errors
    /// A map error.
    pub fn drops(&self, uid: u32) -> Result<Option<BTreeMap<&'static str, u64>>, GuestGuardError> {
        let per_cpu = self.drops_map(|m| match m.get(&uid, 0) {
            Ok(v) => Ok(Some(v)),
            Err(e) => ignore_missing(Err(e)).map(|()| None),
        })?;
        Ok(per_cpu.map(|v| by_kind(v.iter())))
    }

    /// The drops of the whole host.
    ///
    /// # Errors
    /// A map error.
    pub fn totals(&self) -> Result<GuardTotals, GuestGuardError> {
        let all: Vec<(u32, PerCpuValues<[u64; KINDS]>)> =
            self.drops_map(|m| m.iter().collect::<Result<_, _>>())?;
        let drops = by_kind(all.iter().flat_map(|(_, v)| v.iter()));
        let per_vm = all.iter().map(|(u, v)| (*u, by_kind(v.iter()))).collect();
        let unregistered = {
            let bpf = self.lock();
            let map = bpf.map(UNKNOWN).ok_or(GuestGuardError::Map {
                map: UNKNOWN,
                source: aya::maps::MapError::InvalidName {
                    name: UNKNOWN.into(),
                },
            })?;
            let arr = PerCpuArray::<_, u64>::try_from(map).map_err(map_err(UNKNOWN))?;
            arr.get(&0, 0).map_err(map_err(UNKNOWN))?.iter().sum()
        };
        Ok(GuardTotals {
            vms: self.by_uid().len() as u64,
            drops,
            unregistered,
            per_vm,
        })
    }
}

/// Deletes the guard's filter from `tap` in the calling thread's namespace, whichever agent
/// attached it: what removing the filter by hand does (tests and the sandbox's checks that the
/// guard fails closed and is repaired).
///
/// # Errors
/// [`GuestGuardError::Tap`] (also when there is no such filter).
pub fn detach_here(tap: &str) -> Result<(), GuestGuardError> {
    let err = |source: Box<dyn std::error::Error + Send + Sync>| GuestGuardError::Tap {
        tap: tap.to_owned(),
        op: "detach",
        source,
    };
    let link = SchedClassifierLink::attached(
        tap,
        TcAttachType::Ingress,
        FILTER_PRIORITY,
        FILTER_HANDLE,
        None,
    )
    .map_err(|e| err(Box::new(e)))?;
    link.detach().map_err(|e| err(Box::new(e)))
}

/// Per-CPU counter arrays summed by kind.
fn by_kind<'a>(values: impl Iterator<Item = &'a [u64; KINDS]>) -> BTreeMap<&'static str, u64> {
    let mut sum = [0u64; KINDS];
    for v in values {
        for (s, n) in sum.iter_mut().zip(v) {
            *s = s.wrapping_add(*n);
        }
    }
    DROP_KINDS.iter().copied().zip(sum).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_carries_the_mesh_address_the_block_halves_and_the_flags() {
        let plan = GuardPlan {
            tap: "t".into(),
            user_id: 7,
            mesh: Some("fdaa:1::7".parse().unwrap()),
            block: Some("2001:db8:7:8000::/49".parse().unwrap()),
            gateway: true,
        };
        let e = GuardEntry::of(&plan);
        assert_eq!(e.uid, 7);
        assert_eq!(e.flags, F_MESH | F_BLOCK | F_GATEWAY);
        assert_eq!(e.mesh[..2], [0xfd, 0xaa]);
        assert_eq!(e.block_hi, 0x2001_0db8_0007_8000);
        assert_eq!(e.block_lo, 0);
        assert_eq!(e.block_len, 49);
        assert_eq!(std::mem::size_of::<GuardEntry>(), 48);
        let bare = GuardEntry::of(&GuardPlan {
            tap: "t".into(),
            user_id: 1,
            mesh: None,
            block: None,
            gateway: false,
        });
        assert_eq!((bare.flags, bare.mesh, bare.block_len), (0, [0; 16], 0));
    }

    #[test]
    fn counters_are_summed_over_cpus_by_kind() {
        let mut a = [0u64; KINDS];
        let mut b = [0u64; KINDS];
        a[3] = 2;
        b[3] = 5;
        b[5] = 1;
        let s = by_kind([a, b].iter());
        assert_eq!(s["ipv4_source"], 7);
        assert_eq!(s["mesh_source"], 1);
        assert_eq!(s["mac"], 0);
        assert_eq!(s.len(), KINDS);
    }
}
