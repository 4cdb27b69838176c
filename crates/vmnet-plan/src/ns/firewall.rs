//! The per-VM firewall in the VM's netns table (spec "Firewall"; design note "Where things
//! happen": in the VM namespace, on what is forwarded between the tap and the veth, after DNAT).
//!
//! # Design
//! The filter is three more chains in the VM's table `inet <prefix>`, so it is replaced in the
//! same transaction as the rest of that table:
//!
//! - `filter` (filter hook forward, priority 0, after the netns DNAT at prerouting, so an
//!   inbound rule sees the guest's port; policy accept): `ct state established,related accept`,
//!   then `iifname <veth> oifname <tap> jump fw_in` and `iifname <tap> oifname <veth> jump
//!   fw_out`. Nothing else is forwarded; the guest link's own traffic (ARP, NDP, the metadata
//!   service: input and output of the netns) never reaches a forward hook.
//! - `fw_in` / `fw_out`: one accept rule per configured rule and prefix, in the configured
//!   order ([`rules`]), then `drop`. The peer address is the source inbound and the destination
//!   outbound; `icmp` is `meta l4proto icmp` for an IPv4 prefix and `ipv6-icmp` for an IPv6 one.
//!   `meta l4proto` and `th`/`tcp`/`udp dport` are the layer-4 protocol and header after any
//!   IPv6 extension header, so an ICMPv6 echo with a hop-by-hop header is matched by an `icmp`
//!   rule.
//! - The table's *shape* (everything but the rules of `fw_in` and `fw_out`) does not depend on
//!   the rules: a changed firewall changes those two chains only, and the kernel layer can apply
//!   that as one small batch (flush both chains, add the rules) without libnftables.
//!
//! [`FirewallPlan::admits`] is the same decision on one connection, for removing the conntrack
//! entries a tightened firewall would not admit (the kernel layer).
//!
//! # Limitations
//! A VM without a mesh address has no veth, forwards nothing and gets no filter.

use std::net::{IpAddr, Ipv4Addr};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use vmnet_model::vm::firewall::{Firewall, FirewallRule, Protocol};

pub mod rules;

use rules::{CHAIN_IN, CHAIN_OUT, FwRule};

/// IP protocol numbers the firewall matches on.
pub const IPPROTO_ICMP: u8 = 1;
/// TCP.
pub const IPPROTO_TCP: u8 = 6;
/// UDP.
pub const IPPROTO_UDP: u8 = 17;
/// ICMPv6.
pub const IPPROTO_ICMPV6: u8 = 58;

/// Which way a connection was opened, seen from the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FlowDirection {
    /// To the guest (its peer is the source).
    Inbound,
    /// From the guest (its peer is the destination).
    Outbound,
}

/// The firewall part of a VM's plan: present only when the firewall is enabled and the VM has a
/// veth (something is forwarded).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FirewallPlan {
    /// The inbound rules, as configured.
    pub inbound: Vec<FirewallRule>,
    /// The outbound rules, as configured.
    pub outbound: Vec<FirewallRule>,
    /// The guest's own addresses (172.16.0.2, the mesh address, a routed public block): a
    /// connection from one of them is outbound, one answered by one of them inbound.
    pub guest: Vec<IpNet>,
    /// Addresses of the netns itself (the tap gateway, the veth transit address), never a
    /// forwarded connection's peer.
    pub local: Vec<IpAddr>,
}

impl FirewallPlan {
    /// Whether a new connection `dir` with peer address `peer`, IP protocol `l4proto` and
    /// destination port `dport` (tcp and udp) passes the rules.
    #[must_use]
    pub fn admits(
        &self,
        dir: FlowDirection,
        peer: IpAddr,
        l4proto: u8,
        dport: Option<u16>,
    ) -> bool {
        let rules = match dir {
            FlowDirection::Inbound => &self.inbound,
            FlowDirection::Outbound => &self.outbound,
        };
        rules.iter().any(|r| {
            let proto_ok = match r.protocol {
                Protocol::Any => true,
                Protocol::Tcp => l4proto == IPPROTO_TCP,
                Protocol::Udp => l4proto == IPPROTO_UDP,
                Protocol::Icmp => matches!(
                    (peer, l4proto),
                    (IpAddr::V4(_), IPPROTO_ICMP) | (IpAddr::V6(_), IPPROTO_ICMPV6)
                ),
            };
            let port_ok = match r.ports {
                None => true,
                Some(p) => dport.is_some_and(|d| (p.first..=p.last).contains(&d)),
            };
            proto_ok && port_ok && r.prefixes.iter().any(|n| n.contains(&peer))
        })
    }

    /// The accept rules of `fw_in` and `fw_out` ([`rules::rules`]).
    #[must_use]
    pub fn rules(&self) -> Vec<FwRule> {
        rules::rules(&self.inbound, &self.outbound)
    }

    /// Which way a tracked connection (original source and destination, and the source of its
    /// replies) runs through the filter, or `None` when it is not forwarded between the tap and
    /// the veth (to or from the netns itself, link-local, multicast).
    #[must_use]
    pub fn direction(
        &self,
        orig_src: IpAddr,
        orig_dst: IpAddr,
        reply_src: IpAddr,
    ) -> Option<(FlowDirection, IpAddr)> {
        let guest = |a: &IpAddr| self.guest.iter().any(|n| n.contains(a));
        let local = |a: &IpAddr| {
            self.local.contains(a)
                || match a {
                    IpAddr::V4(v) => v.is_link_local() || v.is_multicast() || v.is_broadcast(),
                    IpAddr::V6(v) => v.is_unicast_link_local() || v.is_multicast(),
                }
        };
        if guest(&orig_src) {
            return (!local(&orig_dst)).then_some((FlowDirection::Outbound, orig_dst));
        }
        if guest(&reply_src) && !local(&orig_src) {
            return Some((FlowDirection::Inbound, orig_src));
        }
        None
    }
}

/// The firewall part of the plan for `fw` (`None` when disabled), with the guest's and the
/// netns's own addresses.
#[must_use]
pub fn plan(fw: Option<&Firewall>, guest: Vec<IpNet>, local: Vec<IpAddr>) -> Option<FirewallPlan> {
    let fw = fw.filter(|f| f.enabled)?;
    Some(FirewallPlan {
        inbound: fw.inbound.clone(),
        outbound: fw.outbound.clone(),
        guest,
        local,
    })
}

/// The nft commands of the filter (chains and rules) in table `inet <table>`, for a VM whose
/// veth end in the netns is `peer` and whose tap is `tap`; appended to the VM table's
/// transaction.
#[must_use]
pub fn nft_commands(table: &str, peer: &str, tap: &str, fw: &FirewallPlan) -> Vec<Value> {
    let t = table;
    let rule = |chain: &str, expr: Value| json!({"add": {"rule": {"family": "inet", "table": t, "chain": chain, "expr": expr}}});
    let ifs = |iif: &str, oif: &str, target: &str| {
        json!([
            {"match": {"op": "==", "left": {"meta": {"key": "iifname"}}, "right": iif}},
            {"match": {"op": "==", "left": {"meta": {"key": "oifname"}}, "right": oif}},
            {"jump": {"target": target}}
        ])
    };
    let mut cmds = vec![
        json!({"add": {"chain": {"family": "inet", "table": t, "name": "filter",
            "type": "filter", "hook": "forward", "prio": 0, "policy": "accept"}}}),
        json!({"add": {"chain": {"family": "inet", "table": t, "name": "fw_in"}}}),
        json!({"add": {"chain": {"family": "inet", "table": t, "name": "fw_out"}}}),
        rule(
            "filter",
            json!([{"match": {"op": "in", "left": {"ct": {"key": "state"}},
                "right": ["established", "related"]}}, {"accept": null}]),
        ),
        rule("filter", ifs(peer, tap, "fw_in")),
        rule("filter", ifs(tap, peer, "fw_out")),
    ];
    let accepts = fw.rules();
    for (chain, dir) in [
        (CHAIN_IN, FlowDirection::Inbound),
        (CHAIN_OUT, FlowDirection::Outbound),
    ] {
        cmds.extend(
            accepts
                .iter()
                .filter(|r| r.direction == dir)
                .map(|r| rule(chain, r.to_json())),
        );
        cmds.push(rule(chain, json!([{"drop": null}])));
    }
    cmds
}

/// The netns's own addresses a forwarded connection never has as its peer: the tap gateway and
/// the veth's transit address.
#[must_use]
pub fn local_addresses(gateway: Ipv4Addr, transit: Ipv4Addr) -> Vec<IpAddr> {
    vec![IpAddr::V4(gateway), IpAddr::V4(transit)]
}
