//! Pool ranges, leases, hosts and instances (spec: hosted-pool-networking.md, "Give a hosted pool a
//! range", "How leases work").
//!
//! Everything here is pure: [`SetIpPool::validate`] turns the caller's strings into an [`IpRange`]
//! with the defaults filled in, or an `INVALID_INPUT` [`ValidationError`](crate::ValidationError) naming the pool and the field (the
//! range rules are in `pool_range.rs`, re-exported here). The store (`vmnet-ipam`) persists the
//! result and hands out leases.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::ValidationError;
use crate::ids::{MAX_ID_LEN, validate_id};
pub use crate::nic::NetworkPolicy;

mod provider;
mod provider_rules;
mod range;
mod ranges;
pub use provider::{
    Credentials, DEFAULT_POLL_INTERVAL_SECS, HETZNER_API_URL, MAX_POLL_INTERVAL_SECS,
    MAX_PROXMOX_VMID, MAX_SETTING_LEN, MIN_POLL_INTERVAL_SECS, Machine, Provider, ProviderPool,
    SetProviderPool,
};
pub use provider_rules::{DEFAULT_CREDENTIALS_DIR, ProviderRules};
pub use range::{
    IpRange, MAX_DNS, MAX_PREFIX_LEN, MIN_PREFIX_LEN, RESERVED, SetIpPool, usable_hosts,
};
pub use ranges::{
    AddRange, Family, MAX_PREFIX_LEN_V6, MIN_PREFIX_LEN_V6, PoolRange, RESERVED_V6, addr_num,
    usable_hosts6,
};

/// One lease: `(pool_id, address)` is unique, and so is `instance_id`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    /// The pool the address belongs to.
    pub pool_id: String,
    /// The leased address: IPv4 or IPv6 (an instance holds at most one of each per pool).
    pub address: IpAddr,
    /// The instance holding it.
    pub instance_id: String,
}

/// Which kind a pool is (spec: the table of pools).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolKind {
    /// A hosted pool (`vps-host`): instances are placed on vmnet hosts and lease from the range,
    /// if one is set.
    #[default]
    Hosted,
    /// A provider pool (`provider`): instances are machines at a provider; nothing is leased,
    /// and their addresses are what the provider reports, replaced on every poll.
    Provider,
}

/// A pool as listed: its id, its kind and its range or provider settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pool {
    /// The pool id.
    pub pool_id: String,
    /// `hosted` or `provider`.
    #[serde(default)]
    pub kind: PoolKind,
    /// The first IPv4 range (the one `set_ip_pool` sets, with the DNS servers), or `None` for a
    /// pool without one (always `None` for a provider pool).
    pub range: Option<IpRange>,
    /// Every range in the pool's order: the first IPv4 range (as in `range`), then the ranges
    /// added after it, IPv4 and IPv6. Empty for a pool without ranges (it leases nothing).
    #[serde(default)]
    pub ranges: Vec<PoolRange>,
    /// How many IPv4 leases the pool holds (always 0 for a provider pool).
    pub leases: u64,
    /// How many IPv6 leases the pool holds.
    #[serde(default)]
    pub leases_ipv6: u64,
    /// The provider settings of a provider pool; `None` for a hosted pool.
    #[serde(default)]
    pub provider: Option<ProviderPool>,
}

/// Whether a host can take placements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HostState {
    /// The host takes placements.
    Ready,
    /// The host was lost; it takes nothing and holds no allocations.
    Lost,
}

/// A host with its capacity and what placements have claimed of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Host {
    /// The host id.
    pub host_id: String,
    /// vCPUs the host offers.
    pub vcpus: u32,
    /// Memory the host offers, MiB.
    pub memory_mib: u32,
    /// vCPUs claimed by placed instances.
    pub used_vcpus: u32,
    /// Memory claimed by placed instances, MiB.
    pub used_memory_mib: u32,
    /// Ready or lost.
    pub state: HostState,
}

/// An instance's lifecycle state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InstanceState {
    /// Placed on a host, holding its claim (and its lease when the pool has a range).
    Running,
    /// Its host was lost and it is not recreated; no claim, no lease.
    Lost,
    /// The reconciler could not place it; see its conditions (`Unschedulable`).
    Error,
}

impl InstanceState {
    /// The stored string form (`running`, `lost`, `error`).
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Lost => "lost",
            Self::Error => "error",
        }
    }
}

impl fmt::Display for InstanceState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for InstanceState {
    type Err = ValidationError;
    fn from_str(s: &str) -> Result<Self, ValidationError> {
        match s {
            "running" => Ok(Self::Running),
            "lost" => Ok(Self::Lost),
            "error" => Ok(Self::Error),
            _ => Err(ValidationError::rule(format!(
                "unknown instance state {s:?}"
            ))),
        }
    }
}

/// The names of [`NetworkPolicy`] as stored and shown (JSON, SQL, CLI): `public`, `private`, `none`.
impl NetworkPolicy {
    /// Every policy, in the order the docs list them.
    pub const ALL: [Self; 3] = [Self::Public, Self::Private, Self::None];

    /// The lowercase name (`public`, `private`, `none`), as in JSON.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Public => "public",
            Self::Private => "private",
            Self::None => "none",
        }
    }
}

impl fmt::Display for NetworkPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for NetworkPolicy {
    type Err = ValidationError;
    /// Parses the lowercase name.
    ///
    /// # Errors
    /// `INVALID_INPUT` naming `network_policy`:
    /// `network_policy "open" is not one of public, private, none`.
    fn from_str(s: &str) -> Result<Self, ValidationError> {
        Self::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| {
                ValidationError::rule(format!(
                    "network_policy {s:?} is not one of public, private, none"
                ))
            })
    }
}

/// Deserializes `network_policy` with an error that names the field even where the caller has
/// no field path (host spec files): `unknown network_policy "open", expected one of public,
/// private, none`.
fn policy_field<'de, D: serde::Deserializer<'de>>(d: D) -> Result<NetworkPolicy, D::Error> {
    let s = String::deserialize(d)?;
    NetworkPolicy::ALL
        .into_iter()
        .find(|p| p.as_str() == s)
        .ok_or_else(|| {
            serde::de::Error::custom(format!(
                "unknown network_policy {s:?}, expected one of public, private, none"
            ))
        })
}

/// A condition on an instance, e.g. `Unschedulable` after a failed placement.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Condition {
    /// The condition type, e.g. `Unschedulable`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Why, e.g. `Pool p1 has no free IP address`.
    pub message: String,
}

/// An instance: its pool, its resource request, where it runs and its lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Instance {
    /// The instance id.
    pub instance_id: String,
    /// The hosted pool it belongs to.
    pub pool_id: String,
    /// The host holding its claim, when placed.
    pub host_id: Option<String>,
    /// Requested vCPUs.
    pub vcpus: u32,
    /// Requested memory, MiB.
    pub memory_mib: u32,
    /// Whether a host loss places it again elsewhere.
    pub recreate_on_host_loss: bool,
    /// Lifecycle state.
    pub state: InstanceState,
    /// Conditions, e.g. `Unschedulable`.
    pub conditions: Vec<Condition>,
    /// Its IPv4 lease, when it holds one.
    pub address: Option<Ipv4Addr>,
    /// Its IPv6 lease, when it holds one (the pool has IPv6 ranges).
    #[serde(default)]
    pub address6: Option<Ipv6Addr>,
    /// What traffic it may exchange (`public`, `private` or `none`).
    #[serde(default)]
    pub network_policy: NetworkPolicy,
    /// A sandbox instance accepts SSH (tcp/22) only from its host's own addresses.
    #[serde(default)]
    pub sandbox: bool,
    /// The id of its latest placement, handed to the host with the instance (its
    /// `allocationId`). Every placement, re-placement after a host loss included, takes a new
    /// one: `alloc-<n>-<instance_id>` cut to [`MAX_ID_LEN`] bytes, where `n` is a store-wide
    /// counter that never repeats (so the id is unique even for long instance ids and after an
    /// instance id is deleted and reused). Instances stored before the field existed keep their
    /// instance id as allocation id. Always a valid id (see [`validate_id`]).
    #[serde(default)]
    pub allocation_id: String,
    /// `Instance.addresses` (spec: "Addresses on an instance", hosted pools), CIDR form: the
    /// IPv4 lease first, then the IPv6 lease (each the address with the prefix length of the
    /// pool's range that contains it, `/32` or `/128` when none does after a range replacement),
    /// then every address the host's status
    /// reports added ([`StatusReport`]), in arrival order, each once. Reports only add; the
    /// reported addresses are cleared when a host loss takes the instance off its host. Empty for
    /// an instance without a lease and without reports.
    ///
    /// For an instance of a provider pool (spec: "Addresses on an instance", provider pools):
    /// exactly what the last good poll reported for its machine, in the provider's order,
    /// replaced by every poll (never appended to); empty before the first good poll.
    #[serde(default)]
    pub addresses: Vec<String>,
    /// The machine at the provider, for an instance of a provider pool; `None` otherwise.
    #[serde(default)]
    pub machine: Option<Machine>,
    /// Provider pools: true when the last poll of the machine failed, so `addresses` are the
    /// ones of the last good poll (at `addresses_polled_at_unix_ms`). Always false for a
    /// hosted pool.
    #[serde(default)]
    pub addresses_stale: bool,
    /// Provider pools: when the last good poll of the machine finished, ms since the Unix
    /// epoch; `None` before the first one (and for a hosted pool).
    #[serde(default)]
    pub addresses_polled_at_unix_ms: Option<i64>,
}

impl Instance {
    /// The allocation id for placement number `n` of `instance_id` (see
    /// [`Instance::allocation_id`]): `alloc-<n>-<instance_id>`, cut to [`MAX_ID_LEN`] bytes.
    /// The `alloc-<n>-` prefix alone makes it unique; ids are ASCII, so the cut is on a character
    /// boundary.
    #[must_use]
    pub fn allocation_id_for(instance_id: &str, n: u64) -> String {
        let mut id = format!("alloc-{n}-{instance_id}");
        id.truncate(MAX_ID_LEN);
        id
    }
}

/// The most addresses one instance may carry in one [`StatusReport`].
pub const MAX_REPORTED_ADDRESSES: usize = 64;

/// The most instances one [`StatusReport`] may carry.
pub const MAX_REPORTED_INSTANCES: usize = 4096;

/// A host status report (`POST /v1/hosts/{id}/status`; spec: "Addresses on an instance", hosted
/// pools): the addresses the host's runtime sees on its instances (guest agent, DHCP leases).
///
/// JSON: `{"instances": [{"instance_id": "vm1", "addresses": ["10.0.0.2/29", "2001:db8::5/64"]}]}`.
/// Unknown fields are refused. Check it with [`StatusReport::validate`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StatusReport {
    /// The instances the host reports on, at most [`MAX_REPORTED_INSTANCES`], each id once.
    pub instances: Vec<ReportedInstance>,
}

/// One instance of a [`StatusReport`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReportedInstance {
    /// The instance id (see [`validate_id`]).
    pub instance_id: String,
    /// Its interface addresses in CIDR form (address and prefix length, host bits kept:
    /// `10.0.0.2/29`, `2001:db8::5/64`), IPv4 or IPv6, at most [`MAX_REPORTED_ADDRESSES`].
    /// Parsed strictly (no whitespace, no leading zeros). Repeats are ignored.
    #[serde(default)]
    pub addresses: Vec<String>,
}

impl StatusReport {
    /// Validates the whole report and parses every address, in report order: what the store
    /// appends for each instance, duplicates inside one entry removed.
    ///
    /// # Errors
    /// `INVALID_INPUT` naming the instance and the field, e.g.
    /// `status report: instances[1].instance_id "a;b" may only contain …`,
    /// `status report: instance vm1 appears twice`,
    /// `instance vm1: addresses[0] "10.0.0.2" is not an address in CIDR form such as 10.0.0.2/24`,
    /// `instance vm1: 65 addresses; at most 64 are allowed`,
    /// `status report: 4097 instances; at most 4096 are allowed`.
    pub fn validate(&self) -> Result<Vec<(String, Vec<IpNet>)>, ValidationError> {
        if self.instances.len() > MAX_REPORTED_INSTANCES {
            return Err(ValidationError::rule(format!(
                "status report: {} instances; at most {MAX_REPORTED_INSTANCES} are allowed",
                self.instances.len()
            )));
        }
        let mut out: Vec<(String, Vec<IpNet>)> = Vec::with_capacity(self.instances.len());
        for (i, inst) in self.instances.iter().enumerate() {
            validate_id(
                &format!("status report: instances[{i}].instance_id"),
                &inst.instance_id,
            )?;
            let id = &inst.instance_id;
            if out.iter().any(|(o, _)| o == id) {
                return Err(ValidationError::rule(format!(
                    "status report: instance {id} appears twice"
                )));
            }
            if inst.addresses.len() > MAX_REPORTED_ADDRESSES {
                return Err(ValidationError::rule(format!(
                    "instance {id}: {} addresses; at most {MAX_REPORTED_ADDRESSES} are allowed",
                    inst.addresses.len()
                )));
            }
            let mut nets: Vec<IpNet> = Vec::with_capacity(inst.addresses.len());
            for (j, a) in inst.addresses.iter().enumerate() {
                let net = crate::vm::parse_net(a).ok_or_else(|| {
                    ValidationError::rule(format!(
                        "instance {id}: addresses[{j}] {a:?} is not an address in CIDR form such as 10.0.0.2/24"
                    ))
                })?;
                crate::nic::append_reported(&mut nets, &[net]);
            }
            out.push((id.clone(), nets));
        }
        Ok(out)
    }
}

/// Why a [`StatusReport`] entry was not applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SkipReason {
    /// No instance has this id.
    UnknownInstance,
    /// The instance exists but is not placed on the reporting host (another host, or none:
    /// lost or in error).
    NotOnHost,
}

/// A [`StatusReport`] entry that was not applied; the rest of the report was.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkippedInstance {
    /// The reported instance id.
    pub instance_id: String,
    /// Why.
    pub reason: SkipReason,
    /// A human-readable explanation, e.g. `instance vm2 is placed on host h2, not h1`.
    pub message: String,
}

/// A [`StatusReport`] entry that was applied.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdatedInstance {
    /// The instance id.
    pub instance_id: String,
    /// The addresses this report added, in report order (CIDR form); empty when it added
    /// nothing new.
    pub added: Vec<String>,
    /// The instance's `addresses` afterwards (see [`Instance::addresses`]).
    pub addresses: Vec<String>,
}

/// What a [`StatusReport`] did: entries applied and skipped, each in report order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusReportOutcome {
    /// The reporting host.
    pub host_id: String,
    /// Entries for instances placed on the host.
    pub updated: Vec<UpdatedInstance>,
    /// Entries for unknown instances and instances not placed on the host.
    pub skipped: Vec<SkippedInstance>,
}

/// The vCPUs an instance requests when the request does not say (API and CLI alike): 1.
pub const DEFAULT_VCPUS: u32 = 1;

/// The memory an instance requests when the request does not say (API and CLI alike): 512 MiB.
pub const DEFAULT_MEMORY_MIB: u32 = 512;

const fn default_vcpus() -> u32 {
    DEFAULT_VCPUS
}

const fn default_memory_mib() -> u32 {
    DEFAULT_MEMORY_MIB
}

/// The request of `instances.create`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewInstance {
    /// The instance id (see [`validate_id`]).
    pub instance_id: String,
    /// The hosted pool.
    pub pool_id: String,
    /// Place on this host; `None` picks the first ready host (by id) with room.
    #[serde(default)]
    pub host_id: Option<String>,
    /// Requested vCPUs (at least 1). Default (absent in JSON): [`DEFAULT_VCPUS`].
    #[serde(default = "default_vcpus")]
    pub vcpus: u32,
    /// Requested memory, MiB (at least 1). Default (absent in JSON): [`DEFAULT_MEMORY_MIB`].
    #[serde(default = "default_memory_mib")]
    pub memory_mib: u32,
    /// Whether a host loss places it again elsewhere.
    #[serde(default)]
    pub recreate_on_host_loss: bool,
    /// What traffic it may exchange: `public` (default), `private` or `none` (lowercase in JSON;
    /// anything else is refused with `INVALID_INPUT` naming `network_policy`).
    #[serde(default, deserialize_with = "policy_field")]
    pub network_policy: NetworkPolicy,
    /// Accept SSH (tcp/22) only from the host's own addresses. Default: false.
    #[serde(default)]
    pub sandbox: bool,
    /// The machine, required for (and only for) an instance of a provider pool, which is not
    /// placed on a host (see [`Machine`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine: Option<Machine>,
}

impl NewInstance {
    /// A request with the defaults of an absent JSON field: no host, [`DEFAULT_VCPUS`],
    /// [`DEFAULT_MEMORY_MIB`], no recreation, policy `public`, no sandbox.
    #[must_use]
    pub fn new(instance_id: impl Into<String>, pool_id: impl Into<String>) -> Self {
        Self {
            instance_id: instance_id.into(),
            pool_id: pool_id.into(),
            host_id: None,
            vcpus: DEFAULT_VCPUS,
            memory_mib: DEFAULT_MEMORY_MIB,
            recreate_on_host_loss: false,
            network_policy: NetworkPolicy::Public,
            sandbox: false,
            machine: None,
        }
    }

    /// Why this request does not describe the existing instance `inst` (the first field that
    /// differs, as `vcpus 1 (this request: 2)`), or `None` when it does: repeating the request
    /// that created `inst` must not conflict with it. Compared: `pool_id`, `vcpus`,
    /// `memory_mib`, `recreate_on_host_loss`, `network_policy`, `sandbox`, and `host_id` when
    /// the request names a host (against the host the instance is on now; `none` when it is on
    /// none), and `machine`.
    #[must_use]
    pub fn mismatch(&self, inst: &Instance) -> Option<String> {
        let field = |name: &str, have: &dyn fmt::Display, want: &dyn fmt::Display| {
            Some(format!("{name} {have} (this request: {want})"))
        };
        if self.pool_id != inst.pool_id {
            return field("pool_id", &inst.pool_id, &self.pool_id);
        }
        if self.vcpus != inst.vcpus {
            return field("vcpus", &inst.vcpus, &self.vcpus);
        }
        if self.memory_mib != inst.memory_mib {
            return field("memory_mib", &inst.memory_mib, &self.memory_mib);
        }
        if self.recreate_on_host_loss != inst.recreate_on_host_loss {
            return field(
                "recreate_on_host_loss",
                &inst.recreate_on_host_loss,
                &self.recreate_on_host_loss,
            );
        }
        if self.network_policy != inst.network_policy {
            return field("network_policy", &inst.network_policy, &self.network_policy);
        }
        if self.sandbox != inst.sandbox {
            return field("sandbox", &inst.sandbox, &self.sandbox);
        }
        if self.machine != inst.machine {
            let show =
                |m: &Option<Machine>| m.as_ref().map_or("none".to_owned(), Machine::to_string);
            return field("machine", &show(&inst.machine), &show(&self.machine));
        }
        match (&self.host_id, &inst.host_id) {
            (Some(want), Some(have)) if want != have => field("host_id", have, want),
            (Some(want), None) => field("host_id", &"none", want),
            _ => None,
        }
    }

    /// Checks the ids and the resource request.
    ///
    /// # Errors
    /// `INVALID_INPUT` naming the field (`instance_id`, `pool_id`, `host_id`, `vcpus`, `memory_mib`).
    pub fn validate(&self) -> Result<(), ValidationError> {
        validate_id("instance_id", &self.instance_id)?;
        validate_id("pool_id", &self.pool_id)?;
        if let Some(h) = &self.host_id {
            validate_id("host_id", h)?;
        }
        if self.vcpus == 0 {
            return Err(ValidationError::rule(format!(
                "instance {}: vcpus must be at least 1",
                self.instance_id
            )));
        }
        if self.memory_mib == 0 {
            return Err(ValidationError::rule(format!(
                "instance {}: memory_mib must be at least 1",
                self.instance_id
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
