//! Throughput limits as tc objects (spec: namespaced-vm-networking.md, "Throughput limits").
//!
//! # Design
//! Shaping (HTB), never policing, on egress only, inside the VM netns:
//!
//! | device | its egress carries | classified by | direction |
//! |---|---|---|---|
//! | the tap `<prefix>t<uid>` | what the guest receives | source address | download |
//! | the VM veth end `<prefix>p<uid>` | what the guest sends | destination address | upload |
//!
//! Each device gets the same tree (a [`TcTree`]):
//! - root qdisc `htb` handle `1:`, default class `1:0` (HTB's direct queue: unshaped), with a size
//!   table of overhead −14 so HTB counts IP packets, not their Ethernet header (1 MiB/s =
//!   1,048,576 bytes of IP packets per second). A GSO packet (a TCP burst of up to 64 KiB that
//!   the tap or veth hands on whole, as a virtio-net guest or the host stack sends it) is
//!   counted as its length − 14: the kernel's size table starts from `skb->len` and drops the
//!   per-segment header count the qdisc layer adds otherwise, so the IP and TCP headers of the
//!   2nd and later segments are not counted (TCP over IPv4 with timestamps: up to 3.9 % more IP
//!   bytes than the limit, about 0.1 % more payload; IPv6: up to 5.5 % more IP bytes). No size
//!   table (counting Ethernet frames exactly) would cut the payload to 0.95 (IPv4) and 0.94
//!   (IPv6) of the limit, and HTB's own rate overhead cannot be negative;
//! - class `1:10` private and `1:20` public, each `rate = ceil = limit`, no parent (no
//!   borrowing). An unlimited class (limit 0, or the public limit while it is not applied)
//!   keeps its class at [`UNLIMITED_BYTES_PER_SEC`], so every limit change is a class change;
//! - u32 filters, IPv4 at priority [`IPV4_PRIO`] and IPv6 at [`IPV6_PRIO`], in order (first match
//!   wins): link-local and multicast → `1:0` (unshaped), private prefixes → `1:10`, everything
//!   else → `1:20`. Frames that are not IP match no filter and take the default `1:0`.
//!
//! The classes (decisions where the spec is silent are marked *):
//! - private: 10/8, 172.16/12, 192.168/16, 100.64/10*, fdaa::/16;
//! - unshaped: 169.254/16* (link-local, never routed: the metadata address 169.254.169.254 is
//!   served inside the netns), fe80::/10 and ff00::/8 (NDP, the guest link's own traffic), and
//!   everything that is not IP;
//! - public: every other IPv4 and IPv6 address (the spec names IPv4 only; leaving public IPv6
//!   unshaped would be a hole).
//!
//! 100.64/10 (shared address space, RFC 6598) counts as private: it is not routed on the
//! internet, and carrier or overlay networks that use it are private networks.
//!
//! The public limit applies to whatever public path a VM has: a route via host, IPv4 (the
//! namespace's NAT) or IPv6. A VM without any route via host has no public path (spec: "no
//! public IPv4 path"; the IPv6 path counts too*, as public IPv6 through the host is public
//! traffic like IPv4): it keeps its public limit stored and reports it not applied, its public
//! class unlimited, until a route via host exists. Public destinations a VM reaches through a
//! gateway VM cross the mesh, not the host uplink: they do not make a public path. A VM without a veth pair
//! (no mesh address) has no network path, so nothing is shaped. A VM with no limit in force has no
//! tree at all (its devices keep the kernel's default qdisc); the first limit in force adds it.

use std::net::{Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use serde::{Deserialize, Serialize};

/// Bytes per MiB.
pub const MIB: u64 = 1_048_576;

/// The rate of an unlimited class, bytes/s: twice the largest limit (≈ 1.7 Tbit/s), far above
/// what a veth or tap carries.
pub const UNLIMITED_BYTES_PER_SEC: u64 = 200_000 * MIB;

/// The HTB root qdisc handle `1:` (major 1, minor 0).
pub const ROOT_HANDLE: u32 = 0x0001_0000;
/// The classid of the private class, `1:10`.
pub const PRIVATE_CLASSID: u32 = 0x0001_0010;
/// The classid of the public class, `1:20`.
pub const PUBLIC_CLASSID: u32 = 0x0001_0020;
/// The "class" `1:0`: HTB's direct queue, unshaped.
pub const DIRECT_CLASSID: u32 = ROOT_HANDLE;
/// The u32 filter priority of the IPv4 filters.
pub const IPV4_PRIO: u16 = 10;
/// The u32 filter priority of the IPv6 filters.
pub const IPV6_PRIO: u16 = 20;
/// `ETH_P_IP`.
pub const ETH_P_IP: u16 = 0x0800;
/// `ETH_P_IPV6`.
pub const ETH_P_IPV6: u16 = 0x86dd;
/// The size-table overhead: HTB counts `skb->len − 14`, the IP packet without its Ethernet header.
pub const IP_OVERHEAD: i32 = -14;
/// The HTB quantum of every class, bytes (only matters between classes that borrow; ours do not).
pub const QUANTUM: u32 = 60_000;
/// The HTB direct queue length, packets (the unshaped traffic).
pub const DIRECT_QLEN: u32 = 1000;
/// How long a class may send at line speed after being idle: its burst is this much of its rate
/// (at least [`MIN_BURST`]).
pub const BURST_MS: u64 = 10;
/// The smallest burst, bytes.
pub const MIN_BURST: u64 = 32 * 1024;

/// Which traffic class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TrafficClass {
    /// Private networks and the mesh.
    Private,
    /// Everything else.
    Public,
}

impl TrafficClass {
    /// The HTB classid.
    #[must_use]
    pub const fn classid(self) -> u32 {
        match self {
            Self::Private => PRIVATE_CLASSID,
            Self::Public => PUBLIC_CLASSID,
        }
    }
}

/// Which way, seen from the VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// What the guest receives (the tap's egress, classified by source).
    Download,
    /// What the guest sends (the VM veth end's egress, classified by destination).
    Upload,
}

/// One HTB class.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HtbClass {
    /// Which traffic class.
    pub class: TrafficClass,
    /// The classid (`1:10`, `1:20`).
    pub classid: u32,
    /// `rate` and `ceil`, bytes of IP packets per second.
    pub rate: u64,
    /// Burst (`buffer`/`cbuffer` as an amount at `rate`), bytes.
    pub burst: u64,
    /// Quantum, bytes.
    pub quantum: u32,
    /// The configured limit, MiB/s (0 = unlimited).
    pub limit_mibps: u32,
    /// Whether the limit is in force (false: unlimited, or the public limit not applied).
    pub applied: bool,
}

/// One u32 key: `(packet[off..off+4] & mask) == value`, offsets from the network header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct U32Key {
    /// Offset from the network header, bytes (a multiple of 4).
    pub off: i32,
    /// The value (host order; the kernel layer writes it big-endian).
    pub value: u32,
    /// The mask (host order).
    pub mask: u32,
}

/// One u32 filter: the keys all match → `classid`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct U32Filter {
    /// `ETH_P_IP` or `ETH_P_IPV6`.
    pub protocol: u16,
    /// Filter priority.
    pub prio: u16,
    /// The u32 node number `n` (1, 2, …), tried in order. The hash table part is left to the
    /// kernel: u32 hash tables are shared by every u32 classifier of a qdisc, so a full handle
    /// like `800::1` would name the first classifier's node from the second one.
    pub handle: u32,
    /// The prefix matched (for people and error messages).
    pub prefix: IpNet,
    /// The keys (empty for the catch-all `0/0`, which gets one key with mask 0).
    pub keys: Vec<U32Key>,
    /// Where a match goes.
    pub classid: u32,
}

/// The HTB tree of one device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TcTree {
    /// The device inside the VM netns.
    pub dev: String,
    /// Which direction its egress carries.
    pub direction: Direction,
    /// The root qdisc handle ([`ROOT_HANDLE`]).
    pub handle: u32,
    /// HTB's default class minor (0: the direct queue).
    pub default_minor: u32,
    /// The size-table overhead ([`IP_OVERHEAD`]).
    pub overhead: i32,
    /// The direct queue length.
    pub direct_qlen: u32,
    /// Private then public.
    pub classes: Vec<HtbClass>,
    /// IPv4 filters in order, then IPv6 filters in order.
    pub filters: Vec<U32Filter>,
}

/// The tc part of one VM's plan.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct LimitsPlan {
    /// The private limit as configured, MiB/s (0 = unlimited).
    pub private_mibps: u32,
    /// The public limit as configured, MiB/s (0 = unlimited).
    pub public_mibps: u32,
    /// Whether the public limit is applied (it needs a public path: a route via host).
    pub public_applied: bool,
    /// The trees: download (tap) then upload (VM veth end); empty without limits or veth.
    pub trees: Vec<TcTree>,
}

/// The private prefixes, in filter order.
#[must_use]
pub fn private_prefixes() -> Vec<IpNet> {
    let v4 = |a, b, l| IpNet::V4(Ipv4Net::new(Ipv4Addr::new(a, b, 0, 0), l).expect("valid"));
    vec![
        v4(10, 0, 8),
        v4(172, 16, 12),
        v4(192, 168, 16),
        v4(100, 64, 10),
        IpNet::V6(vmnet_model::vm::MESH_RANGE),
    ]
}

/// The unshaped prefixes (link-local and multicast on the guest link), in filter order.
#[must_use]
pub fn unshaped_prefixes() -> Vec<IpNet> {
    vec![
        IpNet::V4(Ipv4Net::new(Ipv4Addr::new(169, 254, 0, 0), 16).expect("valid")),
        IpNet::V6(Ipv6Net::new(Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0), 10).expect("valid")),
        IpNet::V6(Ipv6Net::new(Ipv6Addr::new(0xff00, 0, 0, 0, 0, 0, 0, 0), 8).expect("valid")),
    ]
}

/// The u32 keys matching `prefix` at `base` (the source or destination offset of its family).
#[must_use]
pub fn prefix_keys(prefix: IpNet, base: i32) -> Vec<U32Key> {
    let (words, len): (Vec<u32>, u8) = match prefix {
        IpNet::V4(n) => (vec![u32::from(n.network())], n.prefix_len()),
        IpNet::V6(n) => {
            let o = n.network().octets();
            (
                o.chunks(4)
                    .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
                n.prefix_len(),
            )
        }
    };
    let mut keys = Vec::new();
    let mut left = u32::from(len);
    for (i, w) in words.into_iter().enumerate() {
        if left == 0 {
            break;
        }
        let bits = left.min(32);
        left -= bits;
        let mask = if bits == 32 {
            u32::MAX
        } else {
            !(u32::MAX >> bits)
        };
        let off = base + 4 * i32::try_from(i).expect("at most 4 words");
        keys.push(U32Key {
            off,
            value: w & mask,
            mask,
        });
    }
    if keys.is_empty() {
        // The catch-all: u32 needs one key; mask 0 matches every packet.
        keys.push(U32Key {
            off: base,
            value: 0,
            mask: 0,
        });
    }
    keys
}

/// The filters of one device: `by_source` for the download tree (the tap), else by destination.
#[must_use]
pub fn filters(by_source: bool) -> Vec<U32Filter> {
    let mut out = Vec::new();
    for (v4, protocol, prio) in [(true, ETH_P_IP, IPV4_PRIO), (false, ETH_P_IPV6, IPV6_PRIO)] {
        // IPv4 source at 12, destination at 16; IPv6 source at 8, destination at 24.
        let base = match (v4, by_source) {
            (true, true) => 12,
            (true, false) => 16,
            (false, true) => 8,
            (false, false) => 24,
        };
        let fam = |p: &IpNet| matches!(p, IpNet::V4(_)) == v4;
        let any = if v4 {
            IpNet::V4(Ipv4Net::default())
        } else {
            IpNet::V6(Ipv6Net::default())
        };
        let rules = unshaped_prefixes()
            .into_iter()
            .filter(fam)
            .map(|p| (p, DIRECT_CLASSID))
            .chain(
                private_prefixes()
                    .into_iter()
                    .filter(fam)
                    .map(|p| (p, PRIVATE_CLASSID)),
            )
            .chain([(any, PUBLIC_CLASSID)]);
        for (n, (prefix, classid)) in (1u32..).zip(rules) {
            out.push(U32Filter {
                protocol,
                prio,
                handle: n,
                prefix,
                keys: prefix_keys(prefix, base),
                classid,
            });
        }
    }
    out
}

/// The burst of a class at `rate`, bytes.
#[must_use]
pub fn burst_of(rate: u64) -> u64 {
    (rate * BURST_MS / 1000).max(MIN_BURST)
}

fn class(class: TrafficClass, limit_mibps: u32, applied: bool) -> HtbClass {
    let in_force = applied && limit_mibps > 0;
    let rate = if in_force {
        u64::from(limit_mibps) * MIB
    } else {
        UNLIMITED_BYTES_PER_SEC
    };
    HtbClass {
        class,
        classid: class.classid(),
        rate,
        burst: burst_of(rate),
        quantum: QUANTUM,
        limit_mibps,
        applied: in_force,
    }
}

/// Plans the limits of one VM: `tap` and `peer` are its tap and VM veth end (`None` without a
/// veth pair), `public_path` whether it has a public path (a route via host, IPv4 or IPv6).
#[must_use]
pub fn plan_limits(
    private_mibps: u32,
    public_mibps: u32,
    public_path: bool,
    tap: &str,
    peer: Option<&str>,
) -> LimitsPlan {
    let public_applied = public_path;
    let mut plan = LimitsPlan {
        private_mibps,
        public_mibps,
        public_applied,
        trees: Vec::new(),
    };
    let Some(peer) = peer else { return plan };
    if private_mibps == 0 && (public_mibps == 0 || !public_applied) {
        return plan;
    }
    let classes = vec![
        class(TrafficClass::Private, private_mibps, true),
        class(TrafficClass::Public, public_mibps, public_applied),
    ];
    for (dev, direction) in [(tap, Direction::Download), (peer, Direction::Upload)] {
        plan.trees.push(TcTree {
            dev: dev.to_owned(),
            direction,
            handle: ROOT_HANDLE,
            default_minor: 0,
            overhead: IP_OVERHEAD,
            direct_qlen: DIRECT_QLEN,
            classes: classes.clone(),
            filters: filters(direction == Direction::Download),
        });
    }
    plan
}

#[cfg(test)]
mod tests;
