//! The subsystems an agent is given at start, each set once (pool mode, the provider poller,
//! the mesh) or kept by it (packet activity, the worker), and how the rest reaches them.

use std::sync::Arc;

use vmnet_model::Error;

use super::Agent;
use crate::mesh::runtime::Mesh;
use crate::pool::node::PoolNode;
use crate::provider::poller::Poller;

impl Agent {
    /// Turns pool mode on: from now on every reconcile pass, and every instance change made
    /// through the API, converges `pool` to the store. Set once, before serving.
    ///
    /// # Errors
    /// `CONFLICT` when pool mode is already set.
    pub fn set_pool(&self, pool: Arc<PoolNode>) -> Result<(), Error> {
        self.pool
            .set(pool)
            .map_err(|_| Error::conflict("pool mode is already set on this agent"))
    }

    /// Turns the provider pools' poller on: its pools' states show in `GET /v1/status`. Set
    /// once; the caller runs it ([`Poller::run`]).
    ///
    /// # Errors
    /// `CONFLICT` when a poller is already set.
    pub fn set_providers(&self, poller: Arc<Poller>) -> Result<(), Error> {
        let _ = poller.events.set(self.events.clone());
        self.providers
            .set(poller)
            .map_err(|_| Error::conflict("the provider poller is already set on this agent"))
    }

    /// Turns the mesh on: from now on every full reconcile pass converges it. Set once, before
    /// serving.
    ///
    /// # Errors
    /// `CONFLICT` when the mesh is already set.
    pub fn set_mesh(&self, mesh: Arc<Mesh>) -> Result<(), Error> {
        let _ = mesh.events.set(self.events.clone());
        self.mesh
            .set(mesh)
            .map_err(|_| Error::conflict("the mesh is already set on this agent"))
    }

    /// The mesh, when it is on.
    ///
    /// # Errors
    /// `UNAVAILABLE` when this agent runs no mesh interface.
    pub fn mesh(&self) -> Result<&Arc<Mesh>, Error> {
        self.mesh
            .get()
            .ok_or_else(|| Error::unavailable("this agent runs no mesh interface"))
    }

    /// Pool mode, when it is on.
    #[must_use]
    pub fn pool(&self) -> Option<&Arc<PoolNode>> {
        self.pool.get()
    }

    /// Converges pool mode now (no-op without it) after an instance change made through the API;
    /// failures are logged and recorded in the status, not returned: the store change stands and
    /// the next pass retries.
    pub async fn converge_pool(&self) {
        if let Some(p) = self.pool.get() {
            match p.converge(&self.db).await {
                Ok(o) if o.errors.is_empty() => {}
                Ok(o) => tracing::warn!(errors = ?o.errors, "pool pass had errors"),
                Err(e) => tracing::warn!("pool pass failed: {e}"),
            }
        }
    }

    /// The packet-activity program, when it runs.
    pub(crate) fn activity_recorder(
        &self,
    ) -> Option<&Arc<vmnet_kernel::activity::ActivityRecorder>> {
        self.activity.get()
    }

    /// The unprivileged worker, when it runs.
    pub(crate) fn worker_handle(&self) -> Option<&Arc<crate::worker::Worker>> {
        self.worker.get()
    }

    /// The provider pools' poller, when it runs.
    pub(crate) fn provider_poller(&self) -> Option<&Arc<Poller>> {
        self.providers.get()
    }

    /// Whether the agent listens to the kernel's change notifications.
    pub(crate) fn notifications_on(&self) -> bool {
        self.record.lock().is_ok_and(|r| r.notifications.on)
    }
}
