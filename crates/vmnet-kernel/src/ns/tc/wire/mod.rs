//! The netlink form of the tc objects of a [`TcTree`]: HTB qdisc and class options (`tc_htb_glob`,
//! `tc_htb_opt` with 64-bit rates), the size table, u32 selectors; written and read back with
//! netlink-packet-route's `TcMessage`, HTB's options encoded here (that crate has no HTB).
//!
//! Rates are written with `linklayer = ethernet`, so the kernel needs no rate tables (it builds
//! its own rate configuration from `rate`/`TCA_HTB_RATE64`); times (`buffer`, `cbuffer`) are
//! psched ticks of 64 ns.

use futures::StreamExt;
use rtnetlink::Handle;
use rtnetlink::packet_core::{
    DefaultNla, NLM_F_ACK, NLM_F_CREATE, NLM_F_REPLACE, NLM_F_REQUEST, NetlinkMessage,
    NetlinkPayload, Nla,
};
use rtnetlink::packet_route::RouteNetlinkMessage;
use rtnetlink::packet_route::tc::{
    TcAttribute, TcFilterU32Option, TcHandle, TcMessage, TcOption, TcStats2, TcU32Key,
    TcU32Selector, TcU32SelectorFlags,
};
use vmnet_plan::ns::limits::{HtbClass, TcTree, U32Filter, U32Key};

const TCA_OPTIONS: u16 = 2;
const TCA_HTB_PARMS: u16 = 1;
const TCA_HTB_INIT: u16 = 2;
const TCA_HTB_DIRECT_QLEN: u16 = 5;
const TCA_HTB_RATE64: u16 = 6;
const TCA_HTB_CEIL64: u16 = 7;
const TCA_STAB_BASE: u16 = 1;
const TC_LINKLAYER_ETHERNET: u8 = 1;
const HTB_VERSION: u32 = 3;
const HTB_R2Q: u32 = 10;
/// psched ticks per second (one tick is 64 ns).
const TICKS_PER_SEC: u128 = 1_000_000_000 / 64;
/// `TC_H_ROOT`.
pub(super) const TC_H_ROOT: u32 = 0xffff_ffff;

/// A root qdisc as read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct KQdisc {
    pub kind: String,
    pub handle: u32,
    /// HTB's default class minor.
    pub defcls: Option<u32>,
    pub direct_qlen: Option<u32>,
    /// The size table's overhead (`None`: no size table).
    pub overhead: Option<i32>,
}

/// Counters of a class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct KStats {
    pub bytes: u64,
    pub packets: u64,
    pub drops: u64,
}

/// An HTB class as read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct KClass {
    pub classid: u32,
    pub kind: String,
    pub rate: u64,
    pub ceil: u64,
    pub buffer: u32,
    pub cbuffer: u32,
    pub quantum: u32,
    pub stats: KStats,
}

/// A filter as read back (one u32 node, or a classifier of another kind).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct KFilter {
    pub kind: String,
    pub protocol: u16,
    pub prio: u16,
    pub handle: u32,
    pub classid: Option<u32>,
    pub terminal: bool,
    pub keys: Vec<U32Key>,
}

/// The psched ticks a burst of `bytes` takes at `rate` bytes/s.
pub(super) fn ticks(bytes: u64, rate: u64) -> u32 {
    let t = u128::from(bytes) * TICKS_PER_SEC / u128::from(rate.max(1));
    u32::try_from(t).unwrap_or(u32::MAX).max(1)
}

fn ratespec(rate: u64) -> [u8; 12] {
    let mut b = [0u8; 12];
    b[1] = TC_LINKLAYER_ETHERNET;
    b[8..12].copy_from_slice(&u32::try_from(rate).unwrap_or(u32::MAX).to_ne_bytes());
    b
}

fn nla(kind: u16, value: Vec<u8>) -> TcOption {
    TcOption::Other(DefaultNla::new(kind, value))
}

fn ne_u32(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4)
        .map_or(0, |s| u32::from_ne_bytes([s[0], s[1], s[2], s[3]]))
}

fn ne_u64(b: &[u8]) -> u64 {
    b.get(..8).map_or(0, |s| {
        u64::from_ne_bytes([s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]])
    })
}

/// The nested attributes inside `bytes`, as (type without flags, value).
fn attrs(bytes: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + 4 <= bytes.len() {
        let len = usize::from(u16::from_ne_bytes([bytes[at], bytes[at + 1]]));
        let kind = u16::from_ne_bytes([bytes[at + 2], bytes[at + 3]]) & 0x3fff;
        if len < 4 || at + len > bytes.len() {
            break;
        }
        out.push((kind, &bytes[at + 4..at + len]));
        at += (len + 3) & !3;
    }
    out
}

/// The raw option attributes of a kind netlink-packet-route does not parse (HTB): it keeps the
/// whole `TCA_OPTIONS` as one attribute.
fn raw_options(m: &TcMessage) -> Vec<(u16, Vec<u8>)> {
    let mut out = Vec::new();
    for a in &m.attributes {
        if let TcAttribute::Options(opts) = a {
            for o in opts {
                let mut buf = vec![0u8; o.value_len()];
                o.emit_value(&mut buf);
                if o.kind() & 0x3fff == TCA_OPTIONS {
                    out.extend(attrs(&buf).into_iter().map(|(k, v)| (k, v.to_vec())));
                } else {
                    out.push((o.kind() & 0x3fff, buf));
                }
            }
        }
    }
    out
}

fn kind_of(m: &TcMessage) -> String {
    m.attributes
        .iter()
        .find_map(|a| match a {
            TcAttribute::Kind(k) => Some(k.clone()),
            _ => None,
        })
        .unwrap_or_default()
}

fn msg(index: u32, parent: u32, handle: u32) -> TcMessage {
    let mut m = TcMessage::with_index(i32::try_from(index).unwrap_or(i32::MAX));
    m.header.parent = TcHandle::from(parent);
    m.header.handle = TcHandle::from(handle);
    m
}

/// The root HTB qdisc of `tree` on link `index`.
pub(super) fn qdisc_msg(index: u32, tree: &TcTree) -> TcMessage {
    let mut m = msg(index, TC_H_ROOT, tree.handle);
    let mut glob = Vec::with_capacity(20);
    for v in [HTB_VERSION, HTB_R2Q, tree.default_minor, 0, 0] {
        glob.extend_from_slice(&v.to_ne_bytes());
    }
    // struct tc_sizespec: cell_log, size_log, cell_align, overhead, linklayer, mpu, mtu, tsize.
    let mut spec = vec![0u8; 24];
    spec[4..8].copy_from_slice(&tree.overhead.to_ne_bytes());
    let mut stab = Vec::with_capacity(28);
    stab.extend_from_slice(&28u16.to_ne_bytes());
    stab.extend_from_slice(&TCA_STAB_BASE.to_ne_bytes());
    stab.extend_from_slice(&spec);
    m.attributes = vec![
        TcAttribute::Kind("htb".into()),
        TcAttribute::Options(vec![
            nla(TCA_HTB_INIT, glob),
            nla(TCA_HTB_DIRECT_QLEN, tree.direct_qlen.to_ne_bytes().to_vec()),
        ]),
        TcAttribute::Stab(stab),
    ];
    m
}

/// An HTB class of the tree rooted at `root` on link `index` (`rate = ceil`).
pub(super) fn class_msg(index: u32, root: u32, c: &HtbClass) -> TcMessage {
    let mut m = msg(index, root, c.classid);
    let buf = ticks(c.burst, c.rate);
    let mut opt = Vec::with_capacity(44);
    opt.extend_from_slice(&ratespec(c.rate));
    opt.extend_from_slice(&ratespec(c.rate));
    for v in [buf, buf, c.quantum, 0, 0] {
        opt.extend_from_slice(&v.to_ne_bytes());
    }
    let mut opts = vec![nla(TCA_HTB_PARMS, opt)];
    if c.rate > u64::from(u32::MAX) {
        opts.push(nla(TCA_HTB_RATE64, c.rate.to_ne_bytes().to_vec()));
        opts.push(nla(TCA_HTB_CEIL64, c.rate.to_ne_bytes().to_vec()));
    }
    m.attributes = vec![TcAttribute::Kind("htb".into()), TcAttribute::Options(opts)];
    m
}

/// `tcm_info` of a filter: priority in the upper half, protocol (network order) in the lower.
fn filter_info(prio: u16, protocol: u16) -> u32 {
    (u32::from(prio) << 16) | u32::from(protocol.to_be())
}

/// A u32 filter node under the qdisc `root` on link `index`: a new node numbered `f.handle` in
/// its classifier's own hash table, or a replacement of the node with the full `handle`.
pub(super) fn filter_msg(index: u32, root: u32, f: &U32Filter, handle: Option<u32>) -> TcMessage {
    let mut m = msg(index, root, handle.unwrap_or(f.handle));
    m.header.info = filter_info(f.prio, f.protocol);
    let mut sel = TcU32Selector::default();
    sel.flags = TcU32SelectorFlags::Terminal;
    sel.nkeys = u8::try_from(f.keys.len()).unwrap_or(u8::MAX);
    sel.keys = f
        .keys
        .iter()
        .map(|k| {
            let mut key = TcU32Key::default();
            key.off = k.off;
            key.val = k.value;
            key.mask = k.mask;
            key
        })
        .collect();
    m.attributes = vec![
        TcAttribute::Kind("u32".into()),
        TcAttribute::Options(vec![
            TcOption::U32(TcFilterU32Option::ClassId(TcHandle::from(f.classid))),
            TcOption::U32(TcFilterU32Option::Selector(sel)),
        ]),
    ];
    m
}

/// A filter deletion: one node (`handle` ≠ 0) or a whole classifier (`handle` = 0).
pub(super) fn filter_del_msg(
    index: u32,
    root: u32,
    prio: u16,
    protocol: u16,
    handle: u32,
) -> TcMessage {
    let mut m = msg(index, root, handle);
    m.header.info = filter_info(prio, protocol);
    m
}

/// Reads a root qdisc.
pub(super) fn parse_qdisc(m: &TcMessage) -> KQdisc {
    let mut q = KQdisc {
        kind: kind_of(m),
        handle: u32::from(m.header.handle),
        defcls: None,
        direct_qlen: None,
        overhead: None,
    };
    if q.kind == "htb" {
        for (k, v) in raw_options(m) {
            match k {
                TCA_HTB_INIT => q.defcls = Some(ne_u32(&v, 8)),
                TCA_HTB_DIRECT_QLEN => q.direct_qlen = Some(ne_u32(&v, 0)),
                _ => {}
            }
        }
    }
    for a in &m.attributes {
        if let TcAttribute::Stab(b) = a {
            for (k, v) in attrs(b) {
                if k == TCA_STAB_BASE {
                    q.overhead = Some(i32::from_ne_bytes(ne_u32(v, 4).to_ne_bytes()));
                }
            }
        }
    }
    q
}

/// Reads a class and its counters.
pub(super) fn parse_class(m: &TcMessage) -> KClass {
    let mut c = KClass {
        classid: u32::from(m.header.handle),
        kind: kind_of(m),
        rate: 0,
        ceil: 0,
        buffer: 0,
        cbuffer: 0,
        quantum: 0,
        stats: KStats::default(),
    };
    let (mut rate64, mut ceil64) = (None, None);
    for (k, v) in raw_options(m) {
        match k {
            TCA_HTB_PARMS => {
                c.rate = u64::from(ne_u32(&v, 8));
                c.ceil = u64::from(ne_u32(&v, 20));
                c.buffer = ne_u32(&v, 24);
                c.cbuffer = ne_u32(&v, 28);
                c.quantum = ne_u32(&v, 32);
            }
            TCA_HTB_RATE64 => rate64 = Some(ne_u64(&v)),
            TCA_HTB_CEIL64 => ceil64 = Some(ne_u64(&v)),
            _ => {}
        }
    }
    c.rate = rate64.unwrap_or(c.rate);
    c.ceil = ceil64.unwrap_or(c.ceil);
    for a in &m.attributes {
        if let TcAttribute::Stats2(s) = a {
            for s in s {
                match s {
                    TcStats2::Basic(b) => {
                        c.stats.bytes = b.bytes;
                        c.stats.packets = u64::from(b.packets);
                    }
                    TcStats2::Queue(q) => c.stats.drops = u64::from(q.drops),
                    _ => {}
                }
            }
        }
    }
    c
}

/// Reads a filter node; `None` for the entries a dump adds around the nodes (the classifier
/// itself, u32's hash tables).
pub(super) fn parse_filter(m: &TcMessage) -> Option<KFilter> {
    let kind = kind_of(m);
    let handle = u32::from(m.header.handle);
    let info = m.header.info;
    let prio = u16::try_from(info >> 16).unwrap_or(0);
    let protocol = u16::from_be(u16::try_from(info & 0xffff).unwrap_or(0));
    let mut f = KFilter {
        kind,
        protocol,
        prio,
        handle,
        classid: None,
        terminal: false,
        keys: Vec::new(),
    };
    if f.kind != "u32" {
        return Some(f);
    }
    if handle == 0 || handle & 0xfff == 0 {
        return None;
    }
    for a in &m.attributes {
        if let TcAttribute::Options(opts) = a {
            for o in opts {
                match o {
                    TcOption::U32(TcFilterU32Option::ClassId(h)) => f.classid = Some(u32::from(*h)),
                    TcOption::U32(TcFilterU32Option::Selector(s)) => {
                        f.terminal = s.flags.contains(TcU32SelectorFlags::Terminal);
                        f.keys = s
                            .keys
                            .iter()
                            .map(|k| U32Key {
                                off: k.off,
                                value: k.val,
                                mask: k.mask,
                            })
                            .collect();
                    }
                    _ => {}
                }
            }
        }
    }
    Some(f)
}

/// What a write does with an existing object.
#[derive(Debug, Clone, Copy)]
pub(super) enum Write {
    /// Create or replace (`NLM_F_CREATE | NLM_F_REPLACE`): qdiscs.
    Replace,
    /// Create, or change the existing one in place (`NLM_F_CREATE`): classes and filters.
    CreateOrChange,
    /// Change the existing one in place, never create (no flags): a limit change.
    Change,
}

/// Sends one request and waits for its acknowledgement.
pub(super) async fn send(
    h: &Handle,
    m: RouteNetlinkMessage,
    write: Option<Write>,
) -> Result<(), rtnetlink::Error> {
    start(h, m, write)?.await
}

/// Sends one request now; the returned future waits for its acknowledgement.
pub(super) fn start(
    h: &Handle,
    m: RouteNetlinkMessage,
    write: Option<Write>,
) -> Result<impl std::future::Future<Output = Result<(), rtnetlink::Error>> + use<>, rtnetlink::Error>
{
    let mut req = NetlinkMessage::from(m);
    req.header.flags = NLM_F_REQUEST
        | NLM_F_ACK
        | match write {
            Some(Write::Replace) => NLM_F_CREATE | NLM_F_REPLACE,
            Some(Write::CreateOrChange) => NLM_F_CREATE,
            Some(Write::Change) | None => 0,
        };
    let mut h = h.clone();
    let mut resp = h.request(req)?;
    Ok(async move {
        while let Some(r) = resp.next().await {
            // An acknowledgement is an error message without a code.
            if let NetlinkPayload::Error(e) = r.payload
                && e.code.is_some()
            {
                return Err(rtnetlink::Error::NetlinkError(e));
            }
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests;
