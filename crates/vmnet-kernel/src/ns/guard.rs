//! The VM's guest guard ([`vmnet_plan::ns::guard`]) through the driver's
//! [`GuestGuard`](crate::guard::GuestGuard): registered and attached to the tap at create (on
//! the thread that makes the tap, inside the new netns), read back and repaired on every apply,
//! reported by drift, forgotten on remove. A tap whose filter runs another program before this
//! agent attached its own there (an earlier agent's guard) gets this one swapped in, and its
//! entry written in this agent's (empty) maps: [`Change::Upgrade`], configure on start, not
//! drift.

use std::collections::HashMap;
use std::sync::Arc;

use rtnetlink::Handle;
use vmnet_plan::ns::VmPlan;
use vmnet_plan::ns::guard::GuardPlan;

use super::driver::NetlinkNsDriver;
use super::routes::KLink;
use super::{Change, NsError};
use crate::guard::{
    FILTER_HANDLE, FILTER_PRIORITY, GuardEntry, GuestGuard, netns_inode, netns_inode_here,
};
use crate::netns;

pub(super) fn guard<'a>(
    d: &'a NetlinkNsDriver,
    plan: &'a VmPlan,
) -> Result<Option<(&'a Arc<GuestGuard>, &'a GuardPlan)>, NsError> {
    let Some(g) = &plan.guard else {
        return Ok(None);
    };
    match &d.guard {
        Some(loaded) => Ok(Some((loaded, g))),
        None => Err(NsError::Invalid(format!(
            "vm {}: planned with the guest guard, but the driver has no guard program loaded",
            plan.vm_id
        ))),
    }
}

/// A new VM, on the thread that just made its tap inside its netns `netns`: its entry (with
/// counters from zero), then the filter on the tap.
pub(super) fn register_here(
    guard: &GuestGuard,
    netns: &str,
    plan: &GuardPlan,
) -> Result<(), NsError> {
    guard.register(netns_inode_here(netns)?, plan, true)?;
    guard.attach_here(&plan.tap)?;
    guard.attached(plan.user_id);
    Ok(())
}

/// One step towards the planned guard state.
enum Fix {
    /// The entry is missing or not the plan's; `upgrade` when it is missing on a tap whose
    /// filter runs an earlier agent's program (this agent's maps start empty: registering the
    /// VM is part of the upgrade step, not drift).
    Register(u32, String, bool),
    /// The tap's filter is missing or runs another program (`Some(id)`); `upgrade` when this
    /// agent has not attached its own there yet.
    Attach { found: Option<u32>, upgrade: bool },
}

async fn fixes(
    g: &GuestGuard,
    gp: &GuardPlan,
    plan: &VmPlan,
    ns: &Handle,
    links: &HashMap<String, KLink>,
) -> Result<Vec<Fix>, NsError> {
    let mut out = Vec::new();
    let inode = netns_inode(&plan.netns)?;
    let want = GuardEntry::of(gp);
    let tap = links
        .get(&gp.tap)
        .ok_or_else(|| NsError::Missing(format!("{}: link {} is missing", plan.netns, gp.tap)))?;
    let found =
        crate::tcfilter::ingress_program(ns, tap.index, FILTER_PRIORITY, u32::from(FILTER_HANDLE))
            .await
            .map_err(super::routes::nl(format!(
                "{}: dump the ingress filters of {}",
                plan.netns, gp.tap
            )))?;
    // An earlier agent's program on the tap, not replaced by this agent yet.
    let upgrade = found.is_some_and(|id| id != g.program_id()) && !g.was_attached(gp.user_id);
    match g.registered(inode)? {
        Some(e) if e == want => {}
        Some(e) => out.push(Fix::Register(
            inode,
            format!("the entry (user id {}) differs from the plan's", e.uid),
            false,
        )),
        None => out.push(Fix::Register(inode, "no entry".into(), upgrade)),
    }
    if found != Some(g.program_id()) {
        out.push(Fix::Attach { found, upgrade });
    }
    Ok(out)
}

fn change(gp: &GuardPlan, g: &GuestGuard, f: &Fix) -> Change {
    let dev = gp.tap.clone();
    let ours = g.program_id();
    match f {
        Fix::Register(_, what, true) => Change::Upgrade {
            dev,
            what: format!("{what} in this agent's guard: written"),
        },
        Fix::Register(_, what, false) => Change::Guard {
            dev,
            what: format!("{what}: written"),
        },
        Fix::Attach { found: None, .. } => Change::Guard {
            what: format!("{} has no guard filter: attached program {ours}", gp.tap),
            dev,
        },
        Fix::Attach {
            found: Some(id),
            upgrade,
        } => {
            let what = format!(
                "{}'s guard filter runs program {id}: program {ours} swapped in",
                gp.tap
            );
            if *upgrade {
                Change::Upgrade { dev, what }
            } else {
                Change::Guard { dev, what }
            }
        }
    }
}

/// What differs from the plan, as changes; `links` are the VM netns's observed links.
pub(super) async fn drift(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
    ns: &Handle,
    links: &HashMap<String, KLink>,
) -> Result<Vec<Change>, NsError> {
    let Some((g, gp)) = guard(d, plan)? else {
        return Ok(Vec::new());
    };
    Ok(fixes(g, gp, plan, ns, links)
        .await?
        .iter()
        .map(|f| change(gp, g, f))
        .collect())
}

/// Repairs what differs (the entry first, then the filter); returns the repairs. `links` are
/// the VM netns's observed links.
pub(super) async fn sync(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
    ns: &Handle,
    links: &HashMap<String, KLink>,
) -> Result<Vec<Change>, NsError> {
    let Some((g, gp)) = guard(d, plan)? else {
        return Ok(Vec::new());
    };
    let fixes = fixes(g, gp, plan, ns, links).await?;
    if fixes.is_empty() {
        g.attached(gp.user_id);
        return Ok(Vec::new());
    }
    for f in &fixes {
        if let Fix::Register(inode, _, _) = f {
            g.register(*inode, gp, false)?;
        }
    }
    if fixes.iter().any(|f| matches!(f, Fix::Attach { .. })) {
        let (guard, tap) = (Arc::clone(g), gp.tap.clone());
        netns::run_in(&plan.netns, move || guard.attach_here(&tap))??;
    }
    g.attached(gp.user_id);
    let changes: Vec<Change> = fixes.iter().map(|f| change(gp, g, f)).collect();
    tracing::info!(vm = %plan.vm_id, fixes = ?changes.iter().map(ToString::to_string).collect::<Vec<_>>(),
        "guest guard: wrote the VM's entry or attached the program to its tap");
    Ok(changes)
}

/// The drops of the VM of `plan` ([`super::NsDriver::guard_drops`]).
pub(super) fn drops(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
) -> Result<Option<std::collections::BTreeMap<&'static str, u64>>, NsError> {
    match (&d.guard, &plan.guard) {
        (Some(g), Some(p)) => Ok(g.drops(p.user_id)?),
        _ => Ok(None),
    }
}

/// The host's drops ([`super::NsDriver::guard_totals`]).
pub(super) fn totals(d: &NetlinkNsDriver) -> Result<Option<crate::guard::GuardTotals>, NsError> {
    d.guard
        .as_ref()
        .map(|g| g.totals())
        .transpose()
        .map_err(NsError::from)
}
