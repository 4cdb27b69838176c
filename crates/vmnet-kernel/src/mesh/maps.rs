//! The map layouts shared with `bpf/mesh.bpf.c` (`repr(C)`, no implicit padding).

use aya::Pod;

/// `struct mesh_config`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Config {
    pub host: [u8; 16],
    pub vm_mtu: u32,
    pub pad: u32,
}

/// `struct dest`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Dest {
    pub host: [u8; 16],
    pub user_id: u32,
    pub tenant: u32,
}

/// `struct local_vm`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Local {
    pub ifindex: u32,
    pub tenant: u32,
    pub mesh: [u8; 16],
    pub via: [u8; 16],
}

/// `struct gw_key`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct GwKey {
    pub host: [u8; 16],
    pub tenant: u32,
}

// SAFETY: plain `repr(C)` structs of integers and byte arrays without padding, matching the C
// structs field for field.
unsafe impl Pod for Config {}
// SAFETY: as above.
unsafe impl Pod for Dest {}
// SAFETY: as above.
unsafe impl Pod for Local {}
// SAFETY: as above.
unsafe impl Pod for GwKey {}

pub(super) const CONFIG: &str = "mesh_config";
pub(super) const DESTS: &str = "mesh_dests";
pub(super) const LOCAL_VMS: &str = "mesh_local_vms";
pub(super) const VETHS: &str = "mesh_veths";
pub(super) const VIA_VMS: &str = "mesh_via_vms";
pub(super) const WHITELIST: &str = "mesh_whitelist";
pub(super) const BLOCKS: &str = "mesh_blocks";
pub(super) const GATEWAYS: &str = "mesh_gateways";
pub(super) const GATEWAY_VMS: &str = "mesh_gateway_vms";
pub(super) const DROPS: &str = "mesh_drops";
pub(super) const SPOOFS: &str = "mesh_spoofs";
pub(super) const PASSES: &str = "mesh_passes";
