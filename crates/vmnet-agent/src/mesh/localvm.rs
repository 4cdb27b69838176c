//! One VM of this host as the mesh sees it: its registration ([`LocalReg`]) and what its
//! host veth filter was found running ([`filter_state`], read back by every full pass).

use std::net::Ipv6Addr;

use ipnet::Ipv6Net;
use vmnet_ipam::mesh_vms::MeshVmRow;
use vmnet_kernel::mesh::{LocalVm, MeshPlane};
use vmnet_model::vm::VmConfig;
use vmnet_plan::ns::{PEER_LINK_LOCAL, VmPlan};

/// One VM of this host as the mesh registers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalReg {
    /// Its mesh address.
    pub mesh: Ipv6Addr,
    /// Its user id.
    pub user_id: u32,
    /// Its tenant.
    pub tenant: u32,
    /// The host end of its veth pair.
    pub veth: String,
    /// Its public IPv6 block, if any.
    pub public_block: Option<Ipv6Net>,
    /// Whether it routes `::/0` via the host.
    pub gateway: bool,
    /// Whether it has a route via a mesh address (a gateway VM).
    pub routes_via_mesh: bool,
}

impl LocalReg {
    /// The registration of a VM applied as `plan` from `cfg`; `None` for a VM without a mesh
    /// address (no veth pair).
    #[must_use]
    pub fn of(cfg: &VmConfig, plan: &VmPlan) -> Option<Self> {
        let veth = plan.veth.as_ref()?;
        Some(Self {
            mesh: cfg.mesh_ipv6?,
            user_id: cfg.user_id,
            tenant: cfg.tenant,
            veth: veth.host_name.clone(),
            public_block: cfg.public_ipv6_block(),
            gateway: cfg.default_v6_via_host(),
            routes_via_mesh: cfg
                .network
                .routes
                .iter()
                .any(|r| matches!(r.via, vmnet_model::vm::Via::Mesh(_))),
        })
    }

    pub(super) fn row(&self, host: Ipv6Addr, registered_at: i64) -> MeshVmRow {
        MeshVmRow {
            host: host.to_string(),
            mesh_address: self.mesh.to_string(),
            user_id: self.user_id,
            tenant: self.tenant,
            public_block: self.public_block.map(|b| b.to_string()),
            gateway: self.gateway,
            registered_at,
        }
    }

    pub(super) fn local(&self) -> LocalVm {
        LocalVm {
            user_id: self.user_id,
            veth: self.veth.clone(),
            tenant: self.tenant,
            mesh: self.mesh,
            via: PEER_LINK_LOCAL,
            routes_via_mesh: self.routes_via_mesh,
            gateway: self.gateway,
        }
    }
}

/// What a VM's host veth filter was found running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FilterState {
    /// This plane's VM-side program.
    Ours,
    /// No mesh filter.
    Missing,
    /// Another program (a previous agent's), or it could not be read.
    Other,
}

/// What the filter on host veth `veth` runs, read from the kernel (`ours`: the plane's VM-side
/// program id). A failed read counts as another program (the caller re-attaches).
pub(super) async fn filter_state(
    plane: &MeshPlane,
    nl: &rtnetlink::Handle,
    veth: &str,
    ours: u32,
) -> FilterState {
    let Ok(index) = tokio::task::block_in_place(|| plane.device_index(veth)) else {
        return FilterState::Other;
    };
    match vmnet_kernel::mesh::filter::filter_program(nl, index).await {
        Ok(Some(id)) if id == ours => FilterState::Ours,
        Ok(None) => FilterState::Missing,
        Ok(Some(_)) | Err(_) => FilterState::Other,
    }
}
