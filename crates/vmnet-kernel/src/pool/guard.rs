//! The tap guard: a BPF filter on every instance tap that does not depend on nftables (spec:
//! "bcd's nftables tables", "Drift": what guests can do between a flushed ruleset and its
//! repair — nothing unfiltered).
//!
//! # Design
//! Two tc programs (`bpf/tap_guard.bpf.c`, compiled by `build.rs`) on each tap's clsact qdisc,
//! attached as legacy `cls_bpf` direct-action filters (priority [`FILTER_PRIORITY`], handle
//! [`FILTER_HANDLE`]):
//!
//! - **ingress** (frames the guest sends) repeats chain `from_tap` of `bridge bcd_instances`:
//!   unknown tap, policy `none` and `private`, source MAC, EtherType (IPv4, ARP, IPv6 only, no
//!   VLAN tag), ARP sender MAC and address, IPv4 and IPv6 source (with the same `0.0.0.0` and
//!   `::` exceptions), DHCP/DHCPv6 server replies, router advertisements and redirects, and the
//!   host's own addresses. Its data is in BPF hash maps keyed by the tap's ifindex, written from
//!   the same [`TapEntry`] values the nft sets are rendered from.
//! - **egress** (frames sent to the guest) passes only frames that chain `to_tap` marked with
//!   [`GUARD_MARK`] and clears that bit. With the bcd tables gone nothing is marked, so nothing
//!   reaches a guest until the audit has re-applied them.
//!
//! So in the drift gap a guest's frames still pass the full source and policy checks and it
//! receives nothing (tested in `tests/pool_guard.rs`). The filters are kept attached when the
//! agent exits (the links are released, not detached): the kernel holds the programs and their
//! maps until the tap goes. A new agent loads fresh programs and replaces the filter on each tap
//! it ensures (netlink `RTM_NEWTFILTER` without `NLM_F_EXCL` swaps the program atomically).
//!
//! Map updates are not atomic across maps: while one tap's addresses change, a frame may see the
//! old or the new set (never an empty one — new entries are written before stale ones go).
//!
//! # Limitations
//! The IPv6 extension-header walk stops after 8 headers (a deeper chain is dropped as
//! malformed); the guard is stricter than nft for a few malformed or fragmented frames (a
//! truncated ARP or transport header, a `0.0.0.0` source on a non-first fragment) — both layers
//! apply in normal operation, so such frames are dropped.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Mutex;

use aya::maps::{HashMap as BpfHashMap, MapData, PerCpuArray};
use aya::programs::tc::{NlOptions, SchedClassifierLink, TcAttachOptions, TcHandle};
use aya::programs::{SchedClassifier, TcAttachType};
use aya::{Ebpf, EbpfLoader, Pod};
use vmnet_model::nic::{IfName, NetworkPolicy};
use vmnet_plan::pool::nft::{GUARD_MARK, HostAddrs, TapEntry};

use crate::netns::NetnsError;

/// The compiled BPF object.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/tap_guard.o"));

/// tc filter priority of both programs (lower runs first).
pub const FILTER_PRIORITY: u16 = 1;
/// tc filter handle of both programs.
pub const FILTER_HANDLE: TcHandle = TcHandle::new(0, 0xbcd);

/// Drop reasons, in the order of the `drops` counters (`enum reason` in the C program).
pub const DROP_REASONS: [&str; 11] = [
    "unknown_tap",
    "policy",
    "source_mac",
    "ethertype",
    "arp",
    "ipv4_source",
    "ipv6_source",
    "server_message",
    "host_address",
    "malformed",
    "unmarked",
];

const F_POLICY_NONE: u8 = 1;
const F_POLICY_PRIVATE: u8 = 2;
const F_IP4_UNCHECKED: u8 = 4;

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct TapInfo {
    mac: [u8; 6],
    flags: u8,
    pad: u8,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Key4 {
    ifindex: u32,
    addr: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Key6 {
    ifindex: u32,
    addr: [u8; 16],
}

// SAFETY: plain `repr(C)` structs of integers with no padding, matching the C structs.
unsafe impl Pod for TapInfo {}
// SAFETY: as above.
unsafe impl Pod for Key4 {}
// SAFETY: as above.
unsafe impl Pod for Key6 {}

/// A guard failure, naming the tap or map.
#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    /// The BPF object could not be loaded (no BPF support, not root).
    #[error("load the tap guard")]
    Load(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// A tap does not exist.
    #[error("tap {0}: no such device")]
    NoTap(String),
    /// Attaching the programs to a tap failed.
    #[error("tap {tap}: attach the guard")]
    Attach {
        /// The tap.
        tap: String,
        /// What failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A map update failed.
    #[error("guard map {map}")]
    Map {
        /// The map.
        map: &'static str,
        /// What failed.
        #[source]
        source: aya::maps::MapError,
    },
    /// The namespace could not be entered.
    #[error("netns")]
    Netns(#[source] NetnsError),
}

fn map_err(map: &'static str) -> impl Fn(aya::maps::MapError) -> GuardError {
    move |source| GuardError::Map { map, source }
}

#[derive(Debug, Clone)]
struct Attached {
    ifindex: u32,
    entry: TapEntry,
}

struct Inner {
    bpf: Ebpf,
    taps: BTreeMap<IfName, Attached>,
    /// What [`TapGuard::set_host`] last wrote, by map name.
    host: BTreeMap<&'static str, BTreeSet<IpAddr>>,
}

/// The loaded guard of one host namespace. All methods are blocking (netlink and bpf(2) calls).
pub struct TapGuard {
    ns: Option<String>,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for TapGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TapGuard").field("ns", &self.ns).finish()
    }
}

fn flags(e: &TapEntry) -> u8 {
    let mut f = match e.policy {
        NetworkPolicy::Public => 0,
        NetworkPolicy::None => F_POLICY_NONE,
        NetworkPolicy::Private => F_POLICY_PRIVATE,
    };
    if e.ip4_unchecked() {
        f |= F_IP4_UNCHECKED;
    }
    f
}

fn keys4(ifindex: u32, e: &TapEntry) -> BTreeSet<Key4> {
    e.ip4
        .iter()
        .map(|a| Key4 {
            ifindex,
            addr: u32::from_ne_bytes(a.octets()),
        })
        .collect()
}

fn keys6(ifindex: u32, e: &TapEntry) -> BTreeSet<Key6> {
    e.ip6
        .iter()
        .map(|a| Key6 {
            ifindex,
            addr: a.octets(),
        })
        .collect()
}

impl Inner {
    fn hash<K: Pod, V: Pod>(
        &mut self,
        name: &'static str,
    ) -> Result<BpfHashMap<&mut MapData, K, V>, GuardError> {
        let map = self.bpf.map_mut(name).ok_or(GuardError::Map {
            map: name,
            source: aya::maps::MapError::InvalidName { name: name.into() },
        })?;
        BpfHashMap::try_from(map).map_err(map_err(name))
    }

    /// Writes `new`'s entries (for `ifindex`), then removes what `old` had and `new` lacks.
    fn write_tap(
        &mut self,
        ifindex: u32,
        new: Option<&TapEntry>,
        old: Option<&Attached>,
    ) -> Result<(), GuardError> {
        let want4 = new.map(|e| keys4(ifindex, e)).unwrap_or_default();
        let want6 = new.map(|e| keys6(ifindex, e)).unwrap_or_default();
        {
            let mut m = self.hash::<Key4, u8>("tap_ip4")?;
            for k in &want4 {
                m.insert(k, 1, 0).map_err(map_err("tap_ip4"))?;
            }
        }
        {
            let mut m = self.hash::<Key6, u8>("tap_ip6")?;
            for k in &want6 {
                m.insert(k, 1, 0).map_err(map_err("tap_ip6"))?;
            }
        }
        {
            let mut m = self.hash::<u32, u32>("leased4")?;
            for k in &want4 {
                m.insert(k.addr, ifindex, 0).map_err(map_err("leased4"))?;
            }
        }
        {
            let mut m = self.hash::<u32, TapInfo>("taps")?;
            if let Some(e) = new {
                let info = TapInfo {
                    mac: e.mac.octets(),
                    flags: flags(e),
                    pad: 0,
                };
                m.insert(ifindex, info, 0).map_err(map_err("taps"))?;
            }
            if let Some(o) = old
                && (new.is_none() || o.ifindex != ifindex)
            {
                ignore_missing(m.remove(&o.ifindex)).map_err(map_err("taps"))?;
            }
        }
        if let Some(o) = old {
            let stale4: Vec<Key4> = keys4(o.ifindex, &o.entry)
                .difference(&want4)
                .copied()
                .collect();
            let mut m = self.hash::<Key4, u8>("tap_ip4")?;
            for k in &stale4 {
                ignore_missing(m.remove(k)).map_err(map_err("tap_ip4"))?;
            }
            // A lease moves to another tap only after this one let it go: remove it from
            // `leased4` only while it still names this tap.
            let mut m = self.hash::<u32, u32>("leased4")?;
            for k in &stale4 {
                let still_new = want4.iter().any(|w| w.addr == k.addr);
                if !still_new && m.get(&k.addr, 0).ok() == Some(o.ifindex) {
                    ignore_missing(m.remove(&k.addr)).map_err(map_err("leased4"))?;
                }
            }
            let mut m = self.hash::<Key6, u8>("tap_ip6")?;
            for k in keys6(o.ifindex, &o.entry).difference(&want6) {
                ignore_missing(m.remove(k)).map_err(map_err("tap_ip6"))?;
            }
        }
        Ok(())
    }
}

use crate::bpffs::ignore_missing;

/// Attaches `prog` to `tap` (in the current namespace) at our priority and handle, replacing a
/// filter already there, and leaves it attached when the program object goes.
fn attach_one(
    prog: &mut SchedClassifier,
    tap: &str,
    kind: TcAttachType,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let opts = || {
        TcAttachOptions::Netlink(NlOptions {
            priority: FILTER_PRIORITY,
            handle: FILTER_HANDLE,
            ..NlOptions::default()
        })
    };
    let id = match prog.attach_with_options(tap, kind, opts()) {
        Ok(id) => id,
        Err(first) => {
            // A filter from an earlier agent: swap in this program.
            let old =
                SchedClassifierLink::attached(tap, kind, FILTER_PRIORITY, FILTER_HANDLE, None)?;
            prog.attach_to_link(old)
                .map_err(|e| format!("{first}; replacing: {e}"))?
        }
    };
    let link = prog.take_link(id)?;
    // Released, not detached: the filter stays when this process exits (see the module docs).
    std::mem::forget(link);
    Ok(())
}

/// Removes the guard's filters from `tap` in namespace `ns` (`None`: this thread's), if any: for
/// an agent started without the guard over taps a guarded agent left. `Ok(false)` when there
/// were none.
///
/// # Errors
/// [`GuardError::Attach`] when listing or deleting the filters fails.
pub fn detach_from(ns: Option<&str>, tap: &str) -> Result<bool, GuardError> {
    let run = || -> Result<bool, Box<dyn std::error::Error + Send + Sync>> {
        let mut any = false;
        for (name, kind) in [
            ("guard_in", TcAttachType::Ingress),
            ("guard_out", TcAttachType::Egress),
        ] {
            match aya::programs::tc::qdisc_detach_program(tap, kind, name) {
                Ok(()) => any = true,
                Err(aya::programs::tc::TcError::IoError(e))
                    if e.kind() == std::io::ErrorKind::NotFound =>
                {
                    // No filter of that name on the tap (or no clsact qdisc at all).
                }
                Err(e) => return Err(Box::new(e)),
            }
        }
        Ok(any)
    };
    let result = match ns {
        Some(ns) => crate::netns::run_in(ns, run).map_err(GuardError::Netns)?,
        None => run(),
    };
    result.map_err(|source| GuardError::Attach {
        tap: tap.to_owned(),
        source,
    })
}

impl TapGuard {
    /// Loads the guard programs and maps. `ns` is the namespace its taps live in (`None`: this
    /// thread's namespace).
    ///
    /// # Errors
    /// [`GuardError::Load`] without BPF support or privileges (CAP_BPF, CAP_NET_ADMIN).
    pub fn load(ns: Option<&str>) -> Result<Self, GuardError> {
        let mut bpf = EbpfLoader::new()
            .override_global("GUARD_MARK", &GUARD_MARK, true)
            .load(OBJECT)
            .map_err(|e| GuardError::Load(Box::new(e)))?;
        for name in ["guard_in", "guard_out"] {
            let prog: &mut SchedClassifier = bpf
                .program_mut(name)
                .ok_or_else(|| GuardError::Load(format!("no program {name}").into()))?
                .try_into()
                .map_err(|e| GuardError::Load(Box::new(e)))?;
            prog.load().map_err(|e| GuardError::Load(Box::new(e)))?;
        }
        Ok(Self {
            ns: ns.map(str::to_owned),
            inner: Mutex::new(Inner {
                bpf,
                taps: BTreeMap::new(),
                host: BTreeMap::new(),
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn in_ns<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T, GuardError> {
        match &self.ns {
            Some(ns) => crate::netns::run_in(ns, f).map_err(GuardError::Netns),
            None => Ok(f()),
        }
    }

    /// Writes `entry`'s data (MAC, addresses, policy) and attaches both programs to its tap,
    /// which must exist. Idempotent; an entry changed since the last call is updated in place.
    ///
    /// # Errors
    /// [`GuardError::NoTap`], [`GuardError::Attach`] or a map error.
    pub fn attach(&self, entry: &TapEntry) -> Result<(), GuardError> {
        let tap = entry.tap.as_str().to_owned();
        let ifindex = self
            .in_ns(|| nix::net::if_::if_nametoindex(tap.as_str()).ok())?
            .ok_or_else(|| GuardError::NoTap(tap.clone()))?;
        let mut inner = self.lock();
        let old = inner.taps.get(&entry.tap).cloned();
        inner.write_tap(ifindex, Some(entry), old.as_ref())?;
        inner.taps.insert(
            entry.tap.clone(),
            Attached {
                ifindex,
                entry: entry.clone(),
            },
        );
        let bpf = &mut inner.bpf;
        let attach_err = |source| GuardError::Attach {
            tap: tap.clone(),
            source,
        };
        self.in_ns(|| -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
            // An existing clsact qdisc (earlier agent, other tools) is fine.
            let _ = aya::programs::tc::qdisc_add_clsact(&tap);
            for (name, kind) in [
                ("guard_in", TcAttachType::Ingress),
                ("guard_out", TcAttachType::Egress),
            ] {
                let prog: &mut SchedClassifier = bpf
                    .program_mut(name)
                    .ok_or_else(|| format!("no program {name}"))?
                    .try_into()?;
                attach_one(prog, &tap, kind)?;
            }
            Ok(())
        })?
        .map_err(attach_err)
    }

    /// Forgets `tap`'s data (call when the tap is deleted: its filters go with it; a tap left
    /// behind then drops everything it sends as unknown). A tap never attached is a no-op.
    ///
    /// # Errors
    /// A map error.
    pub fn forget(&self, tap: &IfName) -> Result<(), GuardError> {
        let mut inner = self.lock();
        let Some(old) = inner.taps.remove(tap) else {
            return Ok(());
        };
        inner.write_tap(old.ifindex, None, Some(&old))
    }

    /// Sets the host's addresses: those guests may not reach (`host.own` minus `host.gateways`),
    /// the gateways among them (ICMP and DNS only), and the addresses a NIC without an IPv4
    /// address may not send from (`host.own` and `host.gateways`, IPv4).
    ///
    /// # Errors
    /// A map error.
    pub fn set_host(&self, host: &HostAddrs) -> Result<(), GuardError> {
        let own = || host.own.iter().copied();
        let gw = |a: &IpAddr| host.gateways.contains(a);
        let wanted: [(&'static str, BTreeSet<IpAddr>); 5] = [
            (
                "host_block4",
                own().filter(|a| a.is_ipv4() && !gw(a)).collect(),
            ),
            (
                "host_block6",
                own().filter(|a| a.is_ipv6() && !gw(a)).collect(),
            ),
            ("host_gw4", own().filter(|a| a.is_ipv4() && gw(a)).collect()),
            ("host_gw6", own().filter(|a| a.is_ipv6() && gw(a)).collect()),
            (
                "reserved4",
                own()
                    .chain(host.gateways.iter().copied())
                    .filter(IpAddr::is_ipv4)
                    .collect(),
            ),
        ];
        let mut inner = self.lock();
        for (map, want) in wanted {
            let had = inner.host.get(map).cloned().unwrap_or_default();
            for a in &want {
                match a {
                    IpAddr::V4(v) => {
                        inner
                            .hash::<u32, u8>(map)?
                            .insert(u32::from_ne_bytes(v.octets()), 1, 0)
                    }
                    IpAddr::V6(v) => inner.hash::<[u8; 16], u8>(map)?.insert(v.octets(), 1, 0),
                }
                .map_err(map_err(map))?;
            }
            for a in had.difference(&want) {
                ignore_missing(match a {
                    IpAddr::V4(v) => inner
                        .hash::<u32, u8>(map)?
                        .remove(&u32::from_ne_bytes(v.octets())),
                    IpAddr::V6(v) => inner.hash::<[u8; 16], u8>(map)?.remove(&v.octets()),
                })
                .map_err(map_err(map))?;
            }
            inner.host.insert(map, want);
        }
        Ok(())
    }

    /// The taps attached now, sorted.
    #[must_use]
    pub fn taps(&self) -> Vec<IfName> {
        self.lock().taps.keys().cloned().collect()
    }

    /// How many entries the kernel maps hold now: `(taps, tap IPv4 addresses, tap IPv6
    /// addresses)`, read from the kernel (not from this object's bookkeeping).
    ///
    /// # Errors
    /// A map error.
    pub fn map_sizes(&self) -> Result<(usize, usize, usize), GuardError> {
        let mut inner = self.lock();
        let taps = inner.hash::<u32, TapInfo>("taps")?.keys().count();
        let ip4 = inner.hash::<Key4, u8>("tap_ip4")?.keys().count();
        let ip6 = inner.hash::<Key6, u8>("tap_ip6")?.keys().count();
        Ok((taps, ip4, ip6))
    }

    /// Frames dropped so far by reason ([`DROP_REASONS`]), summed over CPUs, since this guard
    /// was loaded.
    ///
    /// # Errors
    /// A map error.
    pub fn drops(&self) -> Result<BTreeMap<&'static str, u64>, GuardError> {
        let inner = self.lock();
        let map = inner.bpf.map("drops").ok_or(GuardError::Map {
            map: "drops",
            source: aya::maps::MapError::InvalidName {
                name: "drops".into(),
            },
        })?;
        let arr = PerCpuArray::<_, u64>::try_from(map).map_err(map_err("drops"))?;
        let mut out = BTreeMap::new();
        for (i, name) in DROP_REASONS.iter().enumerate() {
            let idx = u32::try_from(i).unwrap_or(u32::MAX);
            let per_cpu = arr.get(&idx, 0).map_err(map_err("drops"))?;
            out.insert(*name, per_cpu.iter().sum());
        }
        Ok(out)
    }
}
