//! The guest guard's counters in the API: a VM's drops by kind in `GET /v1/vms/{id}` and the
//! host's totals in `GET /v1/status`, read from the kernel through the driver.

use vmnet_plan::ns::VmPlan;

use super::Agent;
use crate::status::{GuestGuardStatus, VmState, VmView};

impl Agent {
    /// Sets `view`'s `guard_drops` from the kernel when the VM (planned as `plan`) is applied;
    /// a failed read is logged and leaves them `null`.
    pub(super) fn fill_guard_drops(&self, view: &mut VmView, plan: &VmPlan) {
        if view.status.state != VmState::Applied {
            return;
        }
        match self.driver.guard_drops(plan) {
            Ok(drops) => {
                view.status.guard_drops =
                    drops.map(|d| d.into_iter().map(|(k, n)| (k.to_owned(), n)).collect());
            }
            Err(e) => {
                tracing::warn!(vm = %plan.vm_id, error = %e, "reading the guard's drops failed");
            }
        }
    }

    /// `GET /v1/status`'s `guest_guard`: `None` without the guard, the error when the
    /// counters cannot be read.
    pub(super) fn guest_guard_status(&self) -> Option<GuestGuardStatus> {
        match self.driver.guard_totals() {
            Ok(t) => t.map(|t| GuestGuardStatus {
                vms: t.vms,
                drops: t
                    .drops
                    .into_iter()
                    .map(|(k, n)| (k.to_owned(), n))
                    .collect(),
                unregistered: t.unregistered,
                error: None,
            }),
            Err(e) => Some(GuestGuardStatus {
                error: Some(e.to_string()),
                ..GuestGuardStatus::default()
            }),
        }
    }
}
