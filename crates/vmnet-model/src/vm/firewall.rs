//! The per-VM firewall of namespace mode (spec: namespaced-vm-networking.md, "Firewall").
//!
//! ```json
//! "firewall": {"enabled": true,
//!   "inbound":  [{"protocol": "tcp", "ports": "22", "prefixes": ["198.51.100.0/24", "2001:db8::/32"]},
//!                {"protocol": "icmp", "prefixes": ["0.0.0.0/0", "::/0"]}],
//!   "outbound": [{"protocol": "any", "prefixes": ["0.0.0.0/0", "::/0"]}]}
//! ```
//!
//! # Semantics
//! Disabled (or absent): everything passes; the rules stay stored and are returned by `GET`.
//! Enabled: established and related connections pass; a new inbound connection (to the guest)
//! passes when an inbound rule matches its source prefix, protocol and destination port; a new
//! outbound one (from the guest) when an outbound rule matches its destination prefix, protocol
//! and destination port. An empty list blocks new traffic in that direction. `icmp` means ICMP
//! and ICMPv6.
//!
//! # Rules (each `INVALID_INPUT` naming the VM and the field, e.g. `firewall.inbound[3].ports`)
//! - `firewall`: an object with `enabled` (a boolean, required), `inbound` and `outbound`
//!   (arrays of rules, absent = empty); nothing else.
//! - a rule: an object with `protocol` (required), `ports` (optional) and `prefixes` (required);
//!   nothing else.
//! - `protocol`: `any`, `tcp`, `udp` or `icmp`.
//! - `ports`: only with `tcp` or `udp` (absent = every port); a string holding one port (`"22"`)
//!   or one inclusive range (`"8000-8100"`), ports 1–65535 written without sign, space or
//!   leading zero, the first not above the last.
//! - `prefixes`: one or more canonical IPv4 or IPv6 prefixes (no host bits; a bare address is
//!   its /32 or /128), each once per rule, none in the IPv4-mapped range `::ffff:0:0/96` (give
//!   the IPv4 prefix).
//! - At most [`MAX_PREFIXES`] prefix entries across both directions.

use std::fmt;
use std::net::IpAddr;

use ipnet::{IpNet, Ipv6Net};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};

use crate::ValidationError;

/// The most prefix entries one firewall may hold, across both directions.
pub const MAX_PREFIXES: usize = 50;

/// The protocol of a rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    /// Every protocol.
    Any,
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
    /// ICMP (IPv4) and ICMPv6, matched on the layer-4 protocol after any IPv6 extension headers.
    Icmp,
}

impl Protocol {
    /// `any`, `tcp`, `udp` or `icmp`.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Any => "any",
            Self::Tcp => "tcp",
            Self::Udp => "udp",
            Self::Icmp => "icmp",
        }
    }

    /// Whether a rule of this protocol may select ports.
    #[must_use]
    pub const fn has_ports(self) -> bool {
        matches!(self, Self::Tcp | Self::Udp)
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for Protocol {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// An inclusive destination port range; one port is `first == last`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PortRange {
    /// The first port (1–65535).
    pub first: u16,
    /// The last port (`first..=65535`).
    pub last: u16,
}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.first == self.last {
            write!(f, "{}", self.first)
        } else {
            write!(f, "{}-{}", self.first, self.last)
        }
    }
}

impl Serialize for PortRange {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// One allow rule.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct FirewallRule {
    /// The protocol.
    pub protocol: Protocol,
    /// The destination ports (tcp and udp only); `None` = every port.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ports: Option<PortRange>,
    /// The peer prefixes: the source of an inbound connection, the destination of an outbound one.
    #[serde(serialize_with = "ser_prefixes")]
    pub prefixes: Vec<IpNet>,
}

fn ser_prefixes<S: Serializer>(v: &[IpNet], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(v.iter().map(ToString::to_string))
}

/// A VM's firewall (see the module docs). [`Firewall::default`] is disabled with no rules.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize)]
pub struct Firewall {
    /// Whether the rules are in force; disabled passes everything.
    pub enabled: bool,
    /// Rules for new connections to the guest.
    pub inbound: Vec<FirewallRule>,
    /// Rules for new connections from the guest.
    pub outbound: Vec<FirewallRule>,
}

impl Firewall {
    /// How many prefix entries both directions hold.
    #[must_use]
    pub fn prefix_count(&self) -> usize {
        self.inbound
            .iter()
            .chain(&self.outbound)
            .map(|r| r.prefixes.len())
            .sum()
    }

    /// Whether the firewall filters (enabled).
    #[must_use]
    pub fn filters(&self) -> bool {
        self.enabled
    }

    /// Checks every rule of the module docs against this value.
    ///
    /// # Errors
    /// `INVALID_INPUT` naming the VM `vm` and the field path.
    pub fn check(&self, vm: &str) -> Result<(), ValidationError> {
        for (dir, rules) in [("inbound", &self.inbound), ("outbound", &self.outbound)] {
            for (i, r) in rules.iter().enumerate() {
                check_rule(vm, &format!("firewall.{dir}[{i}]"), r)?;
            }
        }
        let n = self.prefix_count();
        if n > MAX_PREFIXES {
            return Err(ValidationError::rule(format!(
                "vm {vm}: firewall has {n} prefix entries across inbound and outbound; at most {MAX_PREFIXES} are allowed"
            )));
        }
        Ok(())
    }
}

fn mapped_range() -> Ipv6Net {
    Ipv6Net::new(std::net::Ipv6Addr::new(0, 0, 0, 0, 0, 0xffff, 0, 0), 96).expect("valid prefix")
}

fn check_rule(vm: &str, path: &str, r: &FirewallRule) -> Result<(), ValidationError> {
    let bad =
        |field: &str, msg: String| ValidationError::rule(format!("vm {vm}: {path}.{field} {msg}"));
    if let Some(p) = r.ports {
        if !r.protocol.has_ports() {
            return Err(bad(
                "ports",
                format!(
                    "\"{p}\" is only allowed with protocol tcp or udp (this rule is {})",
                    r.protocol
                ),
            ));
        }
        if p.first == 0 || p.last == 0 {
            return Err(bad(
                "ports",
                format!("\"{p}\": port 0 is not a port; ports are 1-65535"),
            ));
        }
        if p.first > p.last {
            return Err(bad(
                "ports",
                format!(
                    "\"{p}\": the first port is above the last (did you mean \"{}-{}\"?)",
                    p.last, p.first
                ),
            ));
        }
    }
    if r.prefixes.is_empty() {
        return Err(bad(
            "prefixes",
            "must hold at least one prefix (0.0.0.0/0 and ::/0 for everyone)".into(),
        ));
    }
    for (j, n) in r.prefixes.iter().enumerate() {
        let bad =
            |msg: String| ValidationError::rule(format!("vm {vm}: {path}.prefixes[{j}] {n} {msg}"));
        if n.trunc() != *n {
            return Err(bad(format!(
                "is not canonical (host bits set; did you mean {}?)",
                n.trunc()
            )));
        }
        if let IpNet::V6(v6) = n
            && mapped_range().contains(v6)
        {
            return Err(bad(
                "lies in the IPv4-mapped range ::ffff:0:0/96; give the IPv4 prefix".into(),
            ));
        }
        if r.prefixes[..j].contains(n) {
            return Err(bad("appears more than once in the rule".into()));
        }
    }
    Ok(())
}

/// Parses the `firewall` field of a VM config (`vm` names the VM in errors); absent or `null` is
/// `None`.
///
/// # Errors
/// `INVALID_INPUT` naming the field path, for a wrong shape or any rule of the module docs.
pub fn parse(vm: &str, v: Option<&Value>) -> Result<Option<Firewall>, ValidationError> {
    let bad = |field: &str, msg: &str| ValidationError::rule(format!("vm {vm}: {field} {msg}"));
    let o = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(o)) => o,
        Some(v) => return Err(bad("firewall", &format!("must be an object, got {v}"))),
    };
    if let Some(k) = o
        .keys()
        .find(|k| !matches!(k.as_str(), "enabled" | "inbound" | "outbound"))
    {
        return Err(bad(&format!("firewall.{k}"), "is an unknown field"));
    }
    let enabled = match o.get("enabled") {
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            return Err(bad(
                "firewall.enabled",
                &format!("must be true or false, got {v}"),
            ));
        }
        None => return Err(bad("firewall.enabled", "is required (true or false)")),
    };
    let fw = Firewall {
        enabled,
        inbound: parse_rules(vm, o, "inbound")?,
        outbound: parse_rules(vm, o, "outbound")?,
    };
    fw.check(vm)?;
    Ok(Some(fw))
}

fn parse_rules(
    vm: &str,
    o: &Map<String, Value>,
    dir: &str,
) -> Result<Vec<FirewallRule>, ValidationError> {
    let bad = |field: &str, msg: &str| ValidationError::rule(format!("vm {vm}: {field} {msg}"));
    let list = match o.get(dir) {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(v) => {
            return Err(bad(
                &format!("firewall.{dir}"),
                &format!("must be an array of rules, got {v}"),
            ));
        }
    };
    list.iter()
        .enumerate()
        .map(|(i, r)| parse_rule(vm, &format!("firewall.{dir}[{i}]"), r))
        .collect()
}

/// Parses one rule at `path` (its shape and spelling; [`Firewall::check`] checks the rest).
fn parse_rule(vm: &str, path: &str, r: &Value) -> Result<FirewallRule, ValidationError> {
    let bad = |field: &str, msg: &str| ValidationError::rule(format!("vm {vm}: {field} {msg}"));
    let Value::Object(r) = r else {
        return Err(bad(
            path,
            "must be an object with protocol, ports and prefixes",
        ));
    };
    if let Some(k) = r
        .keys()
        .find(|k| !matches!(k.as_str(), "protocol" | "ports" | "prefixes"))
    {
        return Err(bad(&format!("{path}.{k}"), "is an unknown field"));
    }
    let field = format!("{path}.protocol");
    let protocol = match r.get("protocol") {
        Some(Value::String(s)) => match s.as_str() {
            "any" => Protocol::Any,
            "tcp" => Protocol::Tcp,
            "udp" => Protocol::Udp,
            "icmp" => Protocol::Icmp,
            _ => {
                return Err(bad(
                    &field,
                    &format!("{s:?} is not a protocol; use any, tcp, udp or icmp"),
                ));
            }
        },
        Some(v) => return Err(bad(&field, &format!("must be a string, got {v}"))),
        None => return Err(bad(&field, "is required (any, tcp, udp or icmp)")),
    };
    let field = format!("{path}.ports");
    let ports = match r.get("ports") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(parse_ports(s).ok_or_else(|| {
            bad(
                &field,
                &format!(
                    "{s:?} is not one port or one range of ports 1-65535, like \"22\" or \"8000-8100\""
                ),
            )
        })?),
        Some(v) => {
            return Err(bad(
                &field,
                &format!("must be a string like \"22\" or \"8000-8100\", got {v}"),
            ));
        }
    };
    let field = format!("{path}.prefixes");
    let prefixes = match r.get("prefixes") {
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(j, p)| match p {
                Value::String(s) => parse_prefix(s).ok_or_else(|| {
                    bad(
                        &format!("{field}[{j}]"),
                        &format!("{s:?} is not a prefix like 198.51.100.0/24 or 2001:db8::/32"),
                    )
                }),
                v => Err(bad(
                    &format!("{field}[{j}]"),
                    &format!("must be a string, got {v}"),
                )),
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(v) => {
            return Err(bad(
                &field,
                &format!("must be an array of prefixes, got {v}"),
            ));
        }
        None => {
            return Err(bad(
                &field,
                "is required (one or more prefixes; 0.0.0.0/0 and ::/0 for everyone)",
            ));
        }
    };
    Ok(FirewallRule {
        protocol,
        ports,
        prefixes,
    })
}

impl<'de> Deserialize<'de> for FirewallRule {
    /// Parses and checks one rule as [`parse`] does (the errors name the field as `rule`).
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Value::deserialize(d)?;
        let r = parse_rule("-", "rule", &v).map_err(|e| serde::de::Error::custom(e.message()))?;
        check_rule("-", "rule", &r).map_err(|e| serde::de::Error::custom(e.message()))?;
        Ok(r)
    }
}

/// One port (`"22"`) or one inclusive range (`"8000-8100"`), digits only with no leading zero
/// (`"0"` itself parses, so the check can name it). Range order is checked by the caller.
fn parse_ports(s: &str) -> Option<PortRange> {
    let port = |p: &str| -> Option<u16> {
        if p.is_empty()
            || !p.bytes().all(|b| b.is_ascii_digit())
            || (p.len() > 1 && p.starts_with('0'))
        {
            return None;
        }
        p.parse().ok()
    };
    match s.split_once('-') {
        Some((a, b)) => Some(PortRange {
            first: port(a)?,
            last: port(b)?,
        }),
        None => {
            let p = port(s)?;
            Some(PortRange { first: p, last: p })
        }
    }
}

/// A prefix written strictly ([`super::parse_net`]), or a bare address as its full-length prefix.
fn parse_prefix(s: &str) -> Option<IpNet> {
    if s.contains('/') {
        return super::parse_net(s);
    }
    let a: IpAddr = s.parse().ok()?;
    Some(IpNet::from(a))
}
