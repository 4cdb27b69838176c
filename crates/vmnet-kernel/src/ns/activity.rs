//! The VM's packet-activity filter ([`vmnet_plan::ns::activity`]) through the driver's
//! [`ActivityRecorder`](crate::activity::ActivityRecorder): written at create, read back and
//! repaired on every apply, reported by drift, forgotten on remove.

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
    Change::Tc {
        dev: a.dev.clone(),
        what: format!("activity: {}", f.what()),
    }
}

/// A new VM: register its veth end and write its filter (nothing to read back).
pub(super) async fn install(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
    ns: &Handle,
) -> Result<(), NsError> {
    if let Some((r, a)) = recorder(d, plan)? {
        let index = r.ingress_index(&plan.netns, ns, a).await?;
        r.register(index, a.user_id)?;
        r.attach(&plan.netns, a)?;
    }
    Ok(())
}

/// What differs from the plan, as changes.
pub(super) async fn drift(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
    ns: &Handle,
) -> Result<Vec<Change>, NsError> {
    let Some((r, a)) = recorder(d, plan)? else {
        return Ok(Vec::new());
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
        return Ok(Vec::new());
    };
    let fixes = r.sync(&plan.netns, ns, a).await?;
    if !fixes.is_empty() {
        tracing::info!(vm = %plan.vm_id, fixes = ?fixes.iter().map(ActivityFix::what).collect::<Vec<_>>(),
            "packet activity: wrote the VM's filter or registration");
    }
    Ok(fixes.iter().map(|f| change(a, f)).collect())
}
