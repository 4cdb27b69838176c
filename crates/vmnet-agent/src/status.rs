//! What the agent reports about itself and its VMs: the status bodies of `GET /v1/status` and the
//! VM views of `/v1/vms`, and the clock their `*_unix_ms` times come from. A leaf module: the
//! agent, pool mode and the API all build on it (the API re-exports these types in
//! [`crate::api::types`]).

use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// Milliseconds since the Unix epoch, now.
#[must_use]
pub fn now_ms() -> i64 {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
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
    /// The public IPv4 of the config applied now; `null` when none is applied.
    #[serde(default)]
    pub applied_public_ipv4: Option<String>,
    /// The public IPv6 (an address or a routed block) of the config applied now; `null` when
    /// none is applied.
    #[serde(default)]
    pub applied_public_ipv6: Option<String>,
    /// How the upstream reaches public addresses on this host: `routed` or `proxy`
    /// (`--public-neighbors`).
    #[serde(default)]
    pub public_neighbors: vmnet_plan::ns::PublicNeighbors,
    /// The last apply error; `null` after a success.
    pub last_error: Option<String>,
    /// When the stored VM last changed, milliseconds since the Unix epoch.
    pub updated_at_unix_ms: i64,
    /// The throughput limits per class and direction (always four rows): the configured limit,
    /// whether it is in force, and the class counters (read from the kernel by
    /// `GET /v1/vms/{id}` only; `null` elsewhere and while no limit is in force).
    #[serde(default)]
    pub limits: Vec<LimitStatus>,
    /// Whether the firewall filters now: enabled in the config applied now, on a VM with a veth.
    #[serde(default)]
    pub firewall_filtering: bool,
    /// Changes of the VM's filter table made behind the agent's back that the firewall audit or
    /// a reconcile pass replaced, since the agent started.
    #[serde(default)]
    pub firewall_repairs: u64,
    /// Frames the guest guard dropped of what the guest sent, by kind
    /// (`vmnet_plan::ns::guard::DROP_KINDS`), since the agent started or created the VM (read
    /// from the kernel by `GET /v1/vms/{id}` only; `null` elsewhere, while the VM is not
    /// applied, and when the guard is off).
    #[serde(default)]
    pub guard_drops: Option<std::collections::BTreeMap<String, u64>>,
}

/// One class and direction of a VM's throughput limits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitStatus {
    /// `private` or `public`.
    pub class: vmnet_plan::ns::limits::TrafficClass,
    /// `download` (what the guest receives) or `upload` (what it sends).
    pub direction: vmnet_plan::ns::limits::Direction,
    /// The configured limit, MiB/s; 0 = unlimited.
    pub limit_mibps: u32,
    /// Whether the limit is shaping now (false: unlimited, not applied yet, or a public limit
    /// without a public path: no route via host, IPv4 or IPv6).
    pub applied: bool,
    /// Bytes of IP packets through the class.
    pub bytes: Option<u64>,
    /// Packets through the class.
    pub packets: Option<u64>,
    /// Packets the class dropped (its queue was full).
    pub drops: Option<u64>,
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
    /// Of `drift_repairs_total`, the repairs made by reconcile passes.
    #[serde(default)]
    pub pass_repairs_total: u64,
    /// Repairs triggered by the kernel's change notifications.
    #[serde(default)]
    pub notifications: NotificationStatus,
    /// Repairs by object kind and trigger, and the time from a change to its repair.
    #[serde(default)]
    pub repairs: crate::repairs::RepairStatus,
}

/// The repair by the kernel's change notifications in [`ReconcileStatus`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NotificationStatus {
    /// Whether the agent listens to the kernel's change notifications.
    pub on: bool,
    /// Notifications of vmnet's objects received (one per object and read).
    pub events_total: u64,
    /// Times notifications were lost (a receive buffer overran): a full pass followed.
    pub lost_total: u64,
    /// Checks run on notifications (a VM, the host-wide state, a full pass, pool mode's tables
    /// or taps).
    pub checks_total: u64,
    /// Checks that repaired something (also counted in `drift_repairs_total`).
    pub repairs_total: u64,
    /// Times an object repaired again and again was put in back-off.
    pub backoffs_total: u64,
    /// From the first notification of the last repaired change to the end of its repair, µs.
    pub last_change_to_repair_us: Option<u64>,
    /// The longest such time since the agent started, µs.
    pub max_change_to_repair_us: Option<u64>,
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
    /// The firewall audit.
    #[serde(default)]
    pub firewall: FirewallAuditStatus,
    /// The provider pools this agent polls, by pool id; `null` when it does not poll
    /// (`vmnet serve` without `--poll-providers`).
    #[serde(default)]
    pub provider_pools: Option<Vec<ProviderPoolStatus>>,
    /// The guest guard of namespace mode; `null` when it is off (`--no-guest-guard`).
    #[serde(default)]
    pub guest_guard: Option<GuestGuardStatus>,
    /// The unprivileged worker that serves the metadata service and sends the provider polls;
    /// `null` when the agent runs neither (`--no-metadata` without `--poll-providers`).
    #[serde(default)]
    pub worker: Option<WorkerStatus>,
    /// The kernel lock and the deadline of VM changes.
    #[serde(default)]
    pub kernel: KernelStatus,
}

/// The guest guard in `GET /v1/status` (see `vmnet_kernel::guard`): what every VM's guest sent
/// that the guard on its tap dropped.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuestGuardStatus {
    /// VMs registered with the guard.
    pub vms: u64,
    /// Frames dropped over every registered VM, by kind (`vmnet_plan::ns::guard::DROP_KINDS`),
    /// since the agent started (a VM's own since the agent created it).
    pub drops: std::collections::BTreeMap<String, u64>,
    /// Frames dropped on a tap whose namespace is not registered (the guard fails closed).
    pub unregistered: u64,
    /// Why the counters could not be read; `null` when they were.
    pub error: Option<String>,
}

/// The kernel lock in [`AgentStatus`]: every kernel change runs under it; a VM change through
/// the API that cannot get it, or finish, within the deadline answers `UNAVAILABLE`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KernelStatus {
    /// How long a VM change through the API may take, lock wait included, ms
    /// (`--kernel-deadline-secs`).
    pub deadline_ms: u64,
    /// What holds the kernel lock now (e.g. `PUT vm web-1`, `reconcile: vm web-2`); `null`
    /// when it is free.
    pub holder: Option<String>,
    /// For how long it has held it, ms.
    pub held_for_ms: Option<u64>,
    /// Changes that ran out of time since the agent started.
    pub timeouts_total: u64,
    /// The last of them, naming what it waited for.
    pub last_timeout: Option<String>,
    /// When it ran out of time, ms since the Unix epoch.
    pub last_timeout_at_unix_ms: Option<i64>,
}

/// The unprivileged worker in [`AgentStatus`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerStatus {
    /// The user it runs as (`--worker-user`).
    pub user: String,
    /// That user's uid.
    pub uid: u32,
    /// That user's gid.
    pub gid: u32,
    /// The running worker's pid; `null` while it is being started again.
    pub pid: Option<u32>,
    /// Workers started since the agent started (1 + restarts).
    pub starts: u64,
    /// When the running worker started, ms since the Unix epoch.
    pub last_start_at_unix_ms: Option<i64>,
    /// How the last worker ended (exit status or signal, and why), `null` before any ended.
    pub last_exit: Option<String>,
    /// When the last worker ended, ms since the Unix epoch.
    pub last_exit_at_unix_ms: Option<i64>,
    /// VMs whose metadata listener it serves.
    pub vms: u64,
}

/// The firewall audit in [`AgentStatus`]: every `--firewall-audit-secs` the filter table of each
/// VM whose firewall filters is compared with the plan by content and replaced when it differs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FirewallAuditStatus {
    /// Seconds between audits (`--firewall-audit-secs`).
    pub audit_period_secs: u64,
    /// Audits run since the agent started.
    pub audits: u64,
    /// When the last audit finished, ms since the Unix epoch; `null` before the first.
    pub last_audit_at_unix_ms: Option<i64>,
    /// How long the last audit took, milliseconds.
    pub last_audit_duration_ms: Option<u64>,
    /// The filter tables the last audit compared.
    pub last_audit_tables: u64,
    /// Filter tables replaced since the agent started (by the audit or a reconcile pass), over
    /// every VM.
    pub repairs_total: u64,
    /// The last repairs, `vm <id>: <differences>`, newest last (at most 10).
    pub last_repairs: Vec<String>,
    /// The errors of the last audit, one line each naming the VM.
    pub last_errors: Vec<String>,
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

/// Where a provider pool stands, in `GET /v1/status` (`provider_pools`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProviderPoolState {
    /// Not polled yet.
    Pending,
    /// The last poll succeeded for every machine.
    Ok,
    /// The last poll listed the machines, but some machines' own calls failed (those keep
    /// their last good addresses, marked stale).
    Degraded,
    /// The last poll failed (timeout, 5xx, 429, malformed answer, unreachable): every machine
    /// keeps its last good addresses, marked stale.
    Failing,
    /// The credentials are unreadable, or the provider refused them (401/403): every machine
    /// keeps its last good addresses, marked stale. Fix the credentials.
    AuthFailed,
}

/// One provider pool in `GET /v1/status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderPoolStatus {
    /// The pool.
    pub pool_id: String,
    /// `hetzner-cloud` or `proxmox-ve`.
    pub provider: vmnet_model::pool::Provider,
    /// Where it stands.
    pub state: ProviderPoolState,
    /// Polls finished since the agent started.
    pub polls: u64,
    /// Polls in a row that failed (0 after a good one).
    pub consecutive_failures: u64,
    /// When the last poll finished, ms since the Unix epoch; `null` before the first.
    pub last_poll_at_unix_ms: Option<i64>,
    /// When the last good poll finished; `null` before the first.
    pub last_success_at_unix_ms: Option<i64>,
    /// How long the last poll took, ms.
    pub last_duration_ms: Option<u64>,
    /// HTTP requests the last poll sent.
    pub last_requests: u64,
    /// Machines (instances) of the pool at the last poll.
    pub machines: u64,
    /// Instances whose machine the provider did not list at the last good poll (at most 20).
    pub missing: Vec<String>,
    /// The kind of the last failure (`credentials`, `auth`, `rate_limited`, `status`, `timeout`, `unreachable`, `malformed`); `null` after a good poll.
    pub last_error_kind: Option<String>,
    /// The last failure, naming the request or the credentials' source (never the secret);
    /// per-machine failures name the instance. `null` after a good poll.
    pub last_error: Option<String>,
    /// When the next poll is due, ms since the Unix epoch.
    pub next_poll_at_unix_ms: Option<i64>,
}
