//! Throughput limits in the kernel: each VM's HTB trees ([`vmnet_plan::ns::limits`]) written,
//! read back and repaired over rtnetlink, in-process (no `tc` process per VM or per change).
//!
//! # Design
//! - Observe: one qdisc dump per VM netns; classes and filters are dumped only on a device whose
//!   root is HTB. Everything is compared by content with the plan: the root qdisc (kind, handle,
//!   default class, direct queue length, size-table overhead), each class (rate, ceil, buffer,
//!   cbuffer, quantum; 64-bit rates included) and each u32 node (priority, protocol, handle, keys,
//!   terminal flag, classid).
//! - Repair in place, in an order that never leaves a class without its filter's target: classes
//!   created or changed first, then stale filters deleted and missing or wrong ones written, then
//!   classes nobody planned deleted. A limit change is therefore one class change per device: the
//!   class keeps its queue, no moment is unlimited or cut off. A root qdisc that is not the
//!   planned one is replaced with the whole tree (the only step with a moment unshaped).
//! - No limit in force: an HTB root with our handle is deleted (the device returns to the kernel's
//!   default qdisc). Deleting the VM deletes its netns and with it every tc object of the VM
//!   (they all live on the tap and the VM veth end).
//!
//! # Limitations
//! - u32 keeps a node's selector when the node is replaced, so a node with wrong keys is deleted
//!   and written again (a moment where those packets take the unshaped default).
//! - Each device's class and filter dumps are separate requests; a VM with limits costs three
//!   dumps per device on every reconcile pass.

mod kept;
mod wire;

pub(crate) use kept::KeptCounters;

use std::collections::{BTreeSet, HashMap};

use futures::TryStreamExt;
use futures::future::try_join_all;
use rtnetlink::Handle;
use rtnetlink::packet_route::RouteNetlinkMessage;
use serde::Serialize;
use vmnet_plan::ns::VmPlan;
use vmnet_plan::ns::limits::{Direction, HtbClass, ROOT_HANDLE, TcTree, TrafficClass};

use super::routes::{KLink, nl};
use super::{Change, NsError};
use wire::{KClass, KFilter, KQdisc, TC_H_ROOT, Write};

/// What one device's tc state looks like.
#[derive(Debug, Default)]
struct DevState {
    root: Option<KQdisc>,
    classes: Vec<KClass>,
    filters: Vec<KFilter>,
}

/// One step towards the plan on one device.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Fix {
    /// Delete the root qdisc (ours not wanted, or not the planned one).
    DelRoot,
    /// Create the HTB root qdisc.
    AddRoot,
    /// Create or change the tree's class `i`.
    SetClass(usize),
    /// Delete one filter node (`handle` ≠ 0) or a whole classifier.
    DelFilter {
        prio: u16,
        protocol: u16,
        handle: u32,
    },
    /// Create the tree's filter `i` (`None`), or replace the node with this full handle.
    SetFilter(usize, Option<u32>),
    /// Delete a class nobody planned.
    DelClass(u32),
}

/// Per class and direction: the limit and the class's counters (`GET /v1/vms/{id}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LimitCounters {
    /// Which traffic.
    pub class: TrafficClass,
    /// Which way, seen from the VM.
    pub direction: Direction,
    /// The configured limit, MiB/s (0 = unlimited).
    pub limit_mibps: u32,
    /// Whether the limit is in force.
    pub applied: bool,
    /// Bytes of IP packets sent through the class.
    pub bytes: u64,
    /// Packets sent through the class.
    pub packets: u64,
    /// Packets dropped by the class (its queue was full).
    pub drops: u64,
}

fn mibps(rate: u64) -> String {
    if rate >= vmnet_plan::ns::limits::UNLIMITED_BYTES_PER_SEC {
        "unlimited".into()
    } else {
        format!("{:.2} MiB/s", rate as f64 / 1_048_576.0)
    }
}

/// The node part of a u32 handle.
fn node(handle: u32) -> u32 {
    handle & 0xfff
}

fn class_ok(k: &KClass, c: &HtbClass) -> bool {
    let b = wire::ticks(c.burst, c.rate);
    k.kind == "htb"
        && k.rate == c.rate
        && k.ceil == c.rate
        && k.buffer == b
        && k.cbuffer == b
        && k.quantum == c.quantum
}

fn root_ok(q: &KQdisc, t: &TcTree) -> bool {
    q.kind == "htb"
        && q.handle == t.handle
        && q.defcls == Some(t.default_minor)
        && q.direct_qlen == Some(t.direct_qlen)
        && q.overhead == Some(t.overhead)
}

/// The steps from `st` to `tree` (`None`: no limits on this device), each with a description.
fn diff(tree: Option<&TcTree>, st: &DevState) -> Vec<(Fix, String)> {
    let mut out = Vec::new();
    let root_htb = st.root.as_ref().filter(|q| q.kind == "htb");
    let Some(t) = tree else {
        if let Some(q) = root_htb.filter(|q| q.handle == ROOT_HANDLE) {
            out.push((
                Fix::DelRoot,
                format!("remove limits (htb {:x}:)", q.handle >> 16),
            ));
        }
        return out;
    };
    if !st.root.as_ref().is_some_and(|q| root_ok(q, t)) {
        if root_htb.is_some() {
            out.push((Fix::DelRoot, format!("replace root qdisc {:?}", st.root)));
        }
        out.push((Fix::AddRoot, "add htb root 1: (default: unshaped)".into()));
        for (i, c) in t.classes.iter().enumerate() {
            out.push((
                Fix::SetClass(i),
                format!("add class {:?} at {}", c.class, mibps(c.rate)),
            ));
        }
        for i in 0..t.filters.len() {
            out.push((Fix::SetFilter(i, None), String::new()));
        }
        return out;
    }
    for (i, c) in t.classes.iter().enumerate() {
        match st.classes.iter().find(|k| k.classid == c.classid) {
            None => out.push((
                Fix::SetClass(i),
                format!("add class {:?} at {}", c.class, mibps(c.rate)),
            )),
            Some(k) if !class_ok(k, c) => out.push((
                Fix::SetClass(i),
                format!(
                    "change class {:?} {} -> {}",
                    c.class,
                    mibps(k.rate),
                    mibps(c.rate)
                ),
            )),
            Some(_) => {}
        }
    }
    let ours: BTreeSet<(u16, u16)> = t.filters.iter().map(|f| (f.prio, f.protocol)).collect();
    let mut dels = BTreeSet::new();
    let mut sets = Vec::new();
    for k in &st.filters {
        let whole = k.kind != "u32" || !ours.contains(&(k.prio, k.protocol));
        let planned = t
            .filters
            .iter()
            .any(|f| (f.prio, f.protocol, f.handle) == (k.prio, k.protocol, node(k.handle)));
        if whole {
            dels.insert((k.prio, k.protocol, 0));
        } else if !planned {
            dels.insert((k.prio, k.protocol, k.handle));
        }
    }
    for (i, f) in t.filters.iter().enumerate() {
        let have = st.filters.iter().find(|k| {
            k.kind == "u32"
                && (k.prio, k.protocol, node(k.handle)) == (f.prio, f.protocol, f.handle)
        });
        match have {
            None => sets.push((
                i,
                None,
                format!("add filter {} -> {:x}", f.prefix, f.classid),
            )),
            Some(k) if k.keys != f.keys || !k.terminal => {
                dels.insert((f.prio, f.protocol, k.handle));
                sets.push((
                    i,
                    None,
                    format!("rewrite filter {} (keys differ)", f.prefix),
                ));
            }
            Some(k) if k.classid != Some(f.classid) => sets.push((
                i,
                Some(k.handle),
                format!(
                    "filter {} -> {:x} (was {:?})",
                    f.prefix, f.classid, k.classid
                ),
            )),
            Some(_) => {}
        }
    }
    for (prio, protocol, handle) in dels {
        out.push((
            Fix::DelFilter {
                prio,
                protocol,
                handle,
            },
            format!("delete filter prio {prio} protocol {protocol:#06x} handle {handle:x}"),
        ));
    }
    out.extend(sets.into_iter().map(|(i, h, w)| (Fix::SetFilter(i, h), w)));
    for k in &st.classes {
        if !t.classes.iter().any(|c| c.classid == k.classid) {
            out.push((
                Fix::DelClass(k.classid),
                format!("delete class {:x}", k.classid),
            ));
        }
    }
    out
}

/// Dumps the root qdiscs of the netns, by ifindex.
async fn roots(h: &Handle) -> Result<HashMap<u32, KQdisc>, NsError> {
    let msgs: Vec<_> = h
        .qdisc()
        .get()
        .execute()
        .try_collect()
        .await
        .map_err(nl("dump qdiscs"))?;
    Ok(msgs
        .iter()
        .filter(|m| u32::from(m.header.parent) == TC_H_ROOT)
        .map(|m| {
            (
                u32::try_from(m.header.index).unwrap_or(0),
                wire::parse_qdisc(m),
            )
        })
        .collect())
}

async fn dev_state(
    h: &Handle,
    index: u32,
    root: Option<KQdisc>,
    dev: &str,
) -> Result<DevState, NsError> {
    let mut st = DevState {
        root,
        ..DevState::default()
    };
    if st.root.as_ref().is_none_or(|q| q.kind != "htb") {
        return Ok(st);
    }
    let i = i32::try_from(index).unwrap_or(i32::MAX);
    let classes: Vec<_> = h
        .traffic_class(i)
        .get()
        .execute()
        .try_collect()
        .await
        .map_err(nl(format!("dump classes of {dev}")))?;
    st.classes = classes.iter().map(wire::parse_class).collect();
    let filters: Vec<_> = h
        .traffic_filter(i)
        .get()
        .execute()
        .try_collect()
        .await
        .map_err(nl(format!("dump filters of {dev}")))?;
    st.filters = filters.iter().filter_map(wire::parse_filter).collect();
    Ok(st)
}

/// The devices that carry trees in this VM: the tap and, with a veth pair, the VM veth end.
fn devices(plan: &VmPlan) -> Vec<&str> {
    let mut d = vec![plan.tap.name.as_str()];
    if let Some(v) = &plan.veth {
        d.push(v.peer_name.as_str());
    }
    d
}

/// Runs the steps on one device, in order.
async fn run(
    h: &Handle,
    index: u32,
    t: Option<&TcTree>,
    fixes: &[(Fix, String)],
    dev: &str,
) -> Result<(), NsError> {
    let mut pending: Vec<futures::future::BoxFuture<'_, Result<(), NsError>>> = Vec::new();
    for (fix, what) in fixes {
        let what = format!("{dev}: {what}");
        let (m, write) = match (fix, t) {
            (Fix::DelRoot, _) => {
                let mut m = rtnetlink::packet_route::tc::TcMessage::with_index(
                    i32::try_from(index).unwrap_or(i32::MAX),
                );
                m.header.parent = TC_H_ROOT.into();
                (RouteNetlinkMessage::DelQueueDiscipline(m), None)
            }
            (Fix::AddRoot, Some(t)) => (
                RouteNetlinkMessage::NewQueueDiscipline(wire::qdisc_msg(index, t)),
                Some(Write::Replace),
            ),
            (Fix::SetClass(i), Some(t)) => (
                RouteNetlinkMessage::NewTrafficClass(wire::class_msg(
                    index,
                    t.handle,
                    &t.classes[*i],
                )),
                Some(Write::CreateOrChange),
            ),
            (Fix::SetFilter(i, h), Some(t)) => (
                RouteNetlinkMessage::NewTrafficFilter(wire::filter_msg(
                    index,
                    t.handle,
                    &t.filters[*i],
                    *h,
                )),
                Some(Write::CreateOrChange),
            ),
            (
                Fix::DelFilter {
                    prio,
                    protocol,
                    handle,
                },
                _,
            ) => (
                RouteNetlinkMessage::DelTrafficFilter(wire::filter_del_msg(
                    index,
                    ROOT_HANDLE,
                    *prio,
                    *protocol,
                    *handle,
                )),
                None,
            ),
            (Fix::DelClass(c), _) => {
                let mut m = rtnetlink::packet_route::tc::TcMessage::with_index(
                    i32::try_from(index).unwrap_or(i32::MAX),
                );
                m.header.handle = (*c).into();
                m.header.parent = ROOT_HANDLE.into();
                (RouteNetlinkMessage::DelTrafficClass(m), None)
            }
            (_, None) => return Err(NsError::Invalid(format!("{what}: no tree planned"))),
        };
        // Sent now, in order: the kernel handles one socket's requests one after the other,
        // so the root exists before its classes and they before the filters, without waiting
        // for each acknowledgement.
        match wire::start(h, m, write) {
            Ok(ack) => pending.push(Box::pin(async move { ack.await.map_err(nl(what)) })),
            Err(e) => {
                try_join_all(pending).await?;
                return Err(nl(what)(e));
            }
        }
    }
    try_join_all(pending).await?;
    Ok(())
}

/// Creates the trees of a VM just made (nothing to observe: its devices have default qdiscs).
pub(super) async fn create(
    h: &Handle,
    plan: &VmPlan,
    links: &HashMap<String, KLink>,
) -> Result<(), NsError> {
    let empty = DevState::default();
    try_join_all(plan.limits.trees.iter().map(|t| {
        let fixes = diff(Some(t), &empty);
        async move {
            let index = link_index(links, &t.dev)?;
            run(h, index, Some(t), &fixes, &t.dev).await
        }
    }))
    .await?;
    Ok(())
}

fn link_index(links: &HashMap<String, KLink>, dev: &str) -> Result<u32, NsError> {
    links
        .get(dev)
        .map(|l| l.index)
        .ok_or_else(|| NsError::Missing(format!("link {dev} (for its tc limits)")))
}

/// A limit change without a full pass: writes the planned classes of every tree as in-place
/// changes, reading nothing back (the next reconcile pass compares everything). `None` when
/// this cannot do it: no tree planned, the netns, a device, the tree or a class missing (a
/// change of the tree's existence, a first limit or the last one removed); the caller then
/// converges fully.
pub(super) async fn change_classes(plan: &VmPlan) -> Result<Option<Vec<Change>>, NsError> {
    let trees = &plan.limits.trees;
    if trees.is_empty() || !crate::netns::exists(&plan.netns) {
        return Ok(None);
    }
    let h = crate::netns::netlink_in(&plan.netns)?;
    let indexes = try_join_all(trees.iter().map(|t| {
        let h = h.clone();
        async move {
            h.link()
                .get()
                .match_name(t.dev.clone())
                .execute()
                .try_next()
                .await
                .map(|m| m.map(|m| m.header.index))
        }
    }))
    .await;
    let Ok(indexes) = indexes else {
        return Ok(None);
    };
    let mut writes = Vec::new();
    let mut changes = Vec::new();
    for (t, index) in trees.iter().zip(indexes) {
        let Some(index) = index else { return Ok(None) };
        for c in &t.classes {
            let m = RouteNetlinkMessage::NewTrafficClass(wire::class_msg(index, t.handle, c));
            writes.push(wire::send(&h, m, Some(Write::Change)));
            changes.push(Change::Tc {
                dev: t.dev.clone(),
                what: format!("set class {:?} to {}", c.class, mibps(c.rate)),
            });
        }
    }
    match try_join_all(writes).await {
        Ok(_) => Ok(Some(changes)),
        Err(e) => {
            tracing::debug!(vm = %plan.vm_id, error = %e, "in-place class change not possible; converging fully");
            Ok(None)
        }
    }
}

/// Observes the VM's tc objects and, unless `dry`, makes them equal to the plan; returns the
/// changes (made, or needed when `dry`) and the counters of the classes as observed (before
/// any repair), as [`counters`] reads them.
pub(super) async fn sync(
    h: &Handle,
    plan: &VmPlan,
    links: &HashMap<String, KLink>,
    dry: bool,
) -> Result<(Vec<Change>, Vec<LimitCounters>), NsError> {
    let mut roots = roots(h).await?;
    let mut changes = Vec::new();
    let mut seen: [Vec<KClass>; 2] = [Vec::new(), Vec::new()];
    for (i, dev) in devices(plan).into_iter().enumerate() {
        let Some(index) = links.get(dev).map(|l| l.index) else {
            continue; // the link repair makes it; the next pass shapes it
        };
        let tree = plan.limits.trees.iter().find(|t| t.dev == dev);
        let st = dev_state(h, index, roots.remove(&index), dev).await?;
        let fixes = diff(tree, &st);
        if tree.is_some() {
            seen[i].clone_from(&st.classes);
        }
        if fixes.is_empty() {
            continue;
        }
        if !dry {
            run(h, index, tree, &fixes, dev).await?;
        }
        changes.extend(
            fixes
                .into_iter()
                .filter(|(_, w)| !w.is_empty())
                .map(|(_, what)| Change::Tc {
                    dev: dev.to_owned(),
                    what,
                }),
        );
    }
    Ok((changes, rows(plan, &seen)))
}

/// The counters of each planned class (download then upload, private then public) of a VM;
/// classes without a tree report zero counters, a VM without a netns nothing.
pub(super) async fn counters(plan: &VmPlan) -> Result<Vec<LimitCounters>, NsError> {
    if !crate::netns::exists(&plan.netns) {
        return Ok(Vec::new());
    }
    let h = crate::netns::netlink_in(&plan.netns)?;
    let mut links = HashMap::new();
    for dev in devices(plan) {
        let found = h
            .link()
            .get()
            .match_name(dev.to_owned())
            .execute()
            .try_next()
            .await;
        if let Ok(Some(m)) = found {
            links.insert(dev.to_owned(), m.header.index);
        }
    }
    let mut seen: [Vec<KClass>; 2] = [Vec::new(), Vec::new()];
    for (i, dev) in devices(plan).into_iter().enumerate() {
        if plan.limits.trees.iter().any(|t| t.dev == dev)
            && let Some(index) = links.get(dev).copied()
        {
            seen[i] = dev_state(
                &h,
                index,
                Some(KQdisc {
                    kind: "htb".into(),
                    handle: ROOT_HANDLE,
                    defcls: None,
                    direct_qlen: None,
                    overhead: None,
                }),
                dev,
            )
            .await?
            .classes;
        }
    }
    Ok(rows(plan, &seen))
}

/// The counter rows of `plan` (download then upload, private then public) from the classes
/// seen on its two devices (the tap: download; the VM veth end: upload).
fn rows(plan: &VmPlan, seen: &[Vec<KClass>; 2]) -> Vec<LimitCounters> {
    let l = &plan.limits;
    let mut out = Vec::with_capacity(4);
    let devs = devices(plan).len();
    for (have, direction) in seen
        .iter()
        .take(devs)
        .zip([Direction::Download, Direction::Upload])
    {
        for (class, limit) in [
            (TrafficClass::Private, l.private_mibps),
            (TrafficClass::Public, l.public_mibps),
        ] {
            let applied = l
                .trees
                .iter()
                .flat_map(|t| &t.classes)
                .any(|c| c.class == class && c.applied);
            let s = have
                .iter()
                .find(|k| k.classid == class.classid())
                .map(|k| k.stats)
                .unwrap_or_default();
            out.push(LimitCounters {
                class,
                direction,
                limit_mibps: limit,
                applied,
                bytes: s.bytes,
                packets: s.packets,
                drops: s.drops,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests;
