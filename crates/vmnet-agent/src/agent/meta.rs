//! The agent's side of the metadata service: turning it on and keeping each VM's listener in
//! step with its applies ([`crate::metadata`]); the worker that serves it and the rules for
//! provider pools it polls.

use std::sync::Arc;

use vmnet_model::Error;
use vmnet_plan::ns::VmPlan;

use super::Agent;
use crate::metadata::MetadataService;
use crate::worker::Worker;
use vmnet_model::pool::ProviderRules;

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

    /// Records the unprivileged worker, for the status. Set once.
    ///
    /// # Errors
    /// `CONFLICT` when a worker is already set.
    pub fn set_worker(&self, w: Arc<Worker>) -> Result<(), Error> {
        self.worker
            .set(w)
            .map_err(|_| Error::conflict("the worker is already set on this agent"))
    }

    /// The unprivileged worker, when it runs.
    #[must_use]
    pub fn worker(&self) -> Option<&Arc<Worker>> {
        self.worker.get()
    }

    /// Sets what the agent accepts of provider pools (`--credentials-dir`,
    /// `--allow-plain-http-providers`); checked by `PUT /v1/pools/{id}/provider`.
    pub fn set_provider_rules(&self, rules: ProviderRules) {
        *self
            .provider_rules
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = rules;
    }

    /// What the agent accepts of provider pools.
    #[must_use]
    pub fn provider_rules(&self) -> ProviderRules {
        self.provider_rules
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
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
