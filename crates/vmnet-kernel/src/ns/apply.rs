//! Applying one VM plan: create in one pass, or observe → diff → ordered changes made in place
//! (links, fixed parts, routes and rules, nft), with rollback of routes and rules. A drift
//! report runs the same steps ([`converge`] in report mode): it lists what a repair would do.

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;

use futures::future::try_join_all;
use rtnetlink::Handle;
use vmnet_plan::ns::VmPlan;
use vmnet_plan::ns::diff::{RouteOp, WantRoutes, route_ops};

use super::create::create;
use super::driver::NetlinkNsDriver;
use super::links::{configure_fixed, fixed_drift, link_fixes, repair_links};
use super::observe::{self, VmState};
use super::routes::{self, KRoute};
use super::rules;
use super::{Change, NsError, Side, inns, public, tc};
use crate::netns;

/// Creates or converges one VM (see [`super::NsDriver::apply`]).
pub(super) async fn apply(d: &NetlinkNsDriver, plan: &VmPlan) -> Result<Vec<Change>, NsError> {
    check_prefix(d, plan)?;
    d.ensure_host().await?;
    let (mut changes, old_block, (public, touched)) = if netns::exists(&plan.netns) {
        let (changes, old_block) = apply_links_routes_nft(d, plan).await?;
        (changes, old_block, public::sync(d, plan)?)
    } else {
        let (changes, public) = create_with_public(d, plan).await?;
        (changes, None, public)
    };
    changes.extend(public);
    changes.extend(d.sync_proxies(plan, &touched, old_block).await?);
    d.flush_conntrack(&touched).await;
    d.watch_netns(&plan.netns);
    Ok(changes)
}

/// Creates the VM and writes its public elements on the host meanwhile: the create's first
/// await leaves it waiting for the new netns, and the elements need nothing of the VM (a packet
/// mapped to the VM before its veth exists finds no route and is dropped). A failed create
/// takes the elements written back out.
async fn create_with_public(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
) -> Result<(Vec<Change>, PublicSync), NsError> {
    let (made, public) = tokio::join!(create(d, plan), async { public::sync(d, plan) });
    match (made, public) {
        (Ok(changes), Ok(public)) => Ok((changes, public)),
        (made, public) => {
            if public.is_ok()
                && let Err(e) = public::remove(d, plan.user_id)
            {
                tracing::error!(vm = %plan.vm_id, error = %e, "removing the public elements of a failed create failed");
            }
            Err(made.err().or(public.err()).expect("one of them failed"))
        }
    }
}

/// What [`public::sync`] returns: the change made (if any) and the addresses it touched.
type PublicSync = (Option<Change>, Vec<IpAddr>);

/// The routed public block among observed host routes (`<block> via fe80::2 dev <host veth>`).
pub(super) fn routed_block(host_routes: &BTreeSet<KRoute>) -> Option<ipnet::Ipv6Net> {
    host_routes
        .iter()
        .find_map(|r| match (r.table, r.dst, &r.kind) {
            (vmnet_plan::ns::MAIN_TABLE, ipnet::IpNet::V6(n), routes::KKind::Via { gw, .. })
                if n.prefix_len() < 128 && *gw == IpAddr::V6(vmnet_plan::ns::PEER_LINK_LOCAL) =>
            {
                Some(n)
            }
            _ => None,
        })
}

/// Links, fixed parts, routes, rules and the netns nft table; returns the changes and the
/// routed public block the VM had before (for its proxy entries).
async fn apply_links_routes_nft(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
) -> Result<(Vec<Change>, Option<ipnet::Ipv6Net>), NsError> {
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
            return Ok((changes, None));
        }
    };
    let before = observe::observe_vm(d, plan, &ns).await?;
    let mut changes = Vec::new();
    if let Err(e) = repair_and_converge(d, plan, &ns, &before, &mut changes).await {
        tracing::warn!(vm = %plan.vm_id, error = %e, "apply failed; restoring the previous routes and rules");
        if let Err(r) = restore(d, plan, &ns, &before).await {
            tracing::error!(vm = %plan.vm_id, error = %r, "restoring the previous state failed");
        }
        return Err(e);
    }
    Ok((changes, routed_block(&before.host_routes)))
}

/// Repairs the links in place (observing again when any was made or deleted: routes through a
/// re-made link are gone), then converges the rest.
async fn repair_and_converge(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
    ns: &Handle,
    before: &VmState,
    changes: &mut Vec<Change>,
) -> Result<(), NsError> {
    let fixed = repair_links(d, plan, ns, before).await?;
    if fixed.is_empty() {
        return converge(d, plan, ns, before, Mode::Repair, changes).await;
    }
    changes.extend(fixed);
    let now = observe::observe_vm(d, plan, ns).await?;
    converge(d, plan, ns, &now, Mode::Repair, changes).await
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
    let st = observe::observe_vm(d, plan, &ns).await?;
    let mut changes = Vec::new();
    if let Some(what) = d.host_drift().await? {
        changes.push(Change::Repair { what });
    }
    let fixes = link_fixes(plan, &st);
    if !fixes.is_empty() {
        // The routes depend on the links: what else differs shows once they are made.
        changes.extend(fixes.into_iter().map(|f| f.change(plan)));
        return Ok(changes);
    }
    converge(d, plan, &ns, &st, Mode::Report, &mut changes).await?;
    for what in public::drift(d, plan)? {
        changes.push(Change::Repair {
            what: format!("host: {what}"),
        });
    }
    changes.extend(d.proxy_drift(plan).await?);
    Ok(changes)
}

pub(super) fn check_prefix(d: &NetlinkNsDriver, plan: &VmPlan) -> Result<(), NsError> {
    if plan.name_prefix != d.settings.name_prefix {
        return Err(NsError::Invalid(format!(
            "vm {}: planned with name prefix {:?}, the driver manages {:?}",
            plan.vm_id, plan.name_prefix, d.settings.name_prefix
        )));
    }
    Ok(())
}

/// Whether [`converge`] makes what it finds differing or only reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Make the changes (an apply, a repair).
    Repair,
    /// Describe them (a drift report).
    Report,
}

/// Converges an existing VM whose links are as planned: fixed parts, the guest guard, routes
/// and rules, the guest's neighbour entries, nft, tc, packet activity. Each step compares once
/// and either makes its changes or, in a report, only lists them: a drift report is what a
/// repair of the same state would do.
async fn converge(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
    ns: &Handle,
    st: &VmState,
    mode: Mode,
    changes: &mut Vec<Change>,
) -> Result<(), NsError> {
    let repair = mode == Mode::Repair;
    if let Some(what) = fixed_drift(plan, st) {
        if repair {
            configure_fixed(d, plan, ns, st).await?;
            let sysctls = [plan.ns_sysctls.as_slice(), plan.tap_sysctls.as_slice()].concat();
            let name = plan.netns.clone();
            netns::run_in(&plan.netns, move || inns::write_sysctls(&name, &sysctls))??;
        }
        changes.push(Change::Repair { what });
    }
    // The guard before the table: a table that drops unmarked packets never goes in before
    // the program that marks them runs on the tap.
    changes.extend(match mode {
        Mode::Repair => super::guard::sync(d, plan, ns, &st.ns_links).await?,
        Mode::Report => super::guard::drift(d, plan, ns, &st.ns_links).await?,
    });
    let want = observe::resolve(plan, &st.ns_links, st.host_link.as_ref(), &d.host).await?;
    let steps = route_ops(&want, st.routes());
    let names = named_links(d, ns, st, &steps).await;
    if repair {
        run_route_steps(d, plan, ns, steps, &names, changes).await?;
    } else {
        for step in &steps {
            changes.extend(route_changes(step, &names));
        }
    }
    match (mode, st.ns_links.get(&plan.tap.name)) {
        (Mode::Repair, Some(tap)) => {
            // A fixed-state repair may have brought the tap up again, which flushes its
            // entries.
            let seen = if changes.iter().any(|c| matches!(c, Change::Repair { .. })) {
                super::guestneigh::observe(ns, tap.index, &plan.netns).await?
            } else {
                st.tap_neigh.clone()
            };
            changes.extend(super::guestneigh::sync(ns, plan, tap.index, &seen).await?);
        }
        (Mode::Report, _) => changes.extend(super::guestneigh::drift(plan, &st.tap_neigh)),
        (Mode::Repair, None) => {}
    }
    if !st.nft_drift.is_empty() {
        if repair {
            if st.nft_applied.as_deref() == Some(plan.nft_shape.as_str()) {
                tracing::warn!(vm = %plan.vm_id, differences = ?st.nft_drift, "nft table not as planned; replacing it");
            } else {
                // Made from another plan: the VM's config changed (or an older agent made it).
                tracing::info!(vm = %plan.vm_id, differences = ?st.nft_drift, "nft table of an earlier plan; replacing it");
            }
            super::firewall::replace_table(d, plan)?;
        }
        changes.push(Change::ReplaceNft {
            fingerprint: plan.nft_fingerprint.clone(),
            differences: st.nft_drift.clone(),
        });
    }
    let (tc_changes, counters) = tc::sync(ns, plan, &st.ns_links, !repair).await?;
    changes.extend(tc_changes);
    if repair {
        d.tc_counters.keep(plan.user_id, counters);
    }
    changes.extend(match mode {
        Mode::Repair => super::activity::sync(d, plan, ns, &st.ns_links).await?,
        Mode::Report => super::activity::drift(d, plan, ns, &st.ns_links).await?,
    });
    Ok(())
}

/// Puts back the routes and rules observed before a failed converge.
async fn restore(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
    ns: &Handle,
    before: &VmState,
) -> Result<(), NsError> {
    let now = observe::observe_vm(d, plan, ns).await?;
    let want = WantRoutes {
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

/// The changes the route operations `ops` are, with link names.
pub(super) fn route_changes(ops: &[RouteOp], names: &[HashMap<u32, String>; 2]) -> Vec<Change> {
    ops.iter()
        .map(|op| {
            let side = op.side();
            let what = op.describe(&names[usize::from(side == Side::Vm)]);
            match op {
                RouteOp::DelRule(..) => Change::DelRule(side, what),
                RouteOp::DelRoute(..) => Change::DelRoute(side, what),
                RouteOp::AddRoute { .. } => Change::AddRoute(side, what),
                RouteOp::AddRule(..) => Change::AddRule(side, what),
            }
        })
        .collect()
}

/// Makes routes and rules on both sides equal to `want` with the operations of
/// [`route_ops`], step by step; the requests of one step run concurrently.
pub(super) async fn sync_routes(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
    ns: &Handle,
    want: &WantRoutes,
    st: &VmState,
    changes: &mut Vec<Change>,
) -> Result<(), NsError> {
    let steps = route_ops(want, st.routes());
    run_route_steps(d, plan, ns, steps, &link_names(st), changes).await
}

/// Runs the route operations `steps` in order, the requests of one step concurrently.
async fn run_route_steps(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
    ns: &Handle,
    steps: Vec<Vec<RouteOp>>,
    names: &[HashMap<u32, String>; 2],
    changes: &mut Vec<Change>,
) -> Result<(), NsError> {
    for step in steps {
        changes.extend(route_changes(&step, names));
        try_join_all(step.iter().map(|op| {
            let side = op.side();
            let (h, label) = match side {
                Side::Host => (&d.host, "host"),
                Side::Vm => (ns, plan.netns.as_str()),
            };
            run_route_op(h, op, label, &names[usize::from(side == Side::Vm)])
        }))
        .await?;
    }
    Ok(())
}

/// [`link_names`], plus the name of every other link an operation of `steps` routes through
/// (another VM's host veth end, the uplink), asked of the kernel by index: only when there is
/// something to change, so that a repair names its devices. A link the kernel does not know
/// keeps its index.
async fn named_links(
    d: &NetlinkNsDriver,
    ns: &Handle,
    st: &VmState,
    steps: &[Vec<RouteOp>],
) -> [HashMap<u32, String>; 2] {
    let mut names = link_names(st);
    for op in steps.iter().flatten() {
        let (RouteOp::DelRoute(side, r) | RouteOp::AddRoute { side, route: r, .. }) = op else {
            continue;
        };
        let (routes::KKind::Dev { oif } | routes::KKind::Via { oif, .. }) = r.kind else {
            continue;
        };
        let (h, known) = match side {
            Side::Host => (&d.host, &mut names[0]),
            Side::Vm => (ns, &mut names[1]),
        };
        if !known.contains_key(&oif)
            && let Ok(Some(l)) = routes::link_by_index(h, oif).await
        {
            known.insert(oif, l.name);
        }
    }
    names
}

/// Sends one route operation over `h` (the side's handle; `label` names the side in errors).
pub(super) async fn run_route_op(
    h: &Handle,
    op: &RouteOp,
    label: &str,
    names: &HashMap<u32, String>,
) -> Result<(), NsError> {
    match op {
        RouteOp::DelRule(_, r) => rules::del_rule(h, r, label).await,
        RouteOp::DelRoute(_, r) => routes::del_route(h, r, label).await,
        RouteOp::AddRoute { route, onlink, .. } => {
            routes::add_route(h, route, *onlink, label, names).await
        }
        RouteOp::AddRule(_, r) => rules::add_rule(h, r, label).await,
    }
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
