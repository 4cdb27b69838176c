//! The per-VM network config of namespace mode (spec: namespaced-vm-networking.md, "Topology",
//! "Routes").
//!
//! A VM config is a JSON document:
//!
//! ```json
//! {"id": "vm-7", "user_id": 7, "tenant": 3, "mesh_ipv6": "fdaa:1::7",
//!  "network": {"routes": [{"destination": "0.0.0.0/0", "via": "host"},
//!                         {"destination": "2000::/3", "via": "fdaa:1::56"}]}}
//! ```
//!
//! [`parse_vm_config`] parses and validates it in one step and is the only way the edge (API, CLI,
//! host spec) should build a [`VmConfig`]; [`VmConfig`]'s own `Deserialize` runs the same rules.
//!
//! # Validation rules (each error is `INVALID_INPUT` and names the VM and the field path)
//! - `id`: non-empty, at most [`MAX_VM_ID_LEN`] bytes, only `[A-Za-z0-9._-]`.
//! - `user_id`: `0..=`[`MAX_USER_ID`] (every derived name and transit /30 exists for this range).
//! - `tenant`: any `u32`.
//! - `mesh_ipv6`: an address in `fdaa::/16` other than `fdaa::` (the range's subnet-router
//!   anycast address), written plain (`fdaa:1::7`) or as a /128.
//! - `network.routes[i].destination`: a canonical prefix (no host bits), each destination once,
//!   written strictly (no whitespace, no leading zeros; see [`parse_net`]); not inside the guest
//!   link [`GUEST_LINK`] (a wider prefix containing it is fine: the connected /30 is longer), and
//!   not inside the mesh range with `via: host`.
//! - `network.routes[i].via`: `"host"` or a mesh address in `fdaa::/16`; a mesh via only for IPv6
//!   destinations.
//! - routes need `mesh_ipv6`: a VM without a mesh address has no veth pair, so nothing to route over.
//! - `private_network_throughput_mibps`, `public_network_throughput_mibps`: whole MiB/s in
//!   `0..=100000`, 0 (the default) unlimited; see [`limits`].
//! - `public_ipv4`, `public_ipv6`: see [`public`] (global unicast, canonical, each needs a route
//!   of its family via `host`).
//! - `firewall`: see [`firewall`] (protocols, one port or range for tcp and udp, canonical
//!   prefixes, at most 50 of them across both directions).
//! - `metadata`: see [`metadata`] (the metadata service version, `v1` or `v2`).
//! - Unknown fields are refused. Fields of later issues ([`FUTURE_FIELDS`]) are refused with
//!   "… is not supported yet".
//!
//! # Limitations
//! WireGuard peers are not modelled yet; they are refused, never accepted and
//! ignored.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

use crate::ValidationError;

pub mod firewall;
pub mod limits;
pub mod metadata;

pub mod public;
mod route;

use route::parse_mesh;
pub use route::{Route, Via};

/// The largest supported VM user id. Every derived name (4 hex digits) and every transit /30 (a
/// /14 holds 2^16 of them) exists for `0..=MAX_USER_ID`.
pub const MAX_USER_ID: u32 = 0xffff;

/// The longest VM id, in bytes.
pub const MAX_VM_ID_LEN: usize = 64;

/// The mesh range every mesh address lies in: `fdaa::/16`.
pub const MESH_RANGE: Ipv6Net = match Ipv6Net::new(Ipv6Addr::new(0xfdaa, 0, 0, 0, 0, 0, 0, 0), 16) {
    Ok(n) => n,
    Err(_) => panic!("fdaa::/16 is a valid prefix"),
};

/// The guest link between the tap (172.16.0.1) and the guest (172.16.0.2): `172.16.0.0/30`.
/// A route destination inside it is refused (the connected route always wins).
pub const GUEST_LINK: IpNet = IpNet::V4(match Ipv4Net::new(Ipv4Addr::new(172, 16, 0, 0), 30) {
    Ok(n) => n,
    Err(_) => panic!("172.16.0.0/30 is a valid prefix"),
});

/// Fields of later issues, at the top level or under `network`, refused with "… is not supported yet".
pub const FUTURE_FIELDS: &[&str] = &["wireguard", "peers", "packet_activity"];

/// The `network` object of a VM config.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct VmNetwork {
    /// What the VM reaches outside the mesh; empty means mesh peers only.
    pub routes: Vec<Route>,
}

/// A validated VM network config (namespace mode). Build it with [`parse_vm_config`] or serde
/// (which runs the same validation).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VmConfig {
    /// The VM id: 1–64 bytes of `[A-Za-z0-9._-]`.
    pub id: String,
    /// The numeric VM user id, `0..=MAX_USER_ID`; every kernel name and the transit /30 derive from it.
    pub user_id: u32,
    /// The tenant; tenant 0 is the privileged tenant (spec "Atlas WG Mesh").
    pub tenant: u32,
    /// The VM's mesh address (a /128 in `fdaa::/16`); `None` for a warm-image capture VM, which
    /// gets no veth pair.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mesh_ipv6: Option<Ipv6Addr>,
    /// The public IPv4 address: the host DNATs it to the guest and SNATs the guest's outbound
    /// connections to it (spec "Routes").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub public_ipv4: Option<Ipv4Addr>,
    /// The public IPv6: a /128 (written as an address) the host maps to the mesh address, or a
    /// shorter block routed into the VM.
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "ser_public_ipv6"
    )]
    pub public_ipv6: Option<Ipv6Net>,
    /// Routes.
    pub network: VmNetwork,
    /// The private limit, MiB/s in both directions; 0 = unlimited ([`limits`]).
    #[serde(skip_serializing_if = "limits::is_unlimited")]
    pub private_network_throughput_mibps: u32,
    /// The public limit, MiB/s in both directions; 0 = unlimited ([`limits`]).
    #[serde(skip_serializing_if = "limits::is_unlimited")]
    pub public_network_throughput_mibps: u32,
    /// The firewall ([`firewall`]); `None` (absent) is disabled. Kept while disabled.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub firewall: Option<firewall::Firewall>,
    /// The metadata service settings ([`metadata`]); `None` (absent) takes the host's defaults.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metadata: Option<metadata::MetadataConfig>,
}

#[allow(clippy::ref_option)]
fn ser_public_ipv6<S: Serializer>(v: &Option<Ipv6Net>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(n) => s.collect_str(&public::ipv6_text(n)),
        None => s.serialize_none(),
    }
}

impl VmConfig {
    /// Whether any IPv4 route uses `host` (then the namespace NATs IPv4 to the transit address).
    #[must_use]
    pub fn ipv4_via_host(&self) -> bool {
        self.network
            .routes
            .iter()
            .any(|r| r.via == Via::Host && matches!(r.destination, IpNet::V4(_)))
    }

    /// Whether any IPv6 route uses `host`.
    #[must_use]
    pub fn ipv6_via_host(&self) -> bool {
        self.network
            .routes
            .iter()
            .any(|r| r.via == Via::Host && matches!(r.destination, IpNet::V6(_)))
    }

    /// The mapped public IPv6 address (`public_ipv6` given as an address, a /128).
    #[must_use]
    pub fn public_ipv6_mapped(&self) -> Option<Ipv6Addr> {
        self.public_ipv6
            .filter(|n| n.prefix_len() == 128)
            .map(|n| n.addr())
    }

    /// The routed public IPv6 block (`public_ipv6` given as a prefix shorter than /128).
    #[must_use]
    pub fn public_ipv6_block(&self) -> Option<Ipv6Net> {
        self.public_ipv6.filter(|n| n.prefix_len() < 128)
    }

    /// Checks every rule of the module docs against this value.
    ///
    /// # Errors
    /// `INVALID_INPUT` naming the VM and the field path.
    pub fn validate(&self) -> Result<(), ValidationError> {
        validate_vm_id(&self.id)?;
        let vm = &self.id;
        if self.user_id > MAX_USER_ID {
            return Err(ValidationError::rule(format!(
                "vm {vm}: user_id {} is outside the supported range 0..={MAX_USER_ID}",
                self.user_id
            )));
        }
        if let Some(m) = self.mesh_ipv6
            && (!MESH_RANGE.contains(&m) || m == MESH_RANGE.network())
        {
            return Err(ValidationError::rule(format!(
                "vm {vm}: mesh_ipv6 {m} is not a VM address in fdaa::/16 (fdaa:: excluded)"
            )));
        }
        limits::check_limit(
            vm,
            limits::PRIVATE_FIELD,
            self.private_network_throughput_mibps,
        )?;
        limits::check_limit(
            vm,
            limits::PUBLIC_FIELD,
            self.public_network_throughput_mibps,
        )?;
        if let Some(fw) = &self.firewall {
            fw.check(vm)?;
        }
        if self.mesh_ipv6.is_none() && !self.network.routes.is_empty() {
            return Err(ValidationError::rule(format!(
                "vm {vm}: network.routes needs mesh_ipv6 (a VM without a mesh address has no veth pair)"
            )));
        }
        let mut seen = BTreeSet::new();
        for (i, r) in self.network.routes.iter().enumerate() {
            let d = r.destination;
            if d.trunc() != d {
                return Err(ValidationError::rule(format!(
                    "vm {vm}: network.routes[{i}].destination {d} is not canonical (host bits set; did you mean {}?)",
                    d.trunc()
                )));
            }
            if !seen.insert(d) {
                return Err(ValidationError::rule(format!(
                    "vm {vm}: network.routes[{i}].destination {d} appears more than once"
                )));
            }
            if GUEST_LINK.contains(&d) {
                return Err(ValidationError::rule(format!(
                    "vm {vm}: network.routes[{i}].destination {d} lies inside the guest link {GUEST_LINK}, which is always connected"
                )));
            }
            if r.via == Via::Host && matches!(d, IpNet::V6(n) if MESH_RANGE.contains(&n)) {
                return Err(ValidationError::rule(format!(
                    "vm {vm}: network.routes[{i}].destination {d} lies inside the mesh range {MESH_RANGE}; mesh traffic never goes via host"
                )));
            }
            if let Via::Mesh(g) = r.via {
                if !MESH_RANGE.contains(&g) {
                    return Err(ValidationError::rule(format!(
                        "vm {vm}: network.routes[{i}].via {g} is not a mesh address in fdaa::/16"
                    )));
                }
                if matches!(d, IpNet::V4(_)) {
                    return Err(ValidationError::rule(format!(
                        "vm {vm}: network.routes[{i}].via {g} carries IPv6 only, but destination {d} is IPv4"
                    )));
                }
                if Some(g) == self.mesh_ipv6 {
                    return Err(ValidationError::rule(format!(
                        "vm {vm}: network.routes[{i}].via {g} is the VM's own mesh address"
                    )));
                }
            }
        }
        self.validate_public()
    }
}

/// Checks a VM id: 1 to [`MAX_VM_ID_LEN`] bytes of `[A-Za-z0-9._-]`, starting with a letter or
/// digit, so `.` and `..` are refused (the rule a config's `id`
/// follows; the API also applies it to the id of a path that names no stored VM).
///
/// # Errors
/// `INVALID_INPUT` naming the id: `vm "a/b": id contains '/'; only A-Z a-z 0-9 . _ - are allowed`,
/// `vm "..": id must start with a letter or digit`.
pub fn validate_vm_id(id: &str) -> Result<(), ValidationError> {
    if id.is_empty() {
        return Err(ValidationError::rule("vm: id must not be empty"));
    }
    if id.len() > MAX_VM_ID_LEN {
        return Err(ValidationError::rule(format!(
            "vm {}…: id is {} bytes, at most {MAX_VM_ID_LEN} are allowed",
            &id[..id.char_indices().nth(16).map_or(id.len(), |(i, _)| i)],
            id.len()
        )));
    }
    if let Some(c) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(ValidationError::rule(format!(
            "vm {id:?}: id contains {c:?}; only A-Z a-z 0-9 . _ - are allowed"
        )));
    }
    // `.` and `..` are path segments, not names: an id starts as every other id does.
    if !id.as_bytes()[0].is_ascii_alphanumeric() {
        return Err(ValidationError::rule(format!(
            "vm {id:?}: id must start with a letter or digit"
        )));
    }
    Ok(())
}

/// Parses and validates a VM config document (JSON bytes).
///
/// # Errors
/// `INVALID_INPUT` for malformed JSON (an object that repeats a key included), wrong types, unknown fields, fields of later issues
/// ("… is not supported yet") and every rule of the module docs; the message names the VM (when
/// its id could be read) and the field path.
pub fn parse_vm_config(json: &[u8]) -> Result<VmConfig, ValidationError> {
    let value: Value = crate::json::from_slice(json).map_err(|source| ValidationError::Json {
        what: "vm: malformed JSON".into(),
        source,
    })?;
    from_value(&value)
}

/// Like [`parse_vm_config`], from an already parsed JSON value (e.g. one VM of a host spec).
///
/// # Errors
/// As [`parse_vm_config`].
pub fn from_value(value: &Value) -> Result<VmConfig, ValidationError> {
    let Value::Object(top) = value else {
        return Err(ValidationError::rule(
            "vm: the config must be a JSON object",
        ));
    };
    let id = match top.get("id") {
        Some(Value::String(s)) => s.clone(),
        Some(other) => {
            return Err(ValidationError::rule(format!(
                "vm: id must be a string, got {other}"
            )));
        }
        None => return Err(ValidationError::rule("vm: id is required")),
    };
    validate_vm_id(&id)?;
    let vm = &id;
    let bad = |field: &str, msg: &str| ValidationError::rule(format!("vm {vm}: {field} {msg}"));
    for key in top.keys() {
        if FUTURE_FIELDS.contains(&key.as_str()) {
            return Err(bad(key, "is not supported yet"));
        }
        if !matches!(
            key.as_str(),
            "id" | "user_id"
                | "tenant"
                | "mesh_ipv6"
                | "public_ipv4"
                | "public_ipv6"
                | "network"
                | "firewall"
                | "metadata"
                | limits::PRIVATE_FIELD
                | limits::PUBLIC_FIELD
        ) {
            return Err(bad(key, "is an unknown field"));
        }
    }
    let user_id = match top.get("user_id") {
        Some(v) => v.as_u64().ok_or_else(|| {
            bad(
                "user_id",
                &format!("must be a non-negative integer, got {v}"),
            )
        })?,
        None => return Err(bad("user_id", "is required")),
    };
    let user_id = u32::try_from(user_id)
        .ok()
        .filter(|u| *u <= MAX_USER_ID)
        .ok_or_else(|| {
            bad(
                "user_id",
                &format!("{user_id} is outside the supported range 0..={MAX_USER_ID}"),
            )
        })?;
    let tenant = match top.get("tenant") {
        Some(v) => v
            .as_u64()
            .and_then(|t| u32::try_from(t).ok())
            .ok_or_else(|| {
                bad(
                    "tenant",
                    &format!("must be an integer in 0..=4294967295, got {v}"),
                )
            })?,
        None => return Err(bad("tenant", "is required")),
    };
    let mesh_ipv6 = match top.get("mesh_ipv6") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(parse_mesh(s).map_err(|m| bad("mesh_ipv6", &m))?),
        Some(v) => return Err(bad("mesh_ipv6", &format!("must be a string, got {v}"))),
    };
    let public_ipv4 = match top.get("public_ipv4") {
        None => None,
        Some(v) => public::parse_ipv4(v).map_err(|m| bad("public_ipv4", &m))?,
    };
    let public_ipv6 = match top.get("public_ipv6") {
        None => None,
        Some(v) => public::parse_ipv6(v).map_err(|m| bad("public_ipv6", &m))?,
    };
    let routes = match top.get("network") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Object(net)) => parse_network(net, &bad)?,
        Some(v) => return Err(bad("network", &format!("must be an object, got {v}"))),
    };
    let private_network_throughput_mibps = limits::parse_limit(vm, top, limits::PRIVATE_FIELD)?;
    let public_network_throughput_mibps = limits::parse_limit(vm, top, limits::PUBLIC_FIELD)?;
    let firewall = firewall::parse(vm, top.get("firewall"))?;
    let metadata = metadata::parse(vm, top.get("metadata"))?;
    let cfg = VmConfig {
        id,
        user_id,
        tenant,
        mesh_ipv6,
        public_ipv4,
        public_ipv6,
        network: VmNetwork { routes },
        private_network_throughput_mibps,
        public_network_throughput_mibps,
        firewall,
        metadata,
    };
    cfg.validate()?;
    Ok(cfg)
}

fn parse_network(
    net: &serde_json::Map<String, Value>,
    bad: &dyn Fn(&str, &str) -> ValidationError,
) -> Result<Vec<Route>, ValidationError> {
    for key in net.keys() {
        let path = format!("network.{key}");
        if FUTURE_FIELDS.contains(&key.as_str()) {
            return Err(bad(&path, "is not supported yet"));
        }
        if key != "routes" {
            return Err(bad(&path, "is an unknown field"));
        }
    }
    let list = match net.get("routes") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(v) => return Err(bad("network.routes", &format!("must be an array, got {v}"))),
    };
    let mut routes = Vec::with_capacity(list.len());
    for (i, r) in list.iter().enumerate() {
        let path = format!("network.routes[{i}]");
        let Value::Object(o) = r else {
            return Err(bad(&path, "must be an object with destination and via"));
        };
        if let Some(k) = o
            .keys()
            .find(|k| !matches!(k.as_str(), "destination" | "via"))
        {
            return Err(bad(&format!("{path}.{k}"), "is an unknown field"));
        }
        let field = |name: &str| -> Result<&str, ValidationError> {
            match o.get(name) {
                Some(Value::String(s)) => Ok(s),
                Some(v) => Err(bad(
                    &format!("{path}.{name}"),
                    &format!("must be a string, got {v}"),
                )),
                None => Err(bad(&format!("{path}.{name}"), "is required")),
            }
        };
        let d = field("destination")?;
        let destination: IpNet = parse_net(d).ok_or_else(|| {
            bad(
                &format!("{path}.destination"),
                &format!("{d:?} is not a prefix like 10.0.0.0/8 or 2000::/3"),
            )
        })?;
        let via: Via = field("via")?
            .parse()
            .map_err(|m: String| bad(&format!("{path}.via"), &m))?;
        routes.push(Route { destination, via });
    }
    Ok(routes)
}

impl<'de> Deserialize<'de> for VmConfig {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Value::deserialize(d)?;
        from_value(&v).map_err(|e| serde::de::Error::custom(e.message()))
    }
}

impl<'de> Deserialize<'de> for VmNetwork {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Raw {
            #[serde(default)]
            routes: Vec<Route>,
        }
        Ok(Self {
            routes: Raw::deserialize(d)?.routes,
        })
    }
}

/// Parses a prefix strictly: `ADDR/LEN` with no surrounding whitespace, no leading zeros in IPv4
/// octets or in the length (std's address parsers), and a length within the family's bits.
/// Host bits may be set (callers check canonical form themselves). `None` when malformed.
#[must_use]
pub fn parse_net(s: &str) -> Option<IpNet> {
    let (addr, len) = s.split_once('/')?;
    if len.is_empty()
        || len.len() > 3
        || !len.bytes().all(|b| b.is_ascii_digit())
        || (len.len() > 1 && len.starts_with('0'))
    {
        return None;
    }
    let len: u8 = len.parse().ok()?;
    IpNet::new(addr.parse::<IpAddr>().ok()?, len).ok()
}

/// The address family of a destination, for callers that split routes by family.
#[must_use]
pub fn is_ipv4(d: &IpNet) -> bool {
    matches!(d.addr(), IpAddr::V4(_))
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod public_tests;

#[cfg(test)]
mod firewall_tests;

#[cfg(test)]
mod metadata_tests;
