//! Applying one VM plan: create in one pass, or observe → diff → ordered changes, with rollback.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::IpAddr;
use std::os::fd::AsRawFd;

use futures::future::try_join_all;
use netlink_packet_route::address::{AddressAttribute, AddressFlags, AddressHeaderFlags};
use netlink_packet_route::link::{InfoData, InfoVeth};
use rtnetlink::{Handle, LinkUnspec, LinkVeth};
use vmnet_plan::ns::VmPlan;

use super::driver::NetlinkNsDriver;
use super::observe::{self, Desired, KAddr, VmState};
use super::routes::{self, KLink, KRoute, KRule, nl};
use super::{Change, NsError, Side, inns};
use crate::netns;

/// Creates or converges one VM (see [`super::NsDriver::apply`]).
pub(super) async fn apply(d: &NetlinkNsDriver, plan: &VmPlan) -> Result<Vec<Change>, NsError> {
    check_prefix(d, plan)?;
    d.ensure_host().await?;
    if !netns::exists(&plan.netns) {
        return create(d, plan).await;
    }
    let ns = match netns::netlink_in(&plan.netns) {
        Ok(ns) => ns,
        Err(e) => {
            // E.g. the mount point of a create interrupted by a crash: not a namespace yet.
            tracing::warn!(vm = %plan.vm_id, error = %e, "netns unusable; recreating the VM");
            d.remove_uid(plan.user_id).await?;
            let mut changes = vec![Change::Repair {
                what: format!("{}: unusable netns ({e})", plan.netns),
            }];
            changes.extend(create(d, plan).await?);
            return Ok(changes);
        }
    };
    let before = observe::observe_vm(plan, &ns, &d.host).await?;
    if needs_rebuild(plan, &before) {
        let mut changes = vec![Change::Repair {
            what: format!("{}: missing links, rebuilding", plan.netns),
        }];
        d.remove_uid(plan.user_id).await?;
        changes.extend(create(d, plan).await?);
        return Ok(changes);
    }
    let mut changes = Vec::new();
    if let Err(e) = converge(d, plan, &ns, &before, &mut changes).await {
        tracing::warn!(vm = %plan.vm_id, error = %e, "apply failed; restoring the previous routes and rules");
        if let Err(r) = restore(d, plan, &ns, &before).await {
            tracing::error!(vm = %plan.vm_id, error = %r, "restoring the previous state failed");
        }
        return Err(e);
    }
    Ok(changes)
}

/// The changes [`apply`] would make, without making them.
pub(super) async fn drift(d: &NetlinkNsDriver, plan: &VmPlan) -> Result<Vec<Change>, NsError> {
    check_prefix(d, plan)?;
    if !netns::exists(&plan.netns) {
        return Ok(vec![Change::CreateVm {
            netns: plan.netns.clone(),
        }]);
    }
    let Ok(ns) = netns::netlink_in(&plan.netns) else {
        return Ok(vec![Change::Repair {
            what: format!("{}: unusable netns", plan.netns),
        }]);
    };
    let st = observe::observe_vm(plan, &ns, &d.host).await?;
    if needs_rebuild(plan, &st) {
        return Ok(vec![Change::Repair {
            what: format!("{}: missing links, rebuilding", plan.netns),
        }]);
    }
    let mut changes = Vec::new();
    if let Some(what) = d.host_drift().await? {
        changes.push(Change::Repair { what });
    }
    if let Some(what) = fixed_drift(plan, &st) {
        changes.push(Change::Repair { what });
    }
    let want = observe::resolve(plan, &st.ns_links, st.host_link.as_ref(), &d.host).await?;
    route_changes(&want, &st, &mut changes);
    if st.nft_fp.as_deref() != Some(plan.nft_fingerprint.as_str()) {
        changes.push(Change::ReplaceNft {
            fingerprint: plan.nft_fingerprint.clone(),
        });
    }
    Ok(changes)
}

fn check_prefix(d: &NetlinkNsDriver, plan: &VmPlan) -> Result<(), NsError> {
    if plan.name_prefix != d.settings.name_prefix {
        return Err(NsError::Invalid(format!(
            "vm {}: planned with name prefix {:?}, the driver manages {:?}",
            plan.vm_id, plan.name_prefix, d.settings.name_prefix
        )));
    }
    Ok(())
}

fn needs_rebuild(plan: &VmPlan, st: &VmState) -> bool {
    let tap = st.ns_links.contains_key(&plan.tap.name);
    let veth_ok = match &plan.veth {
        Some(v) => st.host_link.is_some() && st.ns_links.contains_key(&v.peer_name),
        None => st.host_link.is_none(),
    };
    !tap || !veth_ok
}

/// The fixed per-VM state that is wrong (MTU, up, addresses, sysctls), if any.
fn fixed_drift(plan: &VmPlan, st: &VmState) -> Option<String> {
    let mut bad = Vec::new();
    let mut check = |links: &HashMap<String, KLink>,
                     addrs: &HashSet<KAddr>,
                     name: &str,
                     mtu: u32,
                     want: &[(IpAddr, u8)]| {
        match links.get(name) {
            Some(l) if l.mtu == mtu && l.up => {
                if want
                    .iter()
                    .any(|(a, p)| !addrs.contains(&(l.index, *a, *p)))
                {
                    bad.push(format!("{name} addresses"));
                }
            }
            _ => bad.push(format!("{name} mtu/up")),
        }
    };
    let tap_addrs = [
        (IpAddr::V4(plan.tap.ipv4.addr()), plan.tap.ipv4.prefix_len()),
        (
            IpAddr::V6(plan.tap.ipv6_link_local.addr()),
            plan.tap.ipv6_link_local.prefix_len(),
        ),
    ];
    check(
        &st.ns_links,
        &st.ns_addrs,
        &plan.tap.name,
        plan.tap.mtu,
        &tap_addrs,
    );
    if let Some(v) = &plan.veth {
        let peer = [
            (IpAddr::V4(v.peer_ipv4.addr()), v.peer_ipv4.prefix_len()),
            (
                IpAddr::V6(v.peer_ipv6_link_local.addr()),
                v.peer_ipv6_link_local.prefix_len(),
            ),
        ];
        check(&st.ns_links, &st.ns_addrs, &v.peer_name, v.mtu, &peer);
        let host = [
            (IpAddr::V4(v.host_ipv4.addr()), v.host_ipv4.prefix_len()),
            (
                IpAddr::V6(v.host_ipv6_link_local.addr()),
                v.host_ipv6_link_local.prefix_len(),
            ),
        ];
        let hl: HashMap<String, KLink> = st
            .host_link
            .iter()
            .map(|l| (l.name.clone(), l.clone()))
            .collect();
        check(&hl, &st.host_addrs, &v.host_name, v.mtu, &host);
    }
    if !st.ns_links.get("lo").is_some_and(|l| l.up) {
        bad.push("lo up".into());
    }
    if !st.sysctls_bad.is_empty() {
        bad.push(format!("sysctls {}", st.sysctls_bad.join(", ")));
    }
    (!bad.is_empty()).then(|| format!("{}: {}", plan.netns, bad.join("; ")))
}

/// The ifindex both veth ends are created with (`IFINDEX_BASE + uid`, on the host and in the VM
/// netns), so configuring them needs no lookup; if the host has that index in use already the
/// kernel picks one and the driver looks it up.
const IFINDEX_BASE: u32 = 0x3000_0000;

/// Creates the VM in one pass; on failure removes whatever was made.
async fn create(d: &NetlinkNsDriver, plan: &VmPlan) -> Result<Vec<Change>, NsError> {
    match create_inner(d, plan).await {
        Ok(c) => Ok(c),
        Err(e) => {
            if let Err(r) = d.remove_uid(plan.user_id).await {
                tracing::error!(vm = %plan.vm_id, error = %r, "rolling back a failed create failed");
            }
            Err(e)
        }
    }
}

async fn create_inner(d: &NetlinkNsDriver, plan: &VmPlan) -> Result<Vec<Change>, NsError> {
    let rt = tokio::runtime::Handle::current();
    // One thread creates the netns and, inside it, the tap, sysctls, nft table and a netlink
    // socket. As soon as the namespace is mounted, the veth pair is created from the host side
    // concurrently with the rest of that thread's work.
    let (mounted_tx, mounted_rx) = tokio::sync::oneshot::channel::<()>();
    let p = plan.clone();
    let work = tokio::task::spawn_blocking(move || {
        netns::create_and_run(&p.netns, || -> Result<(Handle, u32), NsError> {
            let _ = mounted_tx.send(());
            in_new_netns(&p, &rt)
        })
    });
    let veth = async {
        let Some(v) = &plan.veth else { return Ok(None) };
        if mounted_rx.await.is_err() {
            return Ok(None); // the thread failed before mounting; its error is reported below
        }
        let fd = netns::open(&plan.netns)?;
        let index = IFINDEX_BASE + plan.user_id;
        let add = |with_index: bool| {
            let mut peer = LinkUnspec::new_with_name(&v.peer_name)
                .mtu(v.mtu)
                .setns_by_fd(fd.as_raw_fd());
            let mut host = LinkVeth::new(&v.host_name, &v.peer_name).mtu(v.mtu).up();
            if with_index {
                peer = peer.index(index);
                host = host.index(index);
            }
            let msg = host
                .set_info_data(InfoData::Veth(InfoVeth::Peer(peer.build())))
                .build();
            d.host.link().add(msg).execute()
        };
        let what = || format!("host: add veth {}/{}", v.host_name, v.peer_name);
        match add(true).await {
            Ok(()) => Ok(Some(index)),
            // The derived ifindex may be taken on the host: let the kernel pick one (a taken
            // name fails again and is reported).
            Err(e) if matches!(routes::errno(&e), Some(libc::EBUSY | libc::EEXIST)) => {
                add(false).await.map(|()| None).map_err(nl(what()))
            }
            Err(e) => Err(nl(what())(e)),
        }
    };
    let (veth, work) = tokio::join!(veth, work);
    let (ns, tap_index) =
        work.map_err(|_| NsError::Netns(netns::NetnsError::ThreadPanicked(plan.netns.clone())))???;
    let veth_index = veth?;
    // What was just made, so configuring it needs no read-back.
    let mut st = VmState::default();
    let known = |name: &str, index, mtu| KLink {
        index,
        name: name.to_owned(),
        mtu,
        up: true,
    };
    st.ns_links.insert("lo".into(), known("lo", 1, 65536));
    st.ns_links.insert(
        plan.tap.name.clone(),
        known(&plan.tap.name, tap_index, plan.tap.mtu),
    );
    if let (Some(v), Some(index)) = (&plan.veth, veth_index) {
        st.host_link = Some(known(&v.host_name, index, v.mtu));
        let peer = KLink {
            up: false,
            ..known(&v.peer_name, index, v.mtu)
        };
        st.ns_links.insert(v.peer_name.clone(), peer);
    }
    let (links, host_link) = configure_fixed(d, plan, &ns, &st).await?;
    let want = observe::resolve(plan, &links, host_link.as_ref(), &d.host).await?;
    let mut ignored = Vec::new();
    sync_routes(d, plan, &ns, &want, &st, &mut ignored).await?;
    Ok(vec![Change::CreateVm {
        netns: plan.netns.clone(),
    }])
}

/// The work on the thread that just created the VM's netns: tap (persistent, owner, MTU, up),
/// lo up, sysctls, the nft table (one transaction) and a netlink socket bound to the netns.
/// Returns the socket's handle and the tap's ifindex.
fn in_new_netns(plan: &VmPlan, rt: &tokio::runtime::Handle) -> Result<(Handle, u32), NsError> {
    let tap_err = |op| {
        let name = plan.tap.name.clone();
        move |source| NsError::Tap { name, op, source }
    };
    inns::create_tap(&plan.tap)?;
    let tap_index =
        inns::link_up(&plan.tap.name, Some(plan.tap.mtu)).map_err(tap_err("set mtu/up"))?;
    inns::link_up("lo", None).map_err(tap_err("set lo up"))?;
    inns::write_sysctls(&plan.netns, &plan.ns_sysctls)?;
    // A fresh netns has no table yet: skip the replace prologue (a delete makes closing the nft
    // socket slow), keep the rest of the one transaction.
    inns::run_nft(&plan.netns, &without_replace_prologue(&plan.nft))?;
    let _guard = rt.enter();
    let (conn, h, _) = rtnetlink::new_connection().map_err(|source| {
        NsError::Netns(netns::NetnsError::Io {
            name: plan.netns.clone(),
            op: "open rtnetlink socket",
            source,
        })
    })?;
    rt.spawn(conn);
    Ok((h, tap_index))
}

/// The transaction without its leading `add table` + `delete table` pair.
fn without_replace_prologue(nft: &serde_json::Value) -> serde_json::Value {
    let mut v = nft.clone();
    if let Some(cmds) = v["nftables"].as_array_mut()
        && cmds.len() > 2
        && cmds[1].get("delete").is_some()
    {
        cmds.drain(..2);
    }
    v
}

/// Brings lo, the tap and the veth ends to the planned MTU, up and addresses (idempotent).
/// The three links are configured concurrently (independent netlink requests). Returns the
/// netns links by name.
async fn configure_fixed(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
    ns: &Handle,
    st: &VmState,
) -> Result<(HashMap<String, KLink>, Option<KLink>), NsError> {
    let w = plan.netns.as_str();
    let lo = async {
        if st.ns_links.get("lo").is_some_and(|l| l.up) {
            return Ok(());
        }
        ns.link()
            .set(LinkUnspec::new_with_index(1).up().build())
            .execute()
            .await
            .map_err(nl(format!("{w}: set lo up")))
    };
    let tap_addrs = [
        (IpAddr::V4(plan.tap.ipv4.addr()), plan.tap.ipv4.prefix_len()),
        (IpAddr::V6(plan.tap.ipv6_link_local.addr()), 64),
    ];
    let tap = ensure_link(
        ns,
        &plan.tap.name,
        st.ns_links.get(&plan.tap.name),
        plan.tap.mtu,
        &st.ns_addrs,
        tap_addrs,
        w,
    );
    let veth = async {
        let Some(v) = &plan.veth else {
            return Ok(None);
        };
        let peer_addrs = [
            (IpAddr::V4(v.peer_ipv4.addr()), 30),
            (IpAddr::V6(v.peer_ipv6_link_local.addr()), 64),
        ];
        let host_addrs = [
            (IpAddr::V4(v.host_ipv4.addr()), 30),
            (IpAddr::V6(v.host_ipv6_link_local.addr()), 64),
        ];
        let (peer, host) = futures::try_join!(
            ensure_link(
                ns,
                &v.peer_name,
                st.ns_links.get(&v.peer_name),
                v.mtu,
                &st.ns_addrs,
                peer_addrs,
                w
            ),
            ensure_link(
                &d.host,
                &v.host_name,
                st.host_link.as_ref(),
                v.mtu,
                &st.host_addrs,
                host_addrs,
                "host"
            ),
        )?;
        Ok(Some((peer, host)))
    };
    let ((), tap, peer) = futures::try_join!(lo, tap, veth)?;
    let mut links = HashMap::from([(tap.name.clone(), tap)]);
    let host = peer.map(|(p, h)| {
        links.insert(p.name.clone(), p);
        h
    });
    Ok((links, host))
}

/// Makes link `name` have `mtu`, be up and carry `addrs`; returns it.
async fn ensure_link(
    h: &Handle,
    name: &str,
    known: Option<&KLink>,
    mtu: u32,
    have: &HashSet<KAddr>,
    addrs: [(IpAddr, u8); 2],
    w: &str,
) -> Result<KLink, NsError> {
    let mut l = match known {
        Some(l) => l.clone(),
        None => routes::link_by_name(h, name)
            .await?
            .ok_or_else(|| NsError::Missing(format!("{w}: link {name} is missing")))?,
    };
    if l.mtu != mtu || !l.up {
        h.link()
            .set(LinkUnspec::new_with_index(l.index).mtu(mtu).up().build())
            .execute()
            .await
            .map_err(nl(format!("{w}: set {name} mtu/up")))?;
        l.mtu = mtu;
        l.up = true;
    }
    let [(a1, p1), (a2, p2)] = addrs;
    futures::try_join!(
        add_addr(h, have, l.index, a1, p1, w),
        add_addr(h, have, l.index, a2, p2, w),
    )?;
    Ok(l)
}

/// Adds an address unless `have` lists it (IPv6 without duplicate address detection, so it is
/// usable at once).
async fn add_addr(
    h: &Handle,
    have: &HashSet<KAddr>,
    index: u32,
    ip: IpAddr,
    plen: u8,
    w: &str,
) -> Result<(), NsError> {
    if have.contains(&(index, ip, plen)) {
        return Ok(());
    }
    let mut req = h.address().add(index, ip, plen).replace();
    if ip.is_ipv6() {
        let m = req.message_mut();
        m.header.flags = AddressHeaderFlags::Nodad;
        m.attributes
            .retain(|a| !matches!(a, AddressAttribute::Flags(_)));
        m.attributes
            .push(AddressAttribute::Flags(AddressFlags::Nodad));
    }
    req.execute()
        .await
        .map_err(nl(format!("{w}: add address {ip}/{plen} on #{index}")))
}

/// Converges an existing VM: fixed parts, routes and rules, then nft.
async fn converge(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
    ns: &Handle,
    st: &VmState,
    changes: &mut Vec<Change>,
) -> Result<(), NsError> {
    if let Some(what) = fixed_drift(plan, st) {
        configure_fixed(d, plan, ns, st).await?;
        let sysctls = plan.ns_sysctls.clone();
        let name = plan.netns.clone();
        netns::run_in(&plan.netns, move || inns::write_sysctls(&name, &sysctls))??;
        changes.push(Change::Repair { what });
    }
    let want = observe::resolve(plan, &st.ns_links, st.host_link.as_ref(), &d.host).await?;
    sync_routes(d, plan, ns, &want, st, changes).await?;
    if st.nft_fp.as_deref() != Some(plan.nft_fingerprint.as_str()) {
        let nft = plan.nft.clone();
        let name = plan.netns.clone();
        netns::run_in(&plan.netns, move || inns::run_nft(&name, &nft))??;
        changes.push(Change::ReplaceNft {
            fingerprint: plan.nft_fingerprint.clone(),
        });
    }
    Ok(())
}

/// Puts back the routes and rules observed before a failed converge.
async fn restore(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
    ns: &Handle,
    before: &VmState,
) -> Result<(), NsError> {
    let now = observe::observe_vm(plan, ns, &d.host).await?;
    let want = Desired {
        ns_routes: before
            .ns_routes
            .iter()
            .map(|r| (r.clone(), onlink_guess(r)))
            .collect(),
        ns_rules: before.ns_rules.clone(),
        host_routes: before
            .host_routes
            .iter()
            .map(|r| (r.clone(), false))
            .collect(),
        host_rules: before.host_rules.clone(),
    };
    let mut ignored = Vec::new();
    sync_routes(d, plan, ns, &want, &now, &mut ignored).await
}

/// Routes to the guest's mesh address via the tap were added on-link; keep that on restore.
/// Any mesh gateway in the inbound table counts, not only the plan's: after a failed change of
/// the mesh address, the route to restore is via the old one.
fn onlink_guess(r: &KRoute) -> bool {
    r.table == vmnet_plan::ns::names::NS_INBOUND_TABLE
        && matches!(r.kind, routes::KKind::Via { gw: IpAddr::V6(g), .. } if vmnet_model::vm::MESH_RANGE.contains(&g))
}

fn route_changes(want: &Desired, st: &VmState, out: &mut Vec<Change>) {
    for (side, w, have) in [
        (Side::Host, &want.host_routes, &st.host_routes),
        (Side::Vm, &want.ns_routes, &st.ns_routes),
    ] {
        for r in have.iter().filter(|r| !w.contains_key(*r)) {
            out.push(Change::DelRoute(side, r.to_string()));
        }
        for r in w.keys().filter(|r| !have.contains(*r)) {
            out.push(Change::AddRoute(side, r.to_string()));
        }
    }
    for (side, w, have) in [
        (Side::Host, &want.host_rules, &st.host_rules),
        (Side::Vm, &want.ns_rules, &st.ns_rules),
    ] {
        for r in have.difference(w) {
            out.push(Change::DelRule(side, r.to_string()));
        }
        for r in w.difference(have) {
            out.push(Change::AddRule(side, r.to_string()));
        }
    }
}

type RouteSide<'a> = (
    Side,
    &'a Handle,
    &'a BTreeMap<KRoute, bool>,
    &'a BTreeSet<KRoute>,
    &'a str,
);
type RuleSide<'a> = (
    Side,
    &'a Handle,
    &'a BTreeSet<KRule>,
    &'a BTreeSet<KRule>,
    &'a str,
);

/// Makes routes and rules on both sides equal to `want`: stale ones deleted first (so a changed
/// destination never has two routes), then missing ones added, rules last.
async fn sync_routes(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
    ns: &Handle,
    want: &Desired,
    st: &VmState,
    changes: &mut Vec<Change>,
) -> Result<(), NsError> {
    let w = plan.netns.as_str();
    let route_sides: [RouteSide<'_>; 2] = [
        (
            Side::Host,
            &d.host,
            &want.host_routes,
            &st.host_routes,
            "host",
        ),
        (Side::Vm, ns, &want.ns_routes, &st.ns_routes, w),
    ];
    let rule_sides: [RuleSide<'_>; 2] = [
        (Side::Vm, ns, &want.ns_rules, &st.ns_rules, w),
        (
            Side::Host,
            &d.host,
            &want.host_rules,
            &st.host_rules,
            "host",
        ),
    ];
    // Order: stale rules, stale routes, missing routes, missing rules — so no rule ever selects a
    // half-filled table. Within a step the requests are independent and run concurrently.
    let names = link_names(st);
    let mut steps: Vec<futures::future::BoxFuture<'_, Result<(), NsError>>> = Vec::new();
    for (side, h, wr, have, label) in rule_sides {
        for r in have.difference(wr) {
            changes.push(Change::DelRule(side, r.to_string()));
            steps.push(Box::pin(routes::del_rule(h, r, label)));
        }
    }
    try_join_all(steps.drain(..)).await?;
    for (side, h, wr, have, label) in route_sides {
        for r in have.iter().filter(|r| !wr.contains_key(*r)) {
            changes.push(Change::DelRoute(side, r.to_string()));
            steps.push(Box::pin(routes::del_route(h, r, label)));
        }
    }
    try_join_all(steps.drain(..)).await?;
    // Missing routes in two steps: on-link next hops last. The kernel checks an on-link gateway
    // against the main table: `::/0 table 100 via <mesh> dev <tap> onlink` is refused (EINVAL,
    // "device mismatch") while the main table routes the mesh address elsewhere (`fdaa::/16 via
    // … dev <peer>`), i.e. until `<mesh>/128 dev <tap>` exists. A changed mesh address adds both.
    for onlink_step in [false, true] {
        for (side, h, wr, have, label) in route_sides {
            let names = &names[usize::from(side == Side::Vm)];
            for (r, onlink) in wr
                .iter()
                .filter(|(r, o)| **o == onlink_step && !have.contains(*r))
            {
                changes.push(Change::AddRoute(side, r.to_string()));
                steps.push(Box::pin(routes::add_route(h, r, *onlink, label, names)));
            }
        }
        try_join_all(steps.drain(..)).await?;
    }
    for (side, h, wr, have, label) in rule_sides {
        for r in wr.difference(have) {
            changes.push(Change::AddRule(side, r.to_string()));
            steps.push(Box::pin(routes::add_rule(h, r, label)));
        }
    }
    try_join_all(steps).await?;
    Ok(())
}

/// Link names by ifindex, for error messages: `[host, VM netns]`.
fn link_names(st: &VmState) -> [HashMap<u32, String>; 2] {
    let host = st
        .host_link
        .iter()
        .map(|l| (l.index, l.name.clone()))
        .collect();
    let ns = st
        .ns_links
        .values()
        .map(|l| (l.index, l.name.clone()))
        .collect();
    [host, ns]
}

#[cfg(test)]
#[path = "apply_tests.rs"]
mod tests;
