//! The agent's side of the VM registrations ([`super::locations`]): the hooks of a VM's apply
//! and removal, the full pass, `vmnet mesh vm sync`, and the PostgreSQL listener that re-reads
//! the registrations as soon as a peer changes one.

use std::sync::Arc;
use std::time::Duration;

use vmnet_ipam::mesh_vms;
use vmnet_model::Error;

use super::locations::LocalReg;
use super::runtime::Mesh;

/// How long the listener waits before reconnecting after a failure.
pub const LISTEN_RETRY: Duration = Duration::from_secs(1);

impl Mesh {
    /// After a VM was applied (see [`super::locations::Locations::vm_up`]); nothing without
    /// the data plane or for a VM without a veth pair.
    ///
    /// # Errors
    /// `UNAVAILABLE` when the data plane fails.
    pub async fn vm_up(&self, vm: Option<LocalReg>) -> Result<(), Error> {
        match (self.located(), vm) {
            (Some((l, p)), Some(vm)) => l.vm_up(p, vm).await,
            _ => Ok(()),
        }
    }

    /// Before a VM's veth pair is removed (see [`super::locations::Locations::vm_down`]).
    ///
    /// # Errors
    /// `UNAVAILABLE` when the data plane fails.
    pub async fn vm_down(
        &self,
        mesh: Option<std::net::Ipv6Addr>,
        user_id: u32,
    ) -> Result<(), Error> {
        match (self.located(), mesh) {
            (Some((l, p)), Some(m)) => l.vm_down(p, m, user_id).await,
            _ => Ok(()),
        }
    }

    /// A full pass over this host's VMs `vms` (see
    /// [`super::locations::Locations::converge`]). Returns the store change and the repairs.
    ///
    /// # Errors
    /// `UNAVAILABLE` when the data plane or the store fails; `UNAVAILABLE` without a data plane
    /// or mesh address (nothing registers then).
    pub async fn converge_vms(
        &self,
        vms: Vec<LocalReg>,
    ) -> Result<(mesh_vms::Replaced, Vec<String>), Error> {
        let (l, p) = self.located().ok_or_else(|| {
            Error::unavailable(
                "this agent registers no VMs (it needs --mesh-bpf-root and --mesh-address)",
            )
        })?;
        l.converge(p, &self.nl, vms).await
    }

    /// Listens for registration changes on a PostgreSQL store and re-reads them at each one.
    /// After every (re)connection (notifications were lost meanwhile, and this host's own
    /// writes may have failed) it writes this host's rows again where they differ and re-reads
    /// everything ([`super::locations::Locations::resync`]). Returns at once on SQLite or
    /// without registrations; otherwise runs until aborted.
    pub async fn listen(self: Arc<Self>) {
        let Some((l, _)) = self.located() else { return };
        let Some(db) = l.registry().cloned() else {
            return;
        };
        loop {
            let mut listener = match mesh_vms::listener(&db).await {
                Ok(Some(x)) => x,
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!("mesh registrations: listen: {e}");
                    tokio::time::sleep(LISTEN_RETRY).await;
                    continue;
                }
            };
            self.resync().await;
            loop {
                match listener.try_recv().await {
                    Ok(Some(_)) => {
                        while listener.next_buffered().is_some() {}
                        self.reread().await;
                    }
                    // The connection was lost: connect again and re-read (what changed
                    // meanwhile was not notified).
                    Ok(None) => {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        break;
                    }
                    Err(e) => {
                        tracing::warn!("mesh registrations: listen: {e}");
                        tokio::time::sleep(LISTEN_RETRY).await;
                        break;
                    }
                }
            }
        }
    }

    /// On each (re)connection: this host's rows written again where they differ (a registration
    /// made during an outage reaches the peers now), then everything re-read.
    async fn resync(&self) {
        if let Some((l, p)) = self.located() {
            match l.resync(p).await {
                Ok(done) if !done.is_empty() => {
                    tracing::info!(changes = ?done, "mesh registrations: store (re)connected; this host's rows written again");
                }
                Ok(_) | Err(_) => {}
            }
        }
    }

    async fn reread(&self) {
        if let Some((l, p)) = self.located() {
            let _ = l.refresh(p).await;
        }
    }
}
