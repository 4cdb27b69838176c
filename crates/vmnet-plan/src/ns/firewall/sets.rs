//! The firewall's sets as plain data: for each direction and family, the three kinds of
//! lookup (`any`, `proto`, `port`) and their disjoint elements.
//!
//! # Design
//! - An enabled firewall always declares all twelve sets (`fw_{in,out}{4,6}_{any,proto,port}`)
//!   and their lookups, empty or not, so its table's *shape* (tables, chains, rules, set
//!   declarations) does not depend on the rules: a changed firewall changes set elements only,
//!   and the kernel layer can apply such a change as one element batch. A lookup in an empty
//!   set costs next to nothing and matches nothing.
//! - An element is typed ([`FwElement`]): the kernel layer encodes it for netlink, and
//!   [`FwElement::to_json`] renders it for libnftables; both come from the same value.

use std::collections::{BTreeMap, BTreeSet};

use ipnet::IpNet;
use serde_json::{Value, json};
use vmnet_model::vm::firewall::{FirewallRule, PortRange, Protocol};

use super::{IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_TCP, IPPROTO_UDP, disjoint_ports, outermost};

/// What a set's elements match besides the peer prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FwSetKind {
    /// The prefix only (`ip saddr`, rules of protocol `any`): a single-field interval set.
    Any,
    /// Prefix and IP protocol (`ip saddr . meta l4proto`): `icmp`, and `tcp`/`udp` without
    /// ports; a concatenation with intervals.
    Proto,
    /// Prefix, IP protocol and destination port range (`… . th dport`): `tcp`/`udp` with ports.
    Port,
}

impl FwSetKind {
    /// The suffix of the set's name.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Any => "any",
            Self::Proto => "proto",
            Self::Port => "port",
        }
    }
}

/// One set element: the peer prefix, and the IP protocol (`Proto`, `Port`) and the destination
/// port range (`Port`) of its kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FwElement {
    /// The peer's prefix (the source inbound, the destination outbound).
    pub prefix: IpNet,
    /// The IP protocol number (6, 17, 1 in IPv4 sets, 58 in IPv6 sets).
    pub l4proto: Option<u8>,
    /// The inclusive destination port range.
    pub ports: Option<PortRange>,
}

/// One firewall set of a VM's table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FwSet {
    /// `fw_<in|out><4|6>_<kind>`.
    pub name: String,
    /// IPv4 (`ipv4_addr`) or IPv6 (`ipv6_addr`) prefixes.
    pub v4: bool,
    /// What the elements match.
    pub kind: FwSetKind,
    /// The elements, disjoint (an interval set refuses overlaps), in a stable order.
    pub elements: Vec<FwElement>,
}

/// The nft name of an IP protocol number the firewall uses.
fn l4_name(proto: u8) -> Value {
    match proto {
        IPPROTO_TCP => json!("tcp"),
        IPPROTO_UDP => json!("udp"),
        IPPROTO_ICMP => json!("icmp"),
        IPPROTO_ICMPV6 => json!("ipv6-icmp"),
        other => json!(other),
    }
}

/// The IP protocol number of a rule's protocol in one family (`None` for `any`).
fn l4_number(p: Protocol, v4: bool) -> Option<u8> {
    match (p, v4) {
        (Protocol::Tcp, _) => Some(IPPROTO_TCP),
        (Protocol::Udp, _) => Some(IPPROTO_UDP),
        (Protocol::Icmp, true) => Some(IPPROTO_ICMP),
        (Protocol::Icmp, false) => Some(IPPROTO_ICMPV6),
        (Protocol::Any, _) => None,
    }
}

impl FwElement {
    /// The element as libnftables JSON: a prefix (an address when full length), concatenated
    /// with the protocol name and the port (or port range) of its kind.
    #[must_use]
    pub fn to_json(&self) -> Value {
        let n = &self.prefix;
        let prefix = if n.prefix_len() == n.max_prefix_len() {
            Value::String(n.addr().to_string())
        } else {
            json!({"prefix": {"addr": n.network().to_string(), "len": n.prefix_len()}})
        };
        let Some(proto) = self.l4proto else {
            return prefix;
        };
        let mut parts = vec![prefix, l4_name(proto)];
        if let Some(p) = self.ports {
            parts.push(if p.first == p.last {
                json!(p.first)
            } else {
                json!({"range": [p.first, p.last]})
            });
        }
        json!({"concat": parts})
    }
}

/// The three sets of one direction (`dir`: `in` or `out`) and family, from that direction's
/// rules: `any` the outermost prefixes of `any` rules; `proto` per protocol the outermost
/// prefixes; `port` per protocol the disjoint port ranges of each prefix.
fn sets_of(dir: &str, rules: &[FirewallRule], v4: bool) -> [FwSet; 3] {
    let mut any = BTreeSet::new();
    let mut proto: BTreeMap<u8, BTreeSet<IpNet>> = BTreeMap::new();
    let mut port: BTreeMap<u8, BTreeMap<IpNet, Vec<PortRange>>> = BTreeMap::new();
    for r in rules {
        for n in r
            .prefixes
            .iter()
            .filter(|n| matches!(n, IpNet::V4(_)) == v4)
        {
            match (l4_number(r.protocol, v4), r.ports) {
                (None, _) => {
                    any.insert(*n);
                }
                (Some(p), None) => {
                    proto.entry(p).or_default().insert(*n);
                }
                (Some(p), Some(ports)) => port
                    .entry(p)
                    .or_default()
                    .entry(*n)
                    .or_default()
                    .push(ports),
            }
        }
    }
    let fam = if v4 { "4" } else { "6" };
    let set = |kind: FwSetKind, elements: Vec<FwElement>| FwSet {
        name: format!("fw_{dir}{fam}_{}", kind.name()),
        v4,
        kind,
        elements,
    };
    let any = outermost(&any)
        .into_iter()
        .map(|prefix| FwElement {
            prefix,
            l4proto: None,
            ports: None,
        })
        .collect();
    let proto = proto
        .iter()
        .flat_map(|(p, ps)| {
            outermost(ps).into_iter().map(|prefix| FwElement {
                prefix,
                l4proto: Some(*p),
                ports: None,
            })
        })
        .collect();
    let port = port
        .iter()
        .flat_map(|(p, by)| {
            disjoint_ports(by).into_iter().map(|(prefix, r)| FwElement {
                prefix,
                l4proto: Some(*p),
                ports: Some(r),
            })
        })
        .collect();
    [
        set(FwSetKind::Any, any),
        set(FwSetKind::Proto, proto),
        set(FwSetKind::Port, port),
    ]
}

/// All twelve sets of a firewall, in a fixed order: inbound IPv4, inbound IPv6, outbound IPv4,
/// outbound IPv6, each `any`, `proto`, `port`.
#[must_use]
pub fn sets(inbound: &[FirewallRule], outbound: &[FirewallRule]) -> Vec<FwSet> {
    let mut out = Vec::with_capacity(12);
    for (dir, rules) in [("in", inbound), ("out", outbound)] {
        for v4 in [true, false] {
            out.extend(sets_of(dir, rules, v4));
        }
    }
    out
}
