//! Request and response bodies of the API that the agent defines itself (the IPAM results are
//! the store's own types, serialized as they are). All request bodies refuse unknown fields.
//! Times are milliseconds since the Unix epoch (`*_unix_ms`); the activity reports give them in
//! RFC 3339 as well, as the spec asks.
//!
//! The status and VM bodies are defined in [`crate::status`] (the agent and pool mode fill them
//! in) and re-exported here, so every body of the API has a path under `api::types`.

use serde::{Deserialize, Serialize};

pub use crate::activity::{ActivityList, VmActivity};
pub use crate::status::{
    AgentStatus, GuardStatus, GuestGuardStatus, PoolStatus, ProviderPoolState, ProviderPoolStatus,
    ReconcileStatus, VmCounts, VmState, VmStatus, VmView,
};

/// Body of `PUT /v1/pools/{id}/range`: the pool's IPv4 range.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolRange {
    /// The IPv4 network, e.g. `10.0.0.0/24` (no host bits). IPv6 is refused.
    pub cidr: String,
    /// The gateway address; never leased, may lie outside the range, but not on the network or
    /// broadcast address of `cidr` (prefixes up to /30).
    pub gateway: String,
    /// The first address to lease (default: the address after the gateway).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_host: Option<String>,
    /// The last address to lease (default: the address before the broadcast address).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_host: Option<String>,
    /// DNS servers for the guests, IPv4 or IPv6 (default: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns: Option<Vec<String>>,
}

/// Body of `POST /v1/pools/{id}/ranges`: a range to append to the pool's list, IPv4 (after the
/// first range) or IPv6. The pool id comes from the path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewRange {
    /// The network, e.g. `2001:db8:0:1::/64` or `10.0.1.0/24`.
    pub cidr: String,
    /// The gateway; never leased.
    pub gateway: String,
    /// The first address to lease (default: see `AddRange`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_host: Option<String>,
    /// The last address to lease (default: see `AddRange`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_host: Option<String>,
}

/// Body of `PUT /v1/pools/{id}/provider`: make the pool a provider pool (spec: the table of
/// pools, "Provider"), or replace its settings. The pool id comes from the path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolProvider {
    /// `hetzner-cloud` or `proxmox-ve`.
    pub provider: String,
    /// The API base URL the request paths are appended to (default for `hetzner-cloud`:
    /// `https://api.hetzner.cloud/v1`; required for `proxmox-ve`, e.g.
    /// `https://pve1.example.com:8006/api2/json`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_url: Option<String>,
    /// Where the agent reads the secret at every poll: `{"file": PATH}` or `{"env": NAME}`.
    pub credentials: vmnet_model::pool::Credentials,
    /// Seconds between polls, 5 to 86400 (default 30).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub poll_interval_secs: Option<u32>,
}

/// Body of `PUT /v1/hosts/{id}`: schedulable capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostCapacity {
    /// vCPUs (0 to 2^32-1).
    pub vcpus: u32,
    /// Memory in MiB (0 to 2^32-1).
    pub memory_mib: u32,
}

/// One NIC of an instance, as `GET /v1/instances/{id}/nics` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NicView {
    /// Position in the guest's interface order (0 = `eth0`).
    pub index: u32,
    /// The guest interface name the seed gives it (`eth<index>`).
    pub guest_ifname: String,
    /// The persistent tap, `bc<10 hex digits>n<index>`.
    pub tap: String,
    /// The MAC, `02:` and the first 10 hex digits of the SHA-256 of the instance id.
    pub mac: String,
    /// The host bridge the tap joins.
    pub network: String,
    /// The IPv4 lease, then the IPv6 lease, in CIDR form with the prefix length of the range
    /// each is in (`/32`, `/128` when no range contains it); empty without a lease.
    pub addresses: Vec<String>,
    /// The IPv4 range's gateway; `null` without an IPv4 lease.
    pub gateway: Option<String>,
    /// The IPv6 range's gateway; `null` without an IPv6 lease.
    pub gateway6: Option<String>,
    /// The range's DNS servers.
    pub nameservers: Vec<String>,
}

/// NIC configs for the runtimes, covering every NIC of the instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuntimeConfigs {
    /// libvirt domain `<interface>` elements.
    pub libvirt_xml: String,
    /// cloud-hypervisor arguments (`--net`, then one value per NIC).
    pub cloud_hypervisor_args: Vec<String>,
    /// Firecracker `network-interfaces` array.
    pub firecracker: serde_json::Value,
    /// qemu arguments (`-netdev tap,…` and `-device virtio-net-pci,…` per NIC).
    pub qemu_args: Vec<String>,
    /// The runtime plugin spec ([`vmnet_plan::pool::runtime::plugin_spec`]):
    /// `{"instance_id", "allocation_id", "nics": [{"tap", "network", "mac", "addresses",
    /// "gateway", "nameservers"}]}`, each NIC with its gateway and nameservers (spec: "A bcx
    /// runtime plugin gets each NIC's gateway and nameservers in its spec").
    pub plugin: serde_json::Value,
}

/// Body of `GET /v1/instances/{id}/nics`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InstanceNics {
    /// The instance.
    pub instance_id: String,
    /// The host it is placed on; `null` when not placed.
    pub host_id: Option<String>,
    /// Whether this agent has realised the NICs (taps, rules, seed) on its host now.
    pub realised: bool,
    /// The seed directory on this host (meta-data, user-data, network-config); `null` unless
    /// realised here.
    pub seed_dir: Option<String>,
    /// The NICs in guest interface order.
    pub nics: Vec<NicView>,
    /// Runtime configs for these NICs.
    pub runtime: RuntimeConfigs,
}

/// One line of an [`ApplyReport`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApplyItem {
    /// `pool`, `host`, `instance` or `vm`.
    pub kind: String,
    /// The object's id.
    pub id: String,
    /// What happened: `set`, `created`, `unchanged`, `applied`, `deleted`, …
    pub result: String,
}

/// What `vmnet apply FILE` did, entry by entry.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApplyReport {
    /// One line per entry, in apply order.
    pub items: Vec<ApplyItem>,
}
