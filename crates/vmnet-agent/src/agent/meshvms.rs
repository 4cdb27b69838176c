//! The agent's side of the mesh's VM registrations ([`crate::mesh::locations`]): a VM is
//! registered after its apply and unregistered before its removal; a full pass and
//! `vmnet mesh vm sync` register the complete local state.

use vmnet_ipam::mesh_vms::Replaced;
use vmnet_ipam::vm_store;
use vmnet_model::Error;
use vmnet_model::vm::VmConfig;
use vmnet_plan::ns::VmPlan;

use super::{Agent, decode, store_tx};
use crate::mesh::locations::LocalReg;

impl Agent {
    /// After `cfg` was applied as `plan` (`prev` the config applied before, if any): its
    /// registration, with the old one gone when its mesh address changed. A failure is logged:
    /// the VM is applied, and the next full pass registers it.
    pub(crate) async fn mesh_vm_up(&self, cfg: &VmConfig, plan: &VmPlan, prev: Option<&VmConfig>) {
        let Some(m) = self.mesh.get() else { return };
        if let Some(p) = prev.filter(|p| p.mesh_ipv6 != cfg.mesh_ipv6 || p.user_id != cfg.user_id)
            && let Err(e) = m.vm_down(p.mesh_ipv6, p.user_id).await
        {
            tracing::warn!(vm = %cfg.id, "mesh: unregistering the old address failed: {}", e.message);
        }
        if let Err(e) = m.vm_up(LocalReg::of(cfg, plan)).await {
            tracing::warn!(vm = %cfg.id, "mesh: registering the vm failed: {}", e.message);
        }
    }

    /// `CONFLICT` when another host registered `cfg`'s mesh address first (spec "Atlas WG
    /// Mesh": one mesh address, one VM in the fleet). Read from the registrations the agent last
    /// read (refreshed on every PostgreSQL notification and every full pass), so it adds no
    /// store round trip to a PUT, except to confirm a conflict it finds.
    ///
    /// # Errors
    /// `CONFLICT` naming the address and the host that holds it.
    pub(crate) async fn mesh_claim_free(&self, cfg: &VmConfig) -> Result<(), Error> {
        let (Some(m), Some(mesh)) = (self.mesh.get(), cfg.mesh_ipv6) else {
            return Ok(());
        };
        let Some((loc, plane)) = m.located() else {
            return Ok(());
        };
        if loc.claimed_elsewhere(mesh).await.is_none() {
            return Ok(());
        }
        // The claim may be gone already (a VM moved here from that host, its removal not yet
        // read): read the registrations again before refusing. A store that cannot be read
        // leaves the answer from the last read.
        if let Err(e) = loc.refresh(plane).await {
            tracing::warn!(vm = %cfg.id, "mesh: re-reading the registrations failed: {}", e.message);
        }
        match loc.claimed_elsewhere(mesh).await {
            Some(host) => Err(Error::conflict(format!(
                "vm {}: mesh_ipv6 {mesh} is registered by host {host} (another VM of the \
                     mesh holds it)",
                cfg.id
            ))),
            None => Ok(()),
        }
    }

    /// Before `cfg`'s veth pair is removed: its registration goes (a failure is logged; the
    /// next full pass removes it).
    pub(crate) async fn mesh_vm_down(&self, cfg: &VmConfig) {
        let Some(m) = self.mesh.get() else { return };
        if let Err(e) = m.vm_down(cfg.mesh_ipv6, cfg.user_id).await {
            tracing::warn!(vm = %cfg.id, "mesh: unregistering the vm failed: {}", e.message);
        }
    }

    /// This host's VMs as the mesh registers them: every stored VM's applied config that has a
    /// veth pair.
    ///
    /// # Errors
    /// `UNAVAILABLE` when the store fails.
    pub(crate) async fn mesh_locals(&self) -> Result<Vec<LocalReg>, Error> {
        let rows = store_tx!(self.db, tx => vm_store::list(tx).await)?;
        let mut out = Vec::new();
        for row in &rows {
            let Some(applied) = row.applied.as_deref() else {
                continue;
            };
            let Ok(cfg) = decode(row, applied, "applied") else {
                continue;
            };
            if let Ok(plan) = self.plan(&cfg)
                && let Some(l) = LocalReg::of(&cfg, &plan)
            {
                out.push(l);
            }
        }
        Ok(out)
    }

    /// `POST /v1/mesh/vms/sync` (`vmnet mesh vm sync`): registers the complete local state
    /// again (this host's rows made equal to its VMs) and rewrites the locations. Returns what
    /// the store write changed.
    ///
    /// # Errors
    /// `UNAVAILABLE` without a mesh, data plane or mesh address, or when the store or the data
    /// plane fails.
    pub async fn mesh_vm_sync(&self) -> Result<Replaced, Error> {
        let m = self.mesh()?;
        let locals = self.mesh_locals().await?;
        m.converge_vms(locals).await.map(|(r, _)| r)
    }
}
