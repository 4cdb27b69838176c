//! The mesh data plane: BPF programs that carry VM-to-VM traffic between hosts over the
//! WireGuard interface, with tenant isolation (spec: "Atlas WG Mesh"; design:
//! `design/mesh.md`).
//!
//! # Design
//! Two tc programs (`bpf/mesh.bpf.c`, compiled by `build.rs`), attached as legacy `cls_bpf`
//! direct-action filters at priority [`FILTER_PRIORITY`], handle [`FILTER_HANDLE`] (so other
//! filters on the same devices keep running: a pass is `TC_ACT_UNSPEC`):
//!
//! - **`mesh_from_vm`** on the ingress of each VM's host veth end: a packet to a mesh address
//!   (`fdaa::/16`) is checked (known destination, tenants), then either left to the host's
//!   routes (same host) or encapsulated in an outer IPv6 header from this host's mesh address to
//!   the destination host's (next header 41, flow label = the destination VM's user id). The
//!   kernel then routes the outer packet through the peer's /128 route into wg0.
//! - **`mesh_from_wg`** on the ingress of wg0: an IPv6-in-IPv6 packet for this host's mesh
//!   address is checked again (the inner source registered on the outer source host, tenants),
//!   decapsulated and redirected to the VM's host veth end named by the flow label
//!   (`bpf_redirect_neigh` through the VM's next hop on the veth).
//!
//! The encapsulation is `bpf_skb_adjust_room` with `BPF_F_ADJ_ROOM_ENCAP_L3_IPV6` (and
//! `FIXED_GSO`: a TCP segment keeps its size, the VM MTU already leaves room for the 40
//! bytes). An LWT `xmit` program with `bpf_lwt_push_encap` also works on this kernel (a scratch
//! prototype), but it runs on routes: it sees neither the ingress veth (for the sender's tenant)
//! nor the wg0 side, so tc is needed anyway and one mechanism does both.
//!
//! **MTU**: a packet larger than the VM MTU (1380) is not encapsulated but passed on unchanged
//! (counted as an `mtu` drop); [`route::ensure_range_route`] routes the mesh range into wg0 with
//! the MTU *locked* at the VM MTU, so the kernel's forwarding path answers it with an ICMPv6
//! Packet Too Big to the VM and drops it. (A BPF program cannot easily build ICMP errors; an
//! unlocked route MTU is ignored for forwarded packets.)
//!
//! **Maps** are pinned by name under a pin root ([`MeshPlane::load`]), so a new agent reuses
//! them and the filters keep forwarding while no agent runs. Map updates are single-entry
//! atomic; a new location is written before anything refers to it.
//!
//! **Fail closed**: a mesh destination not in the locations map, a veth without a local VM
//! entry, an unregistered inner source on wg0: dropped and counted ([`DROP_REASONS`]).
//!
//! **Sources**: `mesh_from_vm` checks what the guest guard on the VM's tap checks first, so
//! that a guard removed by hand does not open the mesh: a VM's mesh traffic carries its own
//! mesh address, an address of its own public block, or (a gateway VM, [`LocalVm::gateway`])
//! any source outside `fdaa::/16`; no VM sends from another mesh address on any path.

pub mod filter;
mod maps;
mod plane;
pub mod route;

pub use crate::bpffs::{is_bpffs, mount_bpffs};
pub use plane::MeshPlane;
pub use plane::cost::{Side, TestRunCost};

use std::net::Ipv6Addr;

use aya::programs::tc::TcHandle;

/// tc filter priority of both programs (lower runs first).
pub const FILTER_PRIORITY: u16 = 10;
/// tc filter handle of both programs.
pub const FILTER_HANDLE: TcHandle = TcHandle::new(0, 0x3e54);

/// Drop reasons, in the order of the `mesh_drops` counters (`enum drop_reason` in the C
/// program), then `spoofed_source` (its own map, `mesh_spoofs`: a packet from a VM with a
/// source it may not use). `mtu` counts packets handed to the kernel for a Packet Too Big.
pub const DROP_REASONS: [&str; 6] = [
    "tenant",
    "unknown_destination",
    "mtu",
    "unknown_source",
    "malformed",
    "spoofed_source",
];

/// Forwarding decisions, in the order of the `mesh_passes` counters (`enum pass_kind`):
/// same-host packets passed, packets encapsulated, packets decapsulated and delivered.
pub const PASS_KINDS: [&str; 3] = ["local", "encapsulated", "decapsulated"];

/// This host's part of the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MeshHost {
    /// This host's mesh address (the outer source of what it sends).
    pub mesh: Ipv6Addr,
    /// The largest VM packet carried, IPv6 header included, in bytes (the VM MTU, 1380).
    pub vm_mtu: u32,
}

/// Where a VM lives: the value of a location.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Location {
    /// The mesh address of the VM's host (this host's own for a local VM).
    pub host: Ipv6Addr,
    /// The VM's user id on that host (20 bits: it travels in the flow label).
    pub user_id: u32,
    /// The VM's tenant.
    pub tenant: u32,
}

/// A VM of this host, as the receiving side needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalVm {
    /// Its user id (the flow label of packets for it).
    pub user_id: u32,
    /// The host end of its veth pair (in the plane's namespace).
    pub veth: String,
    /// Its tenant.
    pub tenant: u32,
    /// Its mesh address.
    pub mesh: Ipv6Addr,
    /// The next hop towards it on the veth (the peer end's link-local address).
    pub via: Ipv6Addr,
    /// Whether it has a route via a mesh address (a gateway VM): only then does the data plane
    /// ask the host's routing where its packets to outside the mesh go (map `mesh_via_vms`).
    pub routes_via_mesh: bool,
    /// Whether it is a gateway VM (routes `::/0` via the host): its packets to a mesh address
    /// may carry a source outside `fdaa::/16` (map `mesh_gateway_vms`).
    pub gateway: bool,
}

/// The largest user id the flow label carries.
pub const MAX_USER_ID: u32 = (1 << 20) - 1;

/// A mesh data plane failure, naming the map, device or path.
#[derive(Debug, thiserror::Error)]
pub enum MeshError {
    /// The BPF object could not be loaded (no BPF support, not root, no bpffs at the pin root).
    #[error("load the mesh programs (pin root {root})")]
    Load {
        /// The pin root.
        root: String,
        /// What failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A device does not exist.
    #[error("{0}: no such device")]
    NoDevice(String),
    /// Attaching a program to a device failed.
    #[error("{dev}: attach {program}")]
    Attach {
        /// The device.
        dev: String,
        /// The program.
        program: &'static str,
        /// What failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A map access failed.
    #[error("mesh map {map}")]
    Map {
        /// The map.
        map: &'static str,
        /// What failed.
        #[source]
        source: aya::maps::MapError,
    },
    /// The kernel refused a test run of a program ([`MeshPlane::test_run`]).
    #[error("test run of {program}")]
    TestRun {
        /// The program.
        program: &'static str,
        /// What failed.
        #[source]
        source: aya::programs::ProgramError,
    },
    /// A value does not fit the data plane (a user id over 20 bits).
    #[error("{0}")]
    Invalid(String),
    /// The namespace could not be entered.
    #[error("netns")]
    Netns(#[source] crate::netns::NetnsError),
    /// A route request failed.
    #[error("{what}")]
    Netlink {
        /// What was attempted.
        what: String,
        /// The cause.
        #[source]
        source: rtnetlink::Error,
    },
}
