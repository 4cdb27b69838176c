//! The VM's packet-activity entry ([`vmnet_plan::ns::activity`]) through the driver's
//! [`ActivityRecorder`](crate::activity::ActivityRecorder): written at create, read back and
//! repaired on every apply, reported by drift, forgotten on remove. An earlier version's
//! per-tap activity filter is deleted from the VM's tap, whether the VM is planned with an entry
//! or not (the host has packet activity off, or the VM has no veth pair): [`Change::Upgrade`],
//! configure on start, not drift.

use std::collections::HashMap;

use rtnetlink::Handle;
use vmnet_plan::ns::VmPlan;
use vmnet_plan::ns::activity::ActivityPlan;

use super::driver::NetlinkNsDriver;
use super::routes::KLink;
use super::{Change, NsError};
use crate::activity::{ActivityFix, ActivityRecorder, VmEntry};

fn recorder<'a>(
    d: &'a NetlinkNsDriver,
    plan: &'a VmPlan,
) -> Result<Option<(&'a ActivityRecorder, &'a ActivityPlan)>, NsError> {
    let Some(a) = &plan.activity else {
        return Ok(None);
    };
    match &d.activity {
        Some(r) => Ok(Some((r, a))),
        None => Err(NsError::Invalid(format!(
            "vm {}: planned with packet activity, but the driver has no activity program loaded",
            plan.vm_id
        ))),
    }
}

fn change(a: &ActivityPlan, f: &ActivityFix) -> Change {
    let what = format!("activity: {}", f.what());
    if matches!(f, ActivityFix::Upgrade(_)) {
        Change::Upgrade {
            dev: a.dev.clone(),
            what,
        }
    } else {
        Change::Activity {
            dev: a.dev.clone(),
            what,
        }
    }
}

/// The entry `a` plans, with the ifindexes of its veth end and tap from `links` (the VM
/// netns's links by name, as just made or observed).
fn entry(
    plan: &VmPlan,
    a: &ActivityPlan,
    links: &HashMap<String, KLink>,
) -> Result<VmEntry, NsError> {
    let index = |name: &str| {
        links.get(name).map(|l| l.index).ok_or_else(|| {
            NsError::Invalid(format!(
                "vm {}: no {name} in the netns, its activity entry cannot be written",
                plan.vm_id
            ))
        })
    };
    Ok(VmEntry {
        uid: a.user_id,
        veth: index(&a.ingress_dev)?,
        tap: index(&a.dev)?,
    })
}

/// A new VM: registers its netns with the indexes of its veth end and tap the create just made
/// (`links`, by name): one `stat` and one map write, nothing read back.
pub(super) fn register(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
    links: &HashMap<String, KLink>,
) -> Result<(), NsError> {
    if let Some((r, a)) = recorder(d, plan)? {
        let want = entry(plan, a, links)?;
        r.register(crate::activity::netns_inode(&plan.netns)?, want)?;
    }
    Ok(())
}

/// For a VM planned without an activity entry: the per-tap filter an earlier version left on
/// its tap, to be deleted.
async fn leftover(plan: &VmPlan, ns: &Handle) -> Result<Vec<Change>, NsError> {
    let tap = &plan.tap.name;
    Ok(crate::activity::leftover_filter(&plan.netns, ns, tap)
        .await?
        .map(|f| {
            vec![Change::Upgrade {
                dev: tap.clone(),
                what: format!(
                    "activity: {tap} egress still has an earlier version's activity filter ({f}): deleted"
                ),
            }]
        })
        .unwrap_or_default())
}

/// What differs from the plan, as changes; `links` are the VM netns's observed links.
pub(super) async fn drift(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
    ns: &Handle,
    links: &HashMap<String, KLink>,
) -> Result<Vec<Change>, NsError> {
    let Some((r, a)) = recorder(d, plan)? else {
        return leftover(plan, ns).await;
    };
    let fixes = r.drift(&plan.netns, ns, a, entry(plan, a, links)?).await?;
    Ok(fixes.iter().map(|f| change(a, f)).collect())
}

/// Repairs what differs; returns the repairs. `links` are the VM netns's observed links.
pub(super) async fn sync(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
    ns: &Handle,
    links: &HashMap<String, KLink>,
) -> Result<Vec<Change>, NsError> {
    let Some((r, a)) = recorder(d, plan)? else {
        let changes = leftover(plan, ns).await?;
        if !changes.is_empty() {
            crate::activity::detach_filter(&plan.netns, &plan.tap.name)?;
            tracing::info!(vm = %plan.vm_id, "packet activity: deleted an earlier version's activity filter from the VM's tap");
        }
        return Ok(changes);
    };
    let fixes = r.sync(&plan.netns, ns, a, entry(plan, a, links)?).await?;
    if !fixes.is_empty() {
        tracing::info!(vm = %plan.vm_id, fixes = ?fixes.iter().map(ActivityFix::what).collect::<Vec<_>>(),
            "packet activity: wrote the VM's entry or deleted an earlier version's filter");
    }
    Ok(fixes.iter().map(|f| change(a, f)).collect())
}
