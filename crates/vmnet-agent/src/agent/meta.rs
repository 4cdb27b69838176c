//! The agent's side of the metadata service: turning it on and keeping each VM's listener in
//! step with its applies ([`crate::metadata`]); the worker that serves it and the rules for
//! provider pools it polls.

use std::sync::Arc;

use vmnet_model::Error;
use vmnet_plan::ns::VmPlan;

use super::Agent;
use crate::metadata::MetadataService;
use crate::worker::{Change, Worker};

/// The longest a `PUT` waits for the metadata worker to serve its new document.
pub const SERVED_WITHIN: std::time::Duration = std::time::Duration::from_secs(1);
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
    /// Answers the worker's change, to wait for with [`Agent::metadata_served`].
    pub(crate) fn sync_metadata(&self, plan: &VmPlan) -> Option<Change> {
        let m = self.metadata.get()?;
        match m.sync(plan) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(vm = %plan.vm_id, "metadata listener: {e}");
                None
            }
        }
    }

    /// Waits until the worker serves `change` (at most [`SERVED_WITHIN`]): the API answers a
    /// `PUT` once the guest can read what it put. A worker that does not confirm in time (dead,
    /// starting again) is logged; the answer goes out and the worker catches up when it runs.
    pub(crate) async fn metadata_served(&self, vm: &str, change: Option<Change>) {
        let (Some(c), Some(m)) = (change, self.metadata.get()) else {
            return;
        };
        if !m.worker().settled(c, SERVED_WITHIN).await {
            tracing::warn!(
                vm,
                "the metadata worker did not confirm the VM's document within {SERVED_WITHIN:?}; \
                 it serves it once it runs"
            );
        }
    }
}
