//! The agent's side of the metadata service: turning it on and keeping each VM's listener in
//! step with its applies ([`crate::metadata`]).

use std::sync::Arc;

use vmnet_model::Error;
use vmnet_plan::ns::VmPlan;

use super::Agent;
use crate::metadata::MetadataService;

impl Agent {
    /// Turns the metadata service on: from now on every successful apply (API or reconcile)
    /// serves the VM's document in its netns, and a delete closes it. Set once, before serving.
    ///
    /// # Errors
    /// `CONFLICT` when the service is already set.
    pub fn set_metadata(&self, m: Arc<MetadataService>) -> Result<(), Error> {
        self.metadata
            .set(m)
            .map_err(|_| Error::conflict("the metadata service is already set on this agent"))
    }

    /// The metadata service, when it is on.
    #[must_use]
    pub fn metadata(&self) -> Option<&Arc<MetadataService>> {
        self.metadata.get()
    }

    /// After a successful apply of `plan`: serve its document (logged, not returned, on
    /// failure: the kernel change stands and the next reconcile pass retries the listener).
    pub(crate) fn sync_metadata(&self, plan: &VmPlan) {
        if let Some(m) = self.metadata.get()
            && let Err(e) = m.sync(plan)
        {
            tracing::warn!(vm = %plan.vm_id, "metadata listener: {e}");
        }
    }
}
