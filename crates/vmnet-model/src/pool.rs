//! Pool ranges, leases, hosts and instances (spec: hosted-pool-networking.md, "Give a hosted pool a
//! range", "How leases work").
//!
//! Everything here is pure: [`SetIpPool::validate`] turns the caller's strings into an [`IpRange`]
//! with the defaults filled in, or an `INVALID_INPUT` [`Error`] naming the pool and the field.
//! The store (`vmnet-ipam`) persists the result and hands out leases.
//!
//! # Ranges
//! * IPv4 only; an IPv6 `cidr` is refused.
//! * Addresses and CIDRs are parsed strictly: no surrounding whitespace, no leading zeros
//!   (`010.5.0.0/24` and `" 10.5.0.0/24"` are refused, never read as `10.5.0.0/24`).
//! * `cidr` must be canonical (no host bits set).
//! * `first_host` defaults to the address after the gateway, `last_host` to the address before the
//!   broadcast address. Both must be *usable host addresses* of `cidr` (see below), with
//!   `first_host <= last_host`.
//! * The gateway may lie anywhere (inside or outside the range, even outside `cidr`) except on
//!   the network or broadcast address of `cidr` (prefixes up to /30); it is never leased.
//!
//! # Usable addresses, /31 and /32
//! * Prefix length 0 to 30: the network address and the broadcast address are never usable, so
//!   they can never be `first_host`/`last_host` and are never leased.
//! * `/31` follows RFC 3021 (point-to-point): there is no network or broadcast address, both
//!   addresses are usable, and the default `last_host` is the upper address.
//! * `/32`: the one address is usable and is the default `last_host`. A gateway inside the /32
//!   leaves nothing to lease: with the default `first_host` (the address after the gateway, outside
//!   the /32) the range is refused with `INVALID_INPUT`; with `first_host` set explicitly it is
//!   accepted but leases nothing (every lease is `CAPACITY_UNAVAILABLE`). With a gateway outside
//!   it (a routed /32), set `first_host` explicitly to the address (the default is refused with
//!   that hint).

use std::fmt;
use std::net::{IpAddr, Ipv4Addr};
use std::str::FromStr;

use ipnet::{IpNet, Ipv4Net};
use serde::{Deserialize, Serialize};

use crate::Error;
pub use crate::nic::NetworkPolicy;

/// The longest id accepted for pools, hosts and instances, in bytes.
pub const MAX_ID_LEN: usize = 64;

/// Checks an object id: 1 to [`MAX_ID_LEN`] bytes of `[A-Za-z0-9._-]`, starting with a letter or
/// digit. `field` names the field in the error (e.g. `instance_id`).
///
/// # Errors
/// `INVALID_INPUT` naming `field`: `instance_id must not be empty`,
/// `instance_id is 70 bytes long; at most 64 are allowed`,
/// `instance_id "a;b" may only contain A-Z a-z 0-9 . _ - and must start with a letter or digit`.
pub fn validate_id(field: &str, value: &str) -> Result<(), Error> {
    if value.is_empty() {
        return Err(Error::invalid(format!("{field} must not be empty")));
    }
    if value.len() > MAX_ID_LEN {
        return Err(Error::invalid(format!(
            "{field} is {} bytes long; at most {MAX_ID_LEN} are allowed",
            value.len()
        )));
    }
    let ok_start = value.as_bytes()[0].is_ascii_alphanumeric();
    let ok_chars = value
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if !ok_start || !ok_chars {
        return Err(Error::invalid(format!(
            "{field} {value:?} may only contain A-Z a-z 0-9 . _ - and must start with a letter or digit"
        )));
    }
    Ok(())
}

/// The request of `set_ip_pool`: strings as the caller gave them, validated by
/// [`SetIpPool::validate`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetIpPool {
    /// The hosted pool (an id, see [`validate_id`]).
    pub pool_id: String,
    /// The IPv4 network, e.g. `10.0.0.0/24`.
    pub cidr: String,
    /// The gateway address; never leased.
    pub gateway: String,
    /// The first address to lease. Default: the address after the gateway.
    #[serde(default)]
    pub first_host: Option<String>,
    /// The last address to lease. Default: the address before the broadcast address.
    #[serde(default)]
    pub last_host: Option<String>,
    /// DNS servers for the guests (IPv4 or IPv6). Default: empty.
    #[serde(default)]
    pub dns: Vec<String>,
}

/// A pool's stored range with its defaults filled in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpRange {
    /// The hosted pool.
    pub pool_id: String,
    /// The IPv4 network (canonical).
    pub cidr: Ipv4Net,
    /// The gateway; never leased.
    pub gateway: Ipv4Addr,
    /// The first address leased.
    pub first_host: Ipv4Addr,
    /// The last address leased.
    pub last_host: Ipv4Addr,
    /// DNS servers for the guests, possibly empty.
    pub dns: Vec<IpAddr>,
}

impl IpRange {
    /// Whether `addr` is leasable: inside `first_host..=last_host` and not the gateway.
    #[must_use]
    pub fn is_leasable(&self, addr: Ipv4Addr) -> bool {
        self.first_host <= addr && addr <= self.last_host && addr != self.gateway
    }

    /// The number of leasable addresses (the range minus the gateway if inside it).
    #[must_use]
    pub fn size(&self) -> u64 {
        let n = u64::from(u32::from(self.last_host)) - u64::from(u32::from(self.first_host)) + 1;
        if (self.first_host..=self.last_host).contains(&self.gateway) {
            n - 1
        } else {
            n
        }
    }
}

/// The usable host addresses of `net` as `(lowest, highest)`: without the network and broadcast
/// addresses for prefixes up to /30, both addresses of a /31 (RFC 3021), the address of a /32.
#[must_use]
pub fn usable_hosts(net: Ipv4Net) -> (Ipv4Addr, Ipv4Addr) {
    let lo = u32::from(net.network());
    let hi = u32::from(net.broadcast());
    if net.prefix_len() >= 31 {
        (lo.into(), hi.into())
    } else {
        ((lo + 1).into(), (hi - 1).into())
    }
}

impl SetIpPool {
    /// Validates the request and fills in the defaults.
    ///
    /// # Errors
    /// `INVALID_INPUT` naming the pool and the field, e.g.
    /// `pool p1: cidr 10.0.0.1/24 has host bits set (the network is 10.0.0.0/24)`,
    /// `pool p1: first_host 10.0.1.2 is outside cidr 10.0.0.0/24`,
    /// `pool p1: first_host 10.0.0.9 is after last_host 10.0.0.6`.
    pub fn validate(&self) -> Result<IpRange, Error> {
        validate_id("pool_id", &self.pool_id)?;
        let p = &self.pool_id;
        let bad = |field: &str, what: String| Error::invalid(format!("pool {p}: {field} {what}"));
        let cidr = parse_cidr(&self.cidr).map_err(|what| bad("cidr", what))?;
        let gateway = parse_v4(&self.gateway).map_err(|what| bad("gateway", what))?;
        if cidr.prefix_len() <= 30 {
            if gateway == cidr.network() {
                return Err(bad(
                    "gateway",
                    format!("{gateway} is the network address of {cidr}"),
                ));
            }
            if gateway == cidr.broadcast() {
                return Err(bad(
                    "gateway",
                    format!("{gateway} is the broadcast address of {cidr}"),
                ));
            }
        }
        let (lo, hi) = usable_hosts(cidr);
        let first_host = match &self.first_host {
            Some(s) => parse_v4(s).map_err(|what| bad("first_host", what))?,
            None => {
                let next = u32::from(gateway).checked_add(1).ok_or_else(|| {
                    bad(
                        "first_host",
                        format!("has no default: gateway {gateway} is the last IPv4 address"),
                    )
                })?;
                Ipv4Addr::from(next)
            }
        };
        let last_host = match &self.last_host {
            Some(s) => parse_v4(s).map_err(|what| bad("last_host", what))?,
            None => hi,
        };
        let default_hint = |field: &str| {
            if field == "first_host" && self.first_host.is_none() {
                " (the default is the address after the gateway; set first_host explicitly)"
            } else {
                ""
            }
        };
        for (field, addr) in [("first_host", first_host), ("last_host", last_host)] {
            if !cidr.contains(&addr) {
                let hint = default_hint(field);
                return Err(bad(field, format!("{addr} is outside cidr {cidr}{hint}")));
            }
            if addr < lo {
                return Err(bad(
                    field,
                    format!("{addr} is the network address of {cidr}"),
                ));
            }
            if addr > hi {
                let hint = default_hint(field);
                return Err(bad(
                    field,
                    format!("{addr} is the broadcast address of {cidr}{hint}"),
                ));
            }
        }
        if first_host > last_host {
            return Err(bad(
                "first_host",
                format!("{first_host} is after last_host {last_host}"),
            ));
        }
        let mut dns = Vec::with_capacity(self.dns.len());
        for (i, s) in self.dns.iter().enumerate() {
            let ip = IpAddr::from_str(s)
                .map_err(|_| bad(&format!("dns[{i}]"), format!("{s:?} is not an IP address")))?;
            dns.push(ip);
        }
        Ok(IpRange {
            pool_id: p.clone(),
            cidr,
            gateway,
            first_host,
            last_host,
            dns,
        })
    }
}

fn parse_cidr(s: &str) -> Result<Ipv4Net, String> {
    let net = match crate::vm::parse_net(s) {
        Some(IpNet::V4(net)) => net,
        Some(IpNet::V6(net)) => {
            return Err(format!("{net} is IPv6; only IPv4 ranges are supported"));
        }
        None => return Err(format!("{s:?} is not an IPv4 CIDR such as 10.0.0.0/24")),
    };
    if net.network() != net.addr() {
        return Err(format!(
            "{net} has host bits set (the network is {})",
            net.trunc()
        ));
    }
    Ok(net)
}

/// Parses an IPv4 address strictly (std's parser: no whitespace, no leading zeros).
fn parse_v4(s: &str) -> Result<Ipv4Addr, String> {
    match IpAddr::from_str(s) {
        Ok(IpAddr::V4(a)) => Ok(a),
        Ok(IpAddr::V6(a)) => Err(format!("{a} is IPv6; only IPv4 is supported")),
        Err(_) => Err(format!("{s:?} is not an IPv4 address")),
    }
}

/// One lease: `(pool_id, address)` is unique, and so is `instance_id`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    /// The pool the address belongs to.
    pub pool_id: String,
    /// The leased address.
    pub address: Ipv4Addr,
    /// The instance holding it.
    pub instance_id: String,
}

/// A pool as listed: its id and its range, if one is set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pool {
    /// The pool id.
    pub pool_id: String,
    /// The range, or `None` for a pool without a range (it leases nothing).
    pub range: Option<IpRange>,
    /// How many leases the pool holds.
    pub leases: u64,
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
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "running" => Ok(Self::Running),
            "lost" => Ok(Self::Lost),
            "error" => Ok(Self::Error),
            _ => Err(Error::internal(format!("unknown instance state {s:?}"))),
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
    type Err = Error;
    /// Parses the lowercase name.
    ///
    /// # Errors
    /// `INVALID_INPUT` naming `network_policy`:
    /// `network_policy "open" is not one of public, private, none`.
    fn from_str(s: &str) -> Result<Self, Error> {
        Self::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| {
                Error::invalid(format!(
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
    /// Its lease, when it holds one.
    pub address: Option<Ipv4Addr>,
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
    /// lease first (the address with its range's prefix length, `/32` when the lease lies outside
    /// the pool's current range after a range replacement), then every address the host's status
    /// reports added ([`StatusReport`]), in arrival order, each once. Reports only add; the
    /// reported addresses are cleared when a host loss takes the instance off its host. Empty for
    /// an instance without a lease and without reports.
    #[serde(default)]
    pub addresses: Vec<String>,
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
    pub fn validate(&self) -> Result<Vec<(String, Vec<IpNet>)>, Error> {
        if self.instances.len() > MAX_REPORTED_INSTANCES {
            return Err(Error::invalid(format!(
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
                return Err(Error::invalid(format!(
                    "status report: instance {id} appears twice"
                )));
            }
            if inst.addresses.len() > MAX_REPORTED_ADDRESSES {
                return Err(Error::invalid(format!(
                    "instance {id}: {} addresses; at most {MAX_REPORTED_ADDRESSES} are allowed",
                    inst.addresses.len()
                )));
            }
            let mut nets: Vec<IpNet> = Vec::with_capacity(inst.addresses.len());
            for (j, a) in inst.addresses.iter().enumerate() {
                let net = crate::vm::parse_net(a).ok_or_else(|| {
                    Error::invalid(format!(
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
        }
    }

    /// Checks the ids and the resource request.
    ///
    /// # Errors
    /// `INVALID_INPUT` naming the field (`instance_id`, `pool_id`, `host_id`, `vcpus`, `memory_mib`).
    pub fn validate(&self) -> Result<(), Error> {
        validate_id("instance_id", &self.instance_id)?;
        validate_id("pool_id", &self.pool_id)?;
        if let Some(h) = &self.host_id {
            validate_id("host_id", h)?;
        }
        if self.vcpus == 0 {
            return Err(Error::invalid(format!(
                "instance {}: vcpus must be at least 1",
                self.instance_id
            )));
        }
        if self.memory_mib == 0 {
            return Err(Error::invalid(format!(
                "instance {}: memory_mib must be at least 1",
                self.instance_id
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "pool_tests.rs"]
mod tests;
