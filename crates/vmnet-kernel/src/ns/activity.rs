//! The VM's packet-activity filter ([`vmnet_plan::ns::activity`]) through the driver's
//! [`ActivityRecorder`](crate::activity::ActivityRecorder): written at create, read back and
//! repaired on every apply, reported by drift, forgotten on remove. A VM planned without one
//! (the host has packet activity off, or the VM has no veth pair) has an activity filter an
//! earlier agent left detached ([`Change::Upgrade`]: configure on start, not drift).

use std::sync::Arc;

use rtnetlink::Handle;
use vmnet_plan::ns::VmPlan;
use vmnet_plan::ns::activity::ActivityPlan;

use super::driver::NetlinkNsDriver;
use super::{Change, NsError};
use crate::activity::{ActivityFix, ActivityRecorder};

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
        Change::Tc {
            dev: a.dev.clone(),
            what,
        }
    }
}

/// What a new VM's netns thread needs to write the VM's filter on its tap as soon as the tap
/// exists ([`ActivityRecorder::attach_here`]); `None` for a VM planned without one.
pub(super) fn for_create(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
) -> Result<Option<(Arc<ActivityRecorder>, ActivityPlan)>, NsError> {
    let Some((_, a)) = recorder(d, plan)? else {
        return Ok(None);
    };
    Ok(d.activity.clone().map(|r| (r, a.clone())))
}

/// A new VM whose filter its netns thread wrote ([`for_create`]): register its veth end
/// (nothing to read back).
pub(super) async fn register(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
    ns: &Handle,
) -> Result<(), NsError> {
    if let Some((r, a)) = recorder(d, plan)? {
        let index = r.ingress_index(&plan.netns, ns, a).await?;
        r.register(index, a.user_id)?;
    }
    Ok(())
}

/// For a VM planned without an activity filter: the one an earlier agent left on its tap, to
/// be detached.
async fn leftover(plan: &VmPlan, ns: &Handle) -> Result<Vec<Change>, NsError> {
    let tap = &plan.tap.name;
    Ok(crate::activity::leftover_filter(&plan.netns, ns, tap)
        .await?
        .map(|f| {
            vec![Change::Upgrade {
                dev: tap.clone(),
                what: format!(
                    "activity: packet activity is off for this VM: detach the activity filter on {tap} egress ({f})"
                ),
            }]
        })
        .unwrap_or_default())
}

/// What differs from the plan, as changes.
pub(super) async fn drift(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
    ns: &Handle,
) -> Result<Vec<Change>, NsError> {
    let Some((r, a)) = recorder(d, plan)? else {
        return leftover(plan, ns).await;
    };
    let fixes = r.drift(&plan.netns, ns, a).await?;
    Ok(fixes.iter().map(|f| change(a, f)).collect())
}

/// Repairs what differs; returns the repairs.
pub(super) async fn sync(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
    ns: &Handle,
) -> Result<Vec<Change>, NsError> {
    let Some((r, a)) = recorder(d, plan)? else {
        let changes = leftover(plan, ns).await?;
        if !changes.is_empty() {
            let p = vmnet_plan::ns::activity::plan(&plan.tap.name, "", 0);
            crate::activity::detach_filter(&plan.netns, &p)?;
            tracing::info!(vm = %plan.vm_id, "packet activity off: detached the VM's activity filter");
        }
        return Ok(changes);
    };
    let fixes = r.sync(&plan.netns, ns, a).await?;
    if !fixes.is_empty() {
        tracing::info!(vm = %plan.vm_id, fixes = ?fixes.iter().map(ActivityFix::what).collect::<Vec<_>>(),
            "packet activity: wrote the VM's filter or registration");
    }
    Ok(fixes.iter().map(|f| change(a, f)).collect())
}
