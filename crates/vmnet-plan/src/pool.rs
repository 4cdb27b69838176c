//! Pool mode planning (spec: hosted-pool-networking.md, "Addresses on an instance", "What
//! reaches the host", "The guest's network configuration", "bcd's nftables tables"):
//!
//! - [`nic`]: the NIC of an instance from its lease and its pool's range.
//! - [`seed`]: the cloud-init NoCloud seed files (meta-data, user-data, network-config v2).
//! - [`runtime`]: NIC configs for libvirt, cloud-hypervisor, Firecracker, qemu and plugins.
//! - [`nft`]: the three bcd nftables tables as nft JSON, full replace and per-instance deltas
//!   (compared with a listing by [`crate::nftdiff`]).
//! - [`validate`]: what the root helper accepts: bcd's three tables and nothing else.

pub mod nft;
pub mod nic;
pub mod runtime;
pub mod seed;
pub mod validate;
