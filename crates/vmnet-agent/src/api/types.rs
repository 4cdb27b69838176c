//! Request and response bodies of the API that the agent defines itself (the IPAM results are
//! the store's own types, serialized as they are). All request bodies refuse unknown fields.
//! Times are milliseconds since the Unix epoch (`*_unix_ms`).

use serde::{Deserialize, Serialize};

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

/// Body of `PUT /v1/hosts/{id}`: schedulable capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostCapacity {
    /// vCPUs (0 to 2^32-1).
    pub vcpus: u32,
    /// Memory in MiB (0 to 2^32-1).
    pub memory_mib: u32,
}

/// Where a VM stands, as `GET /v1/vms/{id}` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VmState {
    /// The desired config is applied.
    Applied,
    /// Not applied yet (stored, waiting for the reconcile pass).
    Pending,
    /// The last apply of the desired config failed (see `last_error`); the previous good
    /// config, if any, stays applied.
    Failed,
}

impl VmState {
    /// `applied`, `pending` or `failed`.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Applied => "applied",
            Self::Pending => "pending",
            Self::Failed => "failed",
        }
    }
}

/// A VM's status: the derived kernel names and addresses, what is applied, the last error.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmStatus {
    /// Applied, pending or failed.
    pub state: VmState,
    /// The VM's network namespace (a named netns under `/run/netns`).
    pub netns: String,
    /// The host end of the veth pair; `null` for a VM without a mesh address (no veth pair).
    pub veth_host: Option<String>,
    /// The namespace end of the veth pair; `null` without a mesh address.
    pub veth_ns: Option<String>,
    /// The transit /30 derived from the user id, e.g. `100.64.0.28/30`; `null` without a mesh
    /// address.
    pub transit: Option<String>,
    /// The veth MTU in bytes (1380).
    pub mtu: u32,
    /// The persistent tap inside the namespace that the VMM opens.
    pub tap: String,
    /// The tap's owner uid, if one is configured (`--tap-owner`).
    pub tap_owner: Option<u32>,
    /// The guest's IPv4 address (`172.16.0.2`).
    pub guest_ipv4: String,
    /// The guest's gateway, the tap's address (`172.16.0.1`).
    pub gateway_ipv4: String,
    /// The guest's MAC address (`06:00:ac:10:00:02`).
    pub guest_mac: String,
    /// The mesh address routed host → veth → namespace → tap → guest; `null` without one.
    pub mesh_ipv6: Option<String>,
    /// The routes of the config that is applied now (empty when nothing is applied).
    pub applied_routes: Vec<vmnet_model::vm::Route>,
    /// The last apply error; `null` after a success.
    pub last_error: Option<String>,
    /// When the stored VM last changed, milliseconds since the Unix epoch.
    pub updated_at_unix_ms: i64,
}

/// A VM as the API returns it: the desired config and its status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmView {
    /// The desired config, as stored.
    pub config: vmnet_model::vm::VmConfig,
    /// The status.
    pub status: VmStatus,
}

/// VM counts in [`AgentStatus`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmCounts {
    /// VMs in the store.
    pub desired: u64,
    /// VMs whose desired config is applied.
    pub applied: u64,
    /// VMs whose last apply failed.
    pub failed: u64,
}

/// The reconcile loop's record in [`AgentStatus`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReconcileStatus {
    /// Full passes completed since the agent started.
    pub passes: u64,
    /// When the last full pass started, ms since the Unix epoch; `null` before the first.
    pub last_started_at_unix_ms: Option<i64>,
    /// When the last full pass finished, ms since the Unix epoch; `null` before the first.
    pub last_finished_at_unix_ms: Option<i64>,
    /// How long the last full pass took, ms.
    pub last_duration_ms: Option<u64>,
    /// Whether the last full pass applied every VM and collected every orphan.
    pub last_ok: Option<bool>,
    /// The errors of the last full pass (one line each, naming the VM or object).
    pub last_errors: Vec<String>,
    /// Orphaned kernel objects removed since the agent started.
    pub orphans_removed_total: u64,
    /// Repairs of kernel state changed behind the agent's back since it started: one per VM a
    /// pass found different from its applied config (a link, address, route, rule or nft
    /// table) and put back, one per pass that put back the host-wide state.
    #[serde(default)]
    pub drift_repairs_total: u64,
}

/// Body of `GET /v1/status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentStatus {
    /// The agent's version.
    pub version: String,
    /// The prefix of every kernel object name the agent owns.
    pub name_prefix: String,
    /// Seconds between periodic reconcile passes.
    pub reconcile_interval_secs: u64,
    /// VM counts.
    pub vms: VmCounts,
    /// The reconcile loop.
    pub reconcile: ReconcileStatus,
    /// Pool mode on this host; `null` when the agent runs without `--host-id`.
    #[serde(default)]
    pub pool: Option<PoolStatus>,
}

/// Pool mode in [`AgentStatus`]: the three bcd tables as the kernel lists them now, the drift
/// audit and the last convergence pass.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolStatus {
    /// This host's id (`--host-id`).
    pub host_id: String,
    /// The bridge instance taps join (`--bridge`).
    pub bridge: String,
    /// Where the instances' NoCloud seeds are written.
    pub seed_dir: String,
    /// The owned tables present in the kernel now, as `family name` (e.g.
    /// `bridge bcd_instances`); the backstop tables exist only while an instance NIC does.
    pub tables: Vec<String>,
    /// Rules per present table.
    pub rules: std::collections::BTreeMap<String, u64>,
    /// Elements per non-empty set or map, keyed `family table set`.
    pub elements: std::collections::BTreeMap<String, u64>,
    /// Why the tables could not be listed; `null` when they were.
    pub listing_error: Option<String>,
    /// Instances realised on this host (NIC, rules, seed).
    pub instances: u64,
    /// Taps with rules.
    pub taps: u64,
    /// Audits that found drift and re-applied the tables, since the agent started.
    pub drift_repairs: u64,
    /// The differences the last repair found.
    pub last_drift: Vec<String>,
    /// Audits run since the agent started (one every 5 seconds).
    pub audits: u64,
    /// When the last audit finished, ms since the Unix epoch; `null` before the first.
    pub last_audit_at_unix_ms: Option<i64>,
    /// The last audit's error; `null` after a good audit.
    pub last_audit_error: Option<String>,
    /// Convergence passes run since the agent started.
    pub passes: u64,
    /// When the last pass finished, ms since the Unix epoch; `null` before the first.
    pub last_pass_at_unix_ms: Option<i64>,
    /// The errors of the last pass, one line each naming the instance or object.
    pub last_errors: Vec<String>,
    /// The tap guard; `null` when it is off (`--no-tap-guard`).
    pub guard: Option<GuardStatus>,
}

/// The tap guard in `GET /v1/status` (see `vmnet_kernel::pool::guard`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuardStatus {
    /// Taps the guard is attached to.
    pub taps: u64,
    /// Frames dropped since the agent started, by reason (`vmnet_kernel::pool::guard::DROP_REASONS`).
    pub drops: std::collections::BTreeMap<String, u64>,
    /// Why the counters could not be read; `null` when they were.
    pub error: Option<String>,
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
    /// The lease first, in CIDR form with the range's prefix length (`/32` when the range no
    /// longer contains it); empty without a lease.
    pub addresses: Vec<String>,
    /// The range's gateway; `null` without a lease.
    pub gateway: Option<String>,
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
