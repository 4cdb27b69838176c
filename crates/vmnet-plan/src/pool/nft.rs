//! bcd's three nftables tables as nft JSON (spec: "bcd's nftables tables").
//!
//! # Design
//! The rules are fixed; everything per tap lives in named sets and verdict maps of
//! `bridge bcd_instances`, keyed by the tap name:
//!
//! | set / map | type | holds |
//! | --- | --- | --- |
//! | `taps` | `ifname` | every instance tap (a `bc*` port not in it sends and receives nothing) |
//! | `tap_mac` | `ifname . ether_addr` | the NIC's MAC (Ethernet source and ARP sender) |
//! | `tap_ip4` | `ifname . ipv4_addr` | the NIC's IPv4 addresses (IP source and ARP sender) |
//! | `tap_ip6` | `ifname . ipv6_addr` | the NIC's IPv6 addresses and its EUI-64 link-local address |
//! | `ip4_unchecked` | `ifname` | NICs without an IPv4 address (DHCP elsewhere): IPv4 source not checked |
//! | `sandbox_taps` | `ifname` | sandbox instances: inbound tcp/22 only from `host_all4`/`host_all6` |
//! | `in_policy`, `out_policy` | `ifname : verdict` | `none` → `drop`; `private` → `jump private_out` / `jump private_in` |
//! | `host_block4/6` | address | the host's own addresses minus the gateways: guests may not reach them |
//! | `host_all4/6` | address | all of the host's own addresses (the "from the host" of the SSH rule) |
//! | `host_gw4/6` | address | the gateways among the host's own addresses: guests reach them for ICMP and DNS (port 53) only |
//! | `leased4` | `ipv4_addr` | every tap's IPv4 addresses (a NIC without one may not send from them) |
//! | `reserved4` | `ipv4_addr` | the host's IPv4 addresses and the gateways (likewise) |
//!
//! Chains: `prerouting` (bridge hook, priority -200) sends frames from `bc*` ports to
//! `from_tap`; `postrouting` (priority -200) sends frames to `bc*` ports to `to_tap`. See
//! [`rules`] for the rules in order. `inet bcd_taps` and `arp bcd_taps` are the backstop for taps
//! off their bridge.
//!
//! A full replace ([`render_full`]) is one batch: for each table `add table; delete table; add
//! table; …` so it applies atomically whatever existed. With no instance NIC the two backstop
//! tables are only deleted (`add; delete`). Adding or removing one instance
//! ([`render_instance`]) is one batch of element adds or deletes: its size does not depend on
//! how many instances exist.
//!
//! # Limitations
//! Only EUI-64 link-local IPv6 addresses pass the source check (stable-privacy link-local
//! addresses are dropped). Neighbour advertisement target addresses (and their target
//! link-layer option) are checked by the tap guard only: nft 1.0.6 cannot match a raw 128-bit
//! payload against an `ipv6_addr` set (the IPv6 source is checked here). The host address sets
//! and gateways change only with a full replace.

pub mod rules;

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use serde_json::{Value, json};
use vmnet_model::ValidationError;
use vmnet_model::nic::{IfName, InstanceSpec, MacAddr, NetworkPolicy, NodeSpec};

/// Name of the bridge-family table.
pub const INSTANCES_TABLE: &str = "bcd_instances";
/// Name of the inet- and arp-family backstop tables.
pub const TAPS_TABLE: &str = "bcd_taps";
/// The skb mark bit chain `to_tap` sets on every frame it lets through to a tap. The tap guard's
/// egress program (`vmnet_kernel::pool::guard`) passes only frames carrying it and clears it,
/// so when the bcd tables are gone (a flushed ruleset) nothing reaches a guest. Other mark bits
/// are kept.
pub const GUARD_MARK: u32 = 0x1000_0000;
/// The three tables as `(family, name)`.
pub const OWNED_TABLES: [(&str, &str); 3] = [
    ("bridge", INSTANCES_TABLE),
    ("inet", TAPS_TABLE),
    ("arp", TAPS_TABLE),
];

/// The host's own addresses and the gateways among them guests may reach.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostAddrs {
    /// Every address of the host (bridge, uplink, loopback-free).
    pub own: Vec<IpAddr>,
    /// Gateways guests use; exempt from the host-address drop.
    pub gateways: Vec<IpAddr>,
}

/// The per-tap state of one NIC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TapEntry {
    /// The tap name.
    pub tap: IfName,
    /// The NIC's MAC.
    pub mac: MacAddr,
    /// The NIC's IPv4 addresses.
    pub ip4: Vec<Ipv4Addr>,
    /// The NIC's IPv6 addresses plus its EUI-64 link-local address.
    pub ip6: Vec<Ipv6Addr>,
    /// The instance's policy.
    pub policy: NetworkPolicy,
    /// Whether the instance is a sandbox.
    pub sandbox: bool,
}

impl TapEntry {
    /// Whether the NIC has no IPv4 address (its IPv4 source is not checked).
    #[must_use]
    pub fn ip4_unchecked(&self) -> bool {
        self.ip4.is_empty()
    }
}

/// The desired state of the three tables on one host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Firewall {
    /// Every instance NIC, sorted by tap name.
    pub taps: Vec<TapEntry>,
    /// The host's addresses.
    pub host: HostAddrs,
}

/// The tap entries of one instance (one per NIC).
///
/// # Errors
/// `INVALID_INPUT` when the instance does not validate.
pub fn tap_entries(inst: &InstanceSpec) -> Result<Vec<TapEntry>, ValidationError> {
    inst.validate()?;
    let taps = inst.tap_names()?;
    Ok(inst
        .nics
        .iter()
        .zip(taps)
        .map(|(nic, tap)| {
            let mut ip4 = Vec::new();
            let mut ip6 = vec![nic.mac.link_local_v6()];
            for a in &nic.addresses {
                match a.addr() {
                    IpAddr::V4(v) => ip4.push(v),
                    IpAddr::V6(v) if !ip6.contains(&v) => ip6.push(v),
                    IpAddr::V6(_) => {}
                }
            }
            TapEntry {
                tap,
                mac: nic.mac,
                ip4,
                ip6,
                policy: inst.policy,
                sandbox: inst.sandbox,
            }
        })
        .collect())
}

/// The desired firewall of a host running `node`.
///
/// # Errors
/// `INVALID_INPUT` when the node spec does not validate.
pub fn plan(node: &NodeSpec, host: &HostAddrs) -> Result<Firewall, ValidationError> {
    node.validate()?;
    let mut taps = Vec::new();
    for inst in &node.instances {
        taps.extend(tap_entries(inst)?);
    }
    taps.sort_by(|a, b| a.tap.cmp(&b.tap));
    Ok(Firewall {
        taps,
        host: host.clone(),
    })
}

fn obj(kind: &str, body: Value) -> Value {
    rules::object([(kind, body)])
}

fn table(family: &str, name: &str) -> Value {
    obj("table", json!({ "family": family, "name": name }))
}

fn base_chain(family: &str, tbl: &str, name: &str, hook: &str, prio: i32) -> Value {
    obj(
        "chain",
        json!({ "family": family, "table": tbl, "name": name, "type": "filter", "hook": hook,
                "prio": prio, "policy": "accept" }),
    )
}

fn chain(family: &str, tbl: &str, name: &str) -> Value {
    obj(
        "chain",
        json!({ "family": family, "table": tbl, "name": name }),
    )
}

fn rule(family: &str, tbl: &str, chain: &str, expr: Vec<Value>) -> Value {
    let body = rules::object([
        ("family", family.into()),
        ("table", tbl.into()),
        ("chain", chain.into()),
        ("expr", Value::Array(expr)),
    ]);
    obj("rule", body)
}

/// The sets and maps of `bridge bcd_instances`: `(name, type, is_map)`.
const SETS: [(&str, &[&str], bool); 16] = [
    ("taps", &["ifname"], false),
    ("tap_mac", &["ifname", "ether_addr"], false),
    ("tap_ip4", &["ifname", "ipv4_addr"], false),
    ("tap_ip6", &["ifname", "ipv6_addr"], false),
    ("ip4_unchecked", &["ifname"], false),
    ("sandbox_taps", &["ifname"], false),
    ("in_policy", &["ifname"], true),
    ("out_policy", &["ifname"], true),
    ("host_block4", &["ipv4_addr"], false),
    ("host_block6", &["ipv6_addr"], false),
    ("host_all4", &["ipv4_addr"], false),
    ("host_all6", &["ipv6_addr"], false),
    ("leased4", &["ipv4_addr"], false),
    ("reserved4", &["ipv4_addr"], false),
    ("host_gw4", &["ipv4_addr"], false),
    ("host_gw6", &["ipv6_addr"], false),
];

fn set_decl(name: &str, ty: &[&str], is_map: bool) -> Value {
    let ty = if ty.len() == 1 {
        json!(ty[0])
    } else {
        json!(ty)
    };
    let mut body =
        json!({ "family": "bridge", "table": INSTANCES_TABLE, "name": name, "type": ty });
    if is_map {
        body["map"] = json!("verdict");
        obj("map", body)
    } else {
        obj("set", body)
    }
}

fn concat(tap: &IfName, v: &str) -> Value {
    json!({ "concat": [tap.as_str(), v] })
}

/// The sets and maps of `bridge bcd_instances` that hold per-tap elements (the others hold the
/// host's addresses).
pub const TAP_SETS: [&str; 9] = [
    "taps",
    "tap_mac",
    "tap_ip4",
    "tap_ip6",
    "ip4_unchecked",
    "sandbox_taps",
    "in_policy",
    "out_policy",
    "leased4",
];

/// The elements each set and map of `bridge bcd_instances` gets for `taps`, by set name.
fn tap_elements(taps: &[TapEntry]) -> Vec<(&'static str, Vec<Value>)> {
    let mut out: Vec<(&'static str, Vec<Value>)> =
        TAP_SETS.iter().map(|n| (*n, Vec::new())).collect();
    let mut push = |name: &str, v: Value| {
        if let Some((_, list)) = out.iter_mut().find(|(n, _)| *n == name) {
            list.push(v);
        }
    };
    for t in taps {
        push("taps", json!(t.tap.as_str()));
        push("tap_mac", concat(&t.tap, &t.mac.to_string()));
        for a in &t.ip4 {
            push("tap_ip4", concat(&t.tap, &a.to_string()));
            push("leased4", json!(a.to_string()));
        }
        for a in &t.ip6 {
            push("tap_ip6", concat(&t.tap, &a.to_string()));
        }
        if t.ip4_unchecked() {
            push("ip4_unchecked", json!(t.tap.as_str()));
        }
        if t.sandbox {
            push("sandbox_taps", json!(t.tap.as_str()));
        }
        match t.policy {
            NetworkPolicy::Public => {}
            NetworkPolicy::None => {
                push("in_policy", json!([t.tap.as_str(), { "drop": null }]));
                push("out_policy", json!([t.tap.as_str(), { "drop": null }]));
            }
            NetworkPolicy::Private => {
                push(
                    "in_policy",
                    json!([t.tap.as_str(), { "jump": { "target": "private_out" } }]),
                );
                push(
                    "out_policy",
                    json!([t.tap.as_str(), { "jump": { "target": "private_in" } }]),
                );
            }
        }
    }
    out
}

fn host_elements(host: &HostAddrs) -> Vec<(&'static str, Vec<Value>)> {
    let uniq = |it: Vec<String>| -> Vec<Value> {
        it.into_iter()
            .collect::<BTreeSet<_>>()
            .into_iter()
            .map(Value::String)
            .collect()
    };
    let blocked = |v4: bool| {
        uniq(
            host.own
                .iter()
                .filter(|a| a.is_ipv4() == v4 && !host.gateways.contains(a))
                .map(ToString::to_string)
                .collect(),
        )
    };
    let all = |v4: bool| {
        uniq(
            host.own
                .iter()
                .filter(|a| a.is_ipv4() == v4)
                .map(ToString::to_string)
                .collect(),
        )
    };
    let owned_gateways = |v4: bool| {
        uniq(
            host.own
                .iter()
                .filter(|a| a.is_ipv4() == v4 && host.gateways.contains(a))
                .map(ToString::to_string)
                .collect(),
        )
    };
    let reserved4 = uniq(
        host.own
            .iter()
            .chain(&host.gateways)
            .filter(|a| a.is_ipv4())
            .map(ToString::to_string)
            .collect(),
    );
    vec![
        ("host_block4", blocked(true)),
        ("host_block6", blocked(false)),
        ("host_all4", all(true)),
        ("host_all6", all(false)),
        ("reserved4", reserved4),
        ("host_gw4", owned_gateways(true)),
        ("host_gw6", owned_gateways(false)),
    ]
}

fn elements_cmd(verb: &str, name: &str, elems: Vec<Value>) -> Value {
    let body = rules::object([
        ("family", "bridge".into()),
        ("table", INSTANCES_TABLE.into()),
        ("name", name.into()),
        ("elem", Value::Array(elems)),
    ]);
    obj(verb, obj("element", body))
}

/// The full replace of all three tables as one nft JSON batch (`{"nftables":[…]}`).
///
/// With at least one tap the backstop tables are loaded; with none they are deleted and not
/// loaded again (the bridge table stays, with empty tap sets).
#[must_use]
pub fn render_full(fw: &Firewall) -> Value {
    let mut cmds: Vec<Value> = Vec::new();
    let add = |v: Value| json!({ "add": v });
    let b = "bridge";
    let t = INSTANCES_TABLE;
    cmds.push(add(table(b, t)));
    cmds.push(json!({ "delete": table(b, t) }));
    cmds.push(add(table(b, t)));
    for (name, ty, is_map) in SETS {
        cmds.push(add(set_decl(name, ty, is_map)));
    }
    for c in ["from_tap", "to_tap", "private_out", "private_in"] {
        cmds.push(add(chain(b, t, c)));
    }
    cmds.push(add(base_chain(b, t, "prerouting", "prerouting", -200)));
    cmds.push(add(base_chain(b, t, "postrouting", "postrouting", -200)));
    let rulesets = [
        ("from_tap", rules::from_tap()),
        ("to_tap", rules::to_tap()),
        ("private_out", rules::private_out()),
        ("private_in", rules::private_in()),
        (
            "prerouting",
            vec![vec![
                rules::m("==", rules::meta("iifname"), json!("bc*")),
                json!({"jump": {"target": "from_tap"}}),
            ]],
        ),
        (
            "postrouting",
            vec![vec![
                rules::m("==", rules::meta("oifname"), json!("bc*")),
                json!({"jump": {"target": "to_tap"}}),
            ]],
        ),
    ];
    for (c, rs) in rulesets {
        for r in rs {
            cmds.push(add(rule(b, t, c, r)));
        }
    }
    for (name, elems) in tap_elements(&fw.taps)
        .into_iter()
        .chain(host_elements(&fw.host))
    {
        if !elems.is_empty() {
            cmds.push(elements_cmd("add", name, elems));
        }
    }
    for fam in ["inet", "arp"] {
        cmds.push(add(table(fam, TAPS_TABLE)));
        cmds.push(json!({ "delete": table(fam, TAPS_TABLE) }));
    }
    if !fw.taps.is_empty() {
        // The backstop: (family, its base chains, then each chain's wildcard drop by
        // interface-name key), in the order the spec lists them.
        type Backstop = (
            &'static str,
            &'static [&'static str],
            &'static [(&'static str, &'static str)],
        );
        const BACKSTOP: [Backstop; 2] = [
            (
                "inet",
                &["input", "forward", "output"],
                &[
                    ("input", "iifname"),
                    ("forward", "iifname"),
                    ("forward", "oifname"),
                    ("output", "oifname"),
                ],
            ),
            (
                "arp",
                &["input", "output"],
                &[("input", "iifname"), ("output", "oifname")],
            ),
        ];
        for (fam, chains, drops) in BACKSTOP {
            cmds.push(add(table(fam, TAPS_TABLE)));
            for chain in chains {
                cmds.push(add(base_chain(fam, TAPS_TABLE, chain, chain, 0)));
            }
            for (chain, key) in drops {
                cmds.push(add(rule(
                    fam,
                    TAPS_TABLE,
                    chain,
                    rules::tap_wildcard_drop(key),
                )));
            }
        }
    }
    json!({ "nftables": cmds })
}

/// Whether adding or removing taps needs a full replace rather than element changes: when the
/// host goes from no tap to some, or from some to none (the backstop tables appear or go).
#[must_use]
pub fn needs_full_replace(before: &Firewall, after: &Firewall) -> bool {
    before.taps.is_empty() != after.taps.is_empty() || before.host != after.host
}

/// Whether to add or delete elements in [`render_instance`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// `add element` for every set entry of the taps.
    Add,
    /// `delete element` for every set entry of the taps.
    Remove,
}

/// One instance's taps added or removed: one batch of element commands, its size independent
/// of how many other taps exist. Apply it only while the tables exist and hold (for
/// [`Change::Remove`]) exactly these entries.
#[must_use]
pub fn render_instance(taps: &[TapEntry], change: Change) -> Value {
    let verb = match change {
        Change::Add => "add",
        Change::Remove => "delete",
    };
    let cmds: Vec<Value> = tap_elements(taps)
        .into_iter()
        .filter(|(_, e)| !e.is_empty())
        .map(|(name, elems)| elements_cmd(verb, name, elems))
        .collect();
    json!({ "nftables": cmds })
}

#[cfg(test)]
mod tests;
