//! Public addresses in namespace mode (spec "Routes", the public address table; "Design notes":
//! tagged rules for exact cleanup).
//!
//! # Design
//! - One host table `inet <prefix>_pub` ([`host_ruleset`]) holds fixed rules and four maps; a VM's
//!   public addresses are map elements only, so adding, changing or removing one VM is one small
//!   element transaction that touches no other VM's elements and costs the same at any number
//!   of VMs:
//!   - `dnat4` public IPv4 → the VM's netns transit address (prerouting and output: DNAT; the
//!     netns then DNATs its transit address to the guest, 172.16.0.2);
//!   - `snat4` netns transit address → public IPv4 (postrouting, before the transit masquerade:
//!     SNAT when the connection's *original* destination is outside the transit range, so a VM
//!     reaching another VM's public address is seen with its own);
//!   - `dnat6` public /128 → the guest's mesh address, `snat6` mesh address → public /128 (the same
//!     test on the original destination, outside `fdaa::/16`);
//!   - `own6` netns transit address → mesh address: which IPv6 mapping belongs to the VM, keyed
//!     by what derives from the user id alone, so a change or removal finds the VM's previous
//!     elements with a few lookups, never a listing.
//!
//!   `snat4` is keyed by the transit address for the same reason.
//! - A routed block is not translated: the host routes it to the VM's veth and the netns routes it
//!   on-link on the tap, so the guest configures its own addresses in it.
//! - The public IPv4 also gets a host route `/32 via <netns transit> dev <host veth>`: host
//!   processes (DNAT in the output chain) reach it, and the kernel answers proxy ARP for an
//!   address only when its route leaves through another link than the uplink.
//! - With `public_neighbors: proxy`, the host answers ARP/NDP on the uplink for each public
//!   address (the /128, or the first [`MAX_PROXY_BLOCK_ADDRESSES`] addresses of a block).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use vmnet_model::vm::VmConfig;

use super::{
    MAIN_TABLE, NsSettings, PEER_LINK_LOCAL, PlannedRoute, RouteKind, TapPlan, VethPlan, names,
};

/// The public part of a VM's plan (`None` without public fields); adds its routes to `ns` and
/// `host` ([`public_routes`]).
pub(super) fn plan(
    cfg: &VmConfig,
    settings: &NsSettings,
    v: &VethPlan,
    tap: &TapPlan,
    mesh: Ipv6Addr,
    ns: &mut Vec<PlannedRoute>,
    host: &mut Vec<PlannedRoute>,
) -> Option<PublicPlan> {
    if cfg.public_ipv4.is_none() && cfg.public_ipv6.is_none() {
        return None;
    }
    public_routes(cfg, v, tap, ns, host);
    let p = settings.name_prefix.as_str();
    Some(PublicPlan {
        table: names::pub_nft_table(p),
        transit: v.peer_ipv4.addr(),
        mesh,
        ipv4: cfg.public_ipv4,
        ipv6: cfg.public_ipv6_mapped(),
        ipv6_block: cfg.public_ipv6_block(),
        proxy: settings
            .uplink
            .clone()
            .filter(|_| settings.public_neighbors == PublicNeighbors::Proxy)
            .map(|u| {
                (
                    u,
                    proxy_addresses(
                        cfg.public_ipv4,
                        cfg.public_ipv6_mapped(),
                        cfg.public_ipv6_block(),
                    ),
                )
            }),
    })
}

/// Adds the routes of the public addresses: on the host the public IPv4 `/32 via <netns transit>
/// dev <host veth>` and the block `via fe80::2 dev <host veth>`; in the netns the block on-link
/// on the tap, in main and in the inbound table (so traffic from the host reaches the guest's
/// own address in the block by neighbour discovery).
pub(super) fn public_routes(
    cfg: &VmConfig,
    v: &VethPlan,
    tap: &TapPlan,
    ns: &mut Vec<PlannedRoute>,
    host: &mut Vec<PlannedRoute>,
) {
    if let Some(a) = cfg.public_ipv4 {
        host.push(PlannedRoute {
            table: MAIN_TABLE,
            destination: IpNet::V4(Ipv4Net::new(a, 32).expect("valid")),
            kind: RouteKind::Via {
                gateway: IpAddr::V4(v.peer_ipv4.addr()),
                dev: v.host_name.clone(),
                onlink: false,
            },
        });
    }
    if let Some(b) = cfg.public_ipv6_block() {
        host.push(PlannedRoute {
            table: MAIN_TABLE,
            destination: IpNet::V6(b),
            kind: RouteKind::Via {
                gateway: IpAddr::V6(PEER_LINK_LOCAL),
                dev: v.host_name.clone(),
                onlink: false,
            },
        });
        for table in [MAIN_TABLE, names::NS_INBOUND_TABLE] {
            ns.push(PlannedRoute {
                table,
                destination: IpNet::V6(b),
                kind: RouteKind::Dev {
                    dev: tap.name.clone(),
                },
            });
        }
    }
    ns.sort();
    host.sort();
}

/// How the upstream reaches public addresses (`vmnet serve --public-neighbors`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PublicNeighbors {
    /// The provider routes the addresses to the host.
    #[default]
    Routed,
    /// The addresses are on the uplink's subnet: the host answers ARP/NDP for them there.
    Proxy,
}

impl PublicNeighbors {
    /// `routed` or `proxy`.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Routed => "routed",
            Self::Proxy => "proxy",
        }
    }
}

impl std::fmt::Display for PublicNeighbors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for PublicNeighbors {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "routed" => Ok(Self::Routed),
            "proxy" => Ok(Self::Proxy),
            _ => Err(format!(
                "public neighbors {s:?} is not one of routed, proxy"
            )),
        }
    }
}

/// The most proxy neighbour entries one routed block gets in proxy mode (its first addresses).
pub const MAX_PROXY_BLOCK_ADDRESSES: u32 = 16;

/// The maps of the host table.
pub mod maps {
    /// Public IPv4 → netns transit address.
    pub const DNAT4: &str = "dnat4";
    /// Netns transit address → public IPv4.
    pub const SNAT4: &str = "snat4";
    /// Public /128 → mesh address.
    pub const DNAT6: &str = "dnat6";
    /// Mesh address → public /128.
    pub const SNAT6: &str = "snat6";
    /// Netns transit address → mesh address (ownership, for exact cleanup).
    pub const OWN6: &str = "own6";
}

/// One VM's public addresses as the host sees them (pure data, part of the VM plan).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublicPlan {
    /// The host table holding the maps (`<prefix>_pub`).
    pub table: String,
    /// The netns end's transit address: the DNAT target and the SNAT key of IPv4.
    pub transit: Ipv4Addr,
    /// The mesh address: the DNAT target of the mapped IPv6.
    pub mesh: Ipv6Addr,
    /// The public IPv4.
    pub ipv4: Option<Ipv4Addr>,
    /// The mapped public IPv6 (a /128).
    pub ipv6: Option<Ipv6Addr>,
    /// The routed public IPv6 block.
    pub ipv6_block: Option<Ipv6Net>,
    /// The uplink and the addresses the host answers ARP/NDP for there (proxy mode), sorted.
    pub proxy: Option<(String, Vec<IpAddr>)>,
}

/// The elements one VM owns, map by map (key, value), as in a listing.
pub type Elements = Vec<(&'static str, String, String)>;

impl PublicPlan {
    /// The planned elements of this VM.
    #[must_use]
    pub fn elements(&self) -> Elements {
        let mut e = Vec::new();
        let t = self.transit.to_string();
        if let Some(a) = self.ipv4 {
            e.push((maps::DNAT4, a.to_string(), t.clone()));
            e.push((maps::SNAT4, t.clone(), a.to_string()));
        }
        if let Some(a) = self.ipv6 {
            e.push((maps::DNAT6, a.to_string(), self.mesh.to_string()));
            e.push((maps::SNAT6, self.mesh.to_string(), a.to_string()));
            e.push((maps::OWN6, t, self.mesh.to_string()));
        }
        e
    }

    /// Whether the plan holds anything public.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.ipv4.is_none() && self.ipv6.is_none() && self.ipv6_block.is_none()
    }

    /// Every public address of this VM as a prefix (for conntrack and status).
    #[must_use]
    pub fn addresses(&self) -> Vec<IpAddr> {
        let mut v: Vec<IpAddr> = self.ipv4.map(IpAddr::V4).into_iter().collect();
        v.extend(self.ipv6.map(IpAddr::V6));
        v
    }
}

/// The proxy neighbour addresses of a VM: the IPv4, the /128, and the first
/// [`MAX_PROXY_BLOCK_ADDRESSES`] addresses of a block (sorted).
#[must_use]
pub fn proxy_addresses(
    ipv4: Option<Ipv4Addr>,
    ipv6: Option<Ipv6Addr>,
    block: Option<Ipv6Net>,
) -> Vec<IpAddr> {
    let mut v: Vec<IpAddr> = ipv4.map(IpAddr::V4).into_iter().collect();
    v.extend(ipv6.map(IpAddr::V6));
    if let Some(b) = block {
        v.extend(
            b.hosts()
                .take(MAX_PROXY_BLOCK_ADDRESSES as usize)
                .map(IpAddr::V6),
        );
    }
    v.sort();
    v
}

/// One `add element` or `delete element` command of the host table.
#[must_use]
pub fn element_cmd(op: &str, table: &str, map: &str, key: &str, value: Option<&str>) -> Value {
    let elem = match value {
        Some(v) => json!([[key, v]]),
        None => json!([key]),
    };
    json!({op: {"element": {"family": "inet", "table": table, "name": map, "elem": elem}}})
}

fn map_decl(table: &str, name: &str, key: &str, data: &str) -> Value {
    json!({"add": {"map": {"family": "inet", "table": table, "name": name, "type": key, "map": data}}})
}

fn chain(table: &str, name: &str, hook: &str, prio: i32) -> Value {
    json!({"add": {"chain": {"family": "inet", "table": table, "name": name,
        "type": "nat", "hook": hook, "prio": prio, "policy": "accept"}}})
}

fn dnat_rule(table: &str, chain: &str, fam: &str, map: &str) -> Value {
    json!({"add": {"rule": {"family": "inet", "table": table, "chain": chain, "expr": [
        {"dnat": {"family": fam, "addr": {"map": {"key": {"payload": {"protocol": fam, "field": "daddr"}}, "data": format!("@{map}")}}}}
    ]}}})
}

fn snat_rule(table: &str, fam: &str, map: &str, private: &Value) -> Value {
    json!({"add": {"rule": {"family": "inet", "table": table, "chain": "postrouting", "expr": [
        {"match": {"op": "!=", "left": {"ct": {"key": format!("{fam} daddr"), "dir": "original"}}, "right": private}},
        {"snat": {"family": fam, "addr": {"map": {"key": {"payload": {"protocol": fam, "field": "saddr"}}, "data": format!("@{map}")}}}}
    ]}}})
}

/// The host table of public addresses, `inet <table>`, without elements: maps, DNAT in
/// prerouting and output (priority −100), SNAT in postrouting at priority 50 (before the
/// transit masquerade at 100). The SNAT rules test the connection's original destination
/// against the transit range (IPv4) and the mesh range (IPv6). Applying it replaces the table,
/// so every VM's elements must be added again afterwards (the driver does).
#[must_use]
pub fn host_ruleset(table: &str, transit: Ipv4Net) -> Value {
    let t = json!({"table": {"family": "inet", "name": table}});
    let private4 =
        json!({"prefix": {"addr": transit.network().to_string(), "len": transit.prefix_len()}});
    let private6 = json!({"prefix": {"addr": "fdaa::", "len": 16}});
    let cmds = vec![
        json!({"add": t.clone()}),
        json!({"delete": t.clone()}),
        json!({"add": t}),
        map_decl(table, maps::DNAT4, "ipv4_addr", "ipv4_addr"),
        map_decl(table, maps::SNAT4, "ipv4_addr", "ipv4_addr"),
        map_decl(table, maps::DNAT6, "ipv6_addr", "ipv6_addr"),
        map_decl(table, maps::SNAT6, "ipv6_addr", "ipv6_addr"),
        map_decl(table, maps::OWN6, "ipv4_addr", "ipv6_addr"),
        chain(table, "prerouting", "prerouting", -100),
        dnat_rule(table, "prerouting", "ip", maps::DNAT4),
        dnat_rule(table, "prerouting", "ip6", maps::DNAT6),
        chain(table, "output", "output", -100),
        dnat_rule(table, "output", "ip", maps::DNAT4),
        dnat_rule(table, "output", "ip6", maps::DNAT6),
        chain(table, "postrouting", "postrouting", 50),
        snat_rule(table, "ip", maps::SNAT4, &private4),
        snat_rule(table, "ip6", maps::SNAT6, &private6),
    ];
    json!({"nftables": cmds})
}

/// The netns chain of the public IPv4's DNAT: present in every VM with a veth and NAT (a public
/// IPv4 needs an IPv4 route via host), so adding or removing a public IPv4 changes this chain's
/// rules only (the table keeps its shape, see
/// [`super::nft::vm_ruleset`]).
pub const NS_DNAT_CHAIN: &str = "prerouting";

/// Chain [`NS_DNAT_CHAIN`] of the netns table (nat, dstnat).
#[must_use]
pub fn ns_dnat_chain(table: &str) -> Value {
    json!({"add": {"chain": {"family": "inet", "table": table, "name": NS_DNAT_CHAIN,
        "type": "nat", "hook": "prerouting", "prio": -100, "policy": "accept"}}})
}

/// The netns rule passing the public IPv4 on to the guest, in chain [`NS_DNAT_CHAIN`]:
/// `iifname <peer> ip daddr <transit> dnat ip to <guest>`.
#[must_use]
pub fn ns_dnat_rule(table: &str, peer: &str, transit: Ipv4Addr, guest: Ipv4Addr) -> Value {
    json!({"add": {"rule": {"family": "inet", "table": table, "chain": NS_DNAT_CHAIN, "expr": [
        {"match": {"op": "==", "left": {"meta": {"key": "iifname"}}, "right": peer}},
        {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "daddr"}}, "right": transit.to_string()}},
        {"dnat": {"family": "ip", "addr": guest.to_string()}}
    ]}}})
}
