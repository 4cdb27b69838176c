//! NIC types for pool mode (spec: hosted-pool-networking.md, "What reaches the host" and
//! "Addresses on an instance").
//!
//! An instance of a hosted pool reaches its host as an [`InstanceSpec`] inside a [`NodeSpec`]:
//! its id, its `allocationId`, its network policy and its NICs in guest interface order. Each
//! [`NicSpec`] names the host bridge (`network`), a stable [`MacAddr`], the lease in CIDR form,
//! the ranges' gateways (`gateway`, and `gateway6` for an IPv6 lease) and its nameservers.
//!
//! # Design
//! Every value is a parsed type ([`MacAddr`], [`ipnet::IpNet`], [`std::net::IpAddr`],
//! [`IfName`]), so a lease, gateway or nameserver string that carries YAML, JSON or nft syntax
//! fails deserialization with `INVALID_INPUT` and can never reach a seed or a ruleset: renderers
//! only ever print these types again. Derived names come from one hash, documented at
//! [`instance_hash10`].
//!
//! # Limitations
//! At most [`MAX_NICS`] NICs per instance (the tap name must fit 15 bytes).

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use ipnet::{IpNet, Ipv4Net};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sha2::{Digest, Sha256};

use crate::ValidationError;
use crate::ids::validate_id;

/// Linux interface names are at most this many bytes (IFNAMSIZ - 1).
pub const IFNAME_MAX: usize = 15;

/// Most NICs one instance may have: tap names are `bc` + 10 hex + `n` + index, so the index
/// may have two digits at most (2 + 10 + 1 + 2 = 15 bytes).
pub const MAX_NICS: usize = 100;

/// Prefix of every instance tap name (and the reason a bridge may not start with it).
pub const TAP_PREFIX: &str = "bc";

/// The default host bridge when none is configured.
pub const DEFAULT_BRIDGE: &str = "br0";

/// The first 10 lower-case hex digits of the SHA-256 of `instance_id`.
///
/// This one hash feeds both derived names: the MAC is `02:` followed by these 10 digits in
/// colon form, and the tap name is `bc<these 10 digits>n<nic index>`. The tap of an instance
/// therefore always shows the MAC it belongs to.
#[must_use]
pub fn instance_hash10(instance_id: &str) -> String {
    let digest = Sha256::digest(instance_id.as_bytes());
    let mut s = hex::encode(digest);
    s.truncate(10);
    s
}

/// A MAC address; displayed and serialized lower case in colon form (`02:1a:2b:3c:4d:5e`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MacAddr(pub [u8; 6]);

impl MacAddr {
    /// The stable, locally administered MAC of an instance: `02` followed by the first 10 hex
    /// digits of the SHA-256 of its id ([`instance_hash10`]).
    #[must_use]
    pub fn for_instance(instance_id: &str) -> Self {
        let digest = Sha256::digest(instance_id.as_bytes());
        Self([0x02, digest[0], digest[1], digest[2], digest[3], digest[4]])
    }

    /// The 6 bytes.
    #[must_use]
    pub const fn octets(self) -> [u8; 6] {
        self.0
    }

    /// The IPv6 link-local address (fe80::/64, modified EUI-64) a guest forms from this MAC.
    #[must_use]
    pub fn link_local_v6(self) -> std::net::Ipv6Addr {
        let m = self.0;
        let seg = |a: u8, b: u8| (u16::from(a) << 8) | u16::from(b);
        std::net::Ipv6Addr::new(
            0xfe80,
            0,
            0,
            0,
            seg(m[0] ^ 0x02, m[1]),
            seg(m[2], 0xff),
            seg(0xfe, m[3]),
            seg(m[4], m[5]),
        )
    }
}

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            m[0], m[1], m[2], m[3], m[4], m[5]
        )
    }
}

impl FromStr for MacAddr {
    type Err = ValidationError;

    /// Parses six colon-separated pairs of hex digits (either case).
    fn from_str(s: &str) -> Result<Self, ValidationError> {
        let bad = || {
            ValidationError::rule(format!(
                "mac {s:?} is not a MAC address (xx:xx:xx:xx:xx:xx)"
            ))
        };
        let mut out = [0u8; 6];
        let mut parts = s.split(':');
        for b in &mut out {
            let p = parts.next().ok_or_else(bad)?;
            if p.len() != 2 || !p.bytes().all(|c| c.is_ascii_hexdigit()) {
                return Err(bad());
            }
            *b = u8::from_str_radix(p, 16).map_err(|_| bad())?;
        }
        if parts.next().is_some() {
            return Err(bad());
        }
        Ok(Self(out))
    }
}

impl Serialize for MacAddr {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for MacAddr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// A Linux interface name: 1–15 bytes of `[A-Za-z0-9_.-]`, not `.` or `..` (a strict subset of
/// iproute2's rule, so it is safe inside XML, JSON, nft and command lines).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IfName(String);

impl IfName {
    /// The name.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for IfName {
    type Err = ValidationError;

    fn from_str(s: &str) -> Result<Self, ValidationError> {
        let ok = !s.is_empty()
            && s.len() <= IFNAME_MAX
            && s != "."
            && s != ".."
            && s.bytes()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-'));
        if ok {
            Ok(Self(s.to_owned()))
        } else {
            Err(ValidationError::rule(format!(
                "interface name {s:?} is not valid (1-15 bytes of A-Z a-z 0-9 _ . -)"
            )))
        }
    }
}

impl fmt::Display for IfName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for IfName {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for IfName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// The tap name of NIC `nic_index` of an instance: `bc<10 hex digits>n<nic_index>`, the digits
/// from [`instance_hash10`]. At most 15 bytes.
///
/// # Errors
/// `INVALID_INPUT` when `nic_index` is [`MAX_NICS`] or more.
pub fn tap_name(instance_id: &str, nic_index: usize) -> Result<IfName, ValidationError> {
    if nic_index >= MAX_NICS {
        return Err(ValidationError::rule(format!(
            "instance {instance_id}: nics[{nic_index}]: at most {MAX_NICS} NICs per instance"
        )));
    }
    format!("{TAP_PREFIX}{}n{nic_index}", instance_hash10(instance_id)).parse()
}

/// What traffic an instance may exchange (spec: "bcd's nftables tables").
///
/// - `public` (the default): anything, subject to the anti-spoofing rules and the drops every
///   tap gets.
/// - `private`: IPv4 only to and from RFC 1918 (10/8, 172.16/12, 192.168/16), link-local
///   169.254/16 and the limited broadcast 255.255.255.255; IPv6 only to and from ULA fc00::/7,
///   link-local fe80::/10 and (outbound) link-scope multicast ff02::/16 (neighbour discovery).
///   ARP is allowed (still anti-spoofed). Nothing public in either direction, even through the
///   gateway. A pool whose range is not private therefore isolates `private` guests.
/// - `none`: every frame from or to the instance's taps is dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NetworkPolicy {
    /// No restriction beyond anti-spoofing and the common drops.
    #[default]
    Public,
    /// Private address space only (see the type's docs).
    Private,
    /// Nothing in or out.
    None,
}

/// One NIC of an instance, as the host receives it (spec table in "What reaches the host").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NicSpec {
    /// The host bridge the tap joins (`br0` unless configured). `None` is refused by
    /// [`InstanceSpec::validate`].
    #[serde(default)]
    pub network: Option<IfName>,
    /// The guest MAC ([`MacAddr::for_instance`] for vps NICs).
    pub mac: MacAddr,
    /// The IPv4 lease, then the IPv6 lease, in CIDR form ([`lease_cidr`]: the prefix length of
    /// the range each is in, or `/32`, `/128` for a lease outside its range); empty without a
    /// lease.
    #[serde(default)]
    pub addresses: Vec<IpNet>,
    /// The range's gateway, for a NIC with a lease: the IPv4 range's for an IPv4 lease. A NIC
    /// with only an IPv6 address may carry its IPv6 gateway here instead of in `gateway6`.
    #[serde(default)]
    pub gateway: Option<IpAddr>,
    /// The IPv6 range's gateway, for a NIC with an IPv6 lease (omitted on the wire when there
    /// is none, so an IPv4-only NIC reads as before).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway6: Option<Ipv6Addr>,
    /// The range's `dns`, for a NIC with a lease.
    #[serde(default)]
    pub nameservers: Vec<IpAddr>,
}

impl NicSpec {
    /// Whether the NIC carries static configuration (at least one address).
    #[must_use]
    pub fn is_static(&self) -> bool {
        !self.addresses.is_empty()
    }

    /// The NIC's gateways in order: `gateway`, then `gateway6`.
    pub fn gateways(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.gateway
            .into_iter()
            .chain(self.gateway6.map(IpAddr::V6))
    }
}

/// One instance on a host: `InstanceSpec` in the NodeSpec's `instances` section.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InstanceSpec {
    /// The instance id ([`crate::ids::validate_id`]).
    pub id: String,
    /// The allocation the host names when it fetches the user data. On the wire `allocationId`
    /// (the spec's name); `allocation_id` is still accepted when parsing.
    #[serde(rename = "allocationId", alias = "allocation_id")]
    pub allocation_id: String,
    /// The network policy (default `public`).
    #[serde(default)]
    pub policy: NetworkPolicy,
    /// A sandbox instance accepts SSH (tcp/22) only from the host's own addresses.
    #[serde(default)]
    pub sandbox: bool,
    /// The NICs in guest interface order (the encoder keeps it).
    #[serde(default)]
    pub nics: Vec<NicSpec>,
}

impl InstanceSpec {
    /// Checks the instance against the rules of "What reaches the host" and "bcd's nftables
    /// tables": ids well formed, at most [`MAX_NICS`] NICs, every NIC has a network, no network
    /// starts with `bc`, gateways and nameservers only with addresses, a gateway (`gateway`,
    /// `gateway6`) of the same family as one of the NIC's addresses, at most one IPv6 gateway,
    /// no MAC used twice.
    ///
    /// # Errors
    /// `INVALID_INPUT` naming the instance and the field, e.g.
    /// `instance i-1: nics[0].network "bc0" starts with "bc" and would match every tap rule`.
    pub fn validate(&self) -> Result<(), ValidationError> {
        validate_id("instance id", &self.id)?;
        let ctx = |m: String| ValidationError::rule(format!("instance {}: {m}", self.id));
        validate_id("allocationId", &self.allocation_id).map_err(|e| ctx(e.to_string()))?;
        if self.nics.len() > MAX_NICS {
            return Err(ctx(format!(
                "nics: {} NICs, at most {MAX_NICS}",
                self.nics.len()
            )));
        }
        for (i, nic) in self.nics.iter().enumerate() {
            let Some(net) = &nic.network else {
                return Err(ctx(format!(
                    "nics[{i}].network is missing: a NIC needs a network"
                )));
            };
            if net.as_str().starts_with(TAP_PREFIX) {
                return Err(ctx(format!(
                    "nics[{i}].network {:?} starts with \"{TAP_PREFIX}\" and would match every tap rule",
                    net.as_str()
                )));
            }
            if nic.addresses.is_empty()
                && (nic.gateways().next().is_some() || !nic.nameservers.is_empty())
            {
                return Err(ctx(format!(
                    "nics[{i}]: gateway or nameservers without addresses"
                )));
            }
            for (field, gw) in [
                ("gateway", nic.gateway),
                ("gateway6", nic.gateway6.map(IpAddr::V6)),
            ] {
                if let Some(gw) = gw
                    && !nic
                        .addresses
                        .iter()
                        .any(|a| a.addr().is_ipv4() == gw.is_ipv4())
                {
                    return Err(ctx(format!(
                        "nics[{i}].{field} {gw} has no address of its family on the NIC"
                    )));
                }
            }
            if let (Some(IpAddr::V6(gw)), Some(gw6)) = (nic.gateway, nic.gateway6) {
                return Err(ctx(format!(
                    "nics[{i}]: gateway {gw} and gateway6 {gw6} are both IPv6; give one"
                )));
            }
            if self.nics[..i].iter().any(|o| o.mac == nic.mac) {
                return Err(ctx(format!("nics[{i}].mac {} is used twice", nic.mac)));
            }
        }
        Ok(())
    }

    /// The tap names of the NICs, in order.
    ///
    /// # Errors
    /// As [`tap_name`].
    pub fn tap_names(&self) -> Result<Vec<IfName>, ValidationError> {
        (0..self.nics.len())
            .map(|i| tap_name(&self.id, i))
            .collect()
    }
}

/// The `NodeSpec` of one host: the instances it runs.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSpec {
    /// The instances, each with its NICs in order.
    #[serde(default)]
    pub instances: Vec<InstanceSpec>,
}

impl NodeSpec {
    /// Validates every instance and that no instance id appears twice.
    ///
    /// # Errors
    /// The first instance's error, or `INVALID_INPUT` for a duplicate id.
    pub fn validate(&self) -> Result<(), ValidationError> {
        for (i, inst) in self.instances.iter().enumerate() {
            inst.validate()?;
            if self.instances[..i].iter().any(|o| o.id == inst.id) {
                return Err(ValidationError::rule(format!(
                    "instance {}: id appears twice",
                    inst.id
                )));
            }
        }
        Ok(())
    }

    /// Parses and validates a NodeSpec from JSON.
    ///
    /// # Errors
    /// `INVALID_INPUT` naming the field when the JSON or a value (address, MAC, name) is malformed.
    pub fn from_json(s: &str) -> Result<Self, ValidationError> {
        let spec: Self = serde_json::from_str(s).map_err(|source| ValidationError::Json {
            what: "node spec".into(),
            source,
        })?;
        spec.validate()?;
        Ok(spec)
    }
}

/// The lease in CIDR form (spec: "What reaches the host", `addresses`; "Addresses on an
/// instance"): `address` with the prefix length of its range's `cidr` when the range contains it,
/// otherwise `/32`.
///
/// A lease lies outside its range when `setIpPool` replaced the range and kept the existing
/// leases ("Existing leases are kept as they are, even if they now fall outside it"); `range_cidr`
/// is `None` when the pool has no range at all. Such a lease is given as `<address>/32` and
/// never fails anything: the NIC keeps the range's gateway and nameservers (the seed then routes
/// through the gateway on-link), and `Instance.addresses` shows the same `/32`. This one rule is
/// shared by the host plan (`vmnet_plan::pool::nic`) and the store (`vmnet_ipam`).
#[must_use]
pub fn lease_cidr(address: Ipv4Addr, range_cidr: Option<Ipv4Net>) -> Ipv4Net {
    match range_cidr {
        Some(net) if net.contains(&address) => {
            Ipv4Net::new(address, net.prefix_len()).unwrap_or_else(|_| Ipv4Net::from(address))
        }
        _ => Ipv4Net::from(address),
    }
}

/// Appends the addresses of a host status report to `Instance.addresses` (spec: "Addresses on an
/// instance", hosted pools): reports only add, the lease stays first, nothing already present is
/// repeated.
pub fn append_reported(addresses: &mut Vec<IpNet>, reported: &[IpNet]) {
    for a in reported {
        if !addresses.contains(a) {
            addresses.push(*a);
        }
    }
}

/// `Instance.addresses` of a provider pool (spec: "Addresses on an instance", provider pools):
/// each poll replaces the list with what the provider reports, in its order, without
/// duplicates. With `drop_loopback_and_link_local` (Proxmox VE guest-agent reports) loopback
/// (127/8, ::1) and link-local (169.254/16, fe80::/10) addresses are left out. A Hetzner public
/// IPv6 network stays as given (a /64).
#[must_use]
pub fn provider_addresses(reported: &[IpNet], drop_loopback_and_link_local: bool) -> Vec<IpNet> {
    let skip = |a: &IpNet| match a.addr() {
        IpAddr::V4(v) => v.is_loopback() || v.is_link_local(),
        IpAddr::V6(v) => v.is_loopback() || v.is_unicast_link_local(),
    };
    let mut out: Vec<IpNet> = Vec::new();
    for a in reported {
        if (drop_loopback_and_link_local && skip(a)) || out.contains(a) {
            continue;
        }
        out.push(*a);
    }
    out
}

#[cfg(test)]
mod tests;
