//! Unit tests of the firewall plan ([`super::firewall`]): the chains and rules in the VM table,
//! and the decision the conntrack sweep uses.

use std::net::IpAddr;

use serde_json::{Value, json};
use vmnet_model::vm::parse_vm_config;

use super::firewall::FlowDirection;
use super::*;

fn plan_of(fw: Value) -> VmPlan {
    let mut v = json!({"id": "fw", "user_id": 7, "tenant": 1, "mesh_ipv6": "fdaa:1::7",
        "network": {"routes": [{"destination": "0.0.0.0/0", "via": "host"},
                               {"destination": "::/0", "via": "host"}]}});
    if !fw.is_null() {
        v["firewall"] = fw;
    }
    let cfg = parse_vm_config(v.to_string().as_bytes()).unwrap();
    plan_vm(&cfg, &NsSettings::default()).unwrap()
}

fn cmds(p: &VmPlan) -> &Vec<Value> {
    p.nft["nftables"].as_array().unwrap()
}

/// The `add` commands of `kind` in the plan's transaction.
fn added<'a>(p: &'a VmPlan, kind: &str) -> Vec<&'a Value> {
    cmds(p)
        .iter()
        .filter_map(|c| c.get("add").and_then(|a| a.get(kind)))
        .collect()
}

fn rules_of(p: &VmPlan, chain: &str) -> Vec<Value> {
    added(p, "rule")
        .into_iter()
        .filter(|r| r["chain"] == chain)
        .map(|r| r["expr"].clone())
        .collect()
}

const EXAMPLE: &str = r#"{"enabled": true,
    "inbound": [{"protocol": "tcp", "ports": "22", "prefixes": ["198.51.100.0/24", "2001:db8::/32"]},
                {"protocol": "icmp", "prefixes": ["0.0.0.0/0", "::/0"]}],
    "outbound": [{"protocol": "any", "prefixes": ["0.0.0.0/0", "::/0"]}]}"#;

#[test]
fn a_disabled_or_absent_firewall_adds_nothing_to_the_table() {
    let none = plan_of(Value::Null);
    let mut off: Value = serde_json::from_str(EXAMPLE).unwrap();
    off["enabled"] = json!(false);
    let off = plan_of(off);
    assert!(none.firewall.is_none() && off.firewall.is_none());
    assert_eq!(none.nft, off.nft);
    let chains: Vec<&Value> = added(&off, "chain").iter().map(|c| &c["name"]).collect();
    assert!(!chains.iter().any(|c| *c == "filter"), "{chains:?}");
}

#[test]
fn the_filter_hooks_forward_after_dnat_and_dispatches_tap_and_veth_traffic() {
    let p = plan_of(serde_json::from_str(EXAMPLE).unwrap());
    let filter = added(&p, "chain")
        .into_iter()
        .find(|c| c["name"] == "filter")
        .unwrap();
    assert_eq!(filter["hook"], "forward");
    // Priority 0: after the netns DNAT (prerouting -100), so inbound sees the guest's port.
    assert_eq!(filter["prio"], 0);
    assert_eq!(filter["policy"], "accept");
    let r = rules_of(&p, "filter");
    assert_eq!(
        r[0],
        json!([{"match": {"op": "in", "left": {"ct": {"key": "state"}}, "right": ["established", "related"]}},
            {"accept": null}])
    );
    assert_eq!(r[1][0]["match"]["right"], "vmnp0007");
    assert_eq!(r[1][1]["match"]["right"], "vmnt0007");
    assert_eq!(r[1][2], json!({"jump": {"target": "fw_in"}}));
    assert_eq!(r[2][0]["match"]["right"], "vmnt0007");
    assert_eq!(r[2][1]["match"]["right"], "vmnp0007");
    assert_eq!(r[2][2], json!({"jump": {"target": "fw_out"}}));
    assert_eq!(r.len(), 3);
    // The firewall is in the same transaction as the rest of the VM table.
    assert!(added(&p, "chain").iter().any(|c| c["name"] == "mss"));
}

#[test]
fn the_example_becomes_one_rule_per_prefix_then_drop() {
    let p = plan_of(serde_json::from_str(EXAMPLE).unwrap());
    let m = |proto: &str, field: &str, right: Value| json!({"match": {"op": "==", "left": {"payload": {"protocol": proto, "field": field}}, "right": right}});
    let l4 = |name: &str| json!({"match": {"op": "==", "left": {"meta": {"key": "l4proto"}}, "right": name}});
    let pfx = |a: &str, l: u8| json!({"prefix": {"addr": a, "len": l}});
    let accept = json!({"accept": null});
    assert_eq!(
        rules_of(&p, "fw_in"),
        vec![
            json!([
                m("ip", "saddr", pfx("198.51.100.0", 24)),
                m("tcp", "dport", json!(22)),
                accept
            ]),
            json!([
                m("ip6", "saddr", pfx("2001:db8::", 32)),
                m("tcp", "dport", json!(22)),
                accept
            ]),
            json!([m("ip", "saddr", pfx("0.0.0.0", 0)), l4("icmp"), accept]),
            json!([m("ip6", "saddr", pfx("::", 0)), l4("ipv6-icmp"), accept]),
            json!([{"drop": null}]),
        ]
    );
    assert_eq!(
        rules_of(&p, "fw_out"),
        vec![
            json!([m("ip", "daddr", pfx("0.0.0.0", 0)), accept]),
            json!([m("ip6", "daddr", pfx("::", 0)), accept]),
            json!([{"drop": null}]),
        ]
    );
    // A port range, a full-length prefix, a protocol without ports, and a repeated rule.
    let q = plan_of(json!({"enabled": true, "inbound": [
        {"protocol": "udp", "ports": "53-54", "prefixes": ["192.0.2.7/32", "2001:db8::1/128"]},
        {"protocol": "tcp", "prefixes": ["10.0.0.0/8"]},
        {"protocol": "udp", "ports": "53-54", "prefixes": ["192.0.2.7/32"]}]}));
    assert_eq!(
        rules_of(&q, "fw_in"),
        vec![
            json!([
                m("ip", "saddr", json!("192.0.2.7")),
                m("udp", "dport", json!({"range": [53, 54]})),
                accept
            ]),
            json!([
                m("ip6", "saddr", json!("2001:db8::1")),
                m("udp", "dport", json!({"range": [53, 54]})),
                accept
            ]),
            json!([m("ip", "saddr", pfx("10.0.0.0", 8)), l4("tcp"), accept]),
            json!([{"drop": null}]),
        ]
    );
}

#[test]
fn another_firewall_changes_the_rules_and_keeps_the_shape() {
    let a = plan_of(serde_json::from_str(EXAMPLE).unwrap());
    let b = plan_of(json!({"enabled": true, "inbound": [
        {"protocol": "udp", "ports": "53-54", "prefixes": ["192.0.2.0/24"]}]}));
    let empty = plan_of(json!({"enabled": true}));
    assert_ne!(a.nft_fingerprint, b.nft_fingerprint);
    assert_eq!(a.nft_shape, b.nft_shape);
    assert_eq!(a.nft_shape, empty.nft_shape);
    // The shape is the first rule's comment; turning the firewall off is another shape.
    let off = plan_of(Value::Null);
    assert_ne!(off.nft_shape, a.nft_shape);
    let comment = added(&a, "rule")[0]["comment"].clone();
    assert_eq!(comment, json!(format!("vmnet:{}", a.nft_shape)));
    // The typed rules are what the JSON holds.
    let fw = a.firewall.as_ref().unwrap();
    for (chain, dir) in [
        ("fw_in", FlowDirection::Inbound),
        ("fw_out", FlowDirection::Outbound),
    ] {
        let mut want: Vec<Value> = fw
            .rules()
            .iter()
            .filter(|r| r.direction == dir)
            .map(|r| r.to_json())
            .collect();
        want.push(json!([{"drop": null}]));
        assert_eq!(rules_of(&a, chain), want, "{chain}");
    }
}

#[test]
fn an_empty_list_is_drop_only() {
    let p = plan_of(json!({"enabled": true}));
    assert_eq!(rules_of(&p, "fw_in"), vec![json!([{"drop": null}])]);
    assert_eq!(rules_of(&p, "fw_out"), vec![json!([{"drop": null}])]);
}

#[test]
fn admits_is_the_rules_decision() {
    let p = plan_of(serde_json::from_str(EXAMPLE).unwrap());
    let fw = p.firewall.as_ref().unwrap();
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    use FlowDirection::{Inbound, Outbound};
    assert!(fw.admits(Inbound, ip("198.51.100.9"), 6, Some(22)));
    assert!(!fw.admits(Inbound, ip("198.51.100.9"), 6, Some(23)));
    assert!(!fw.admits(Inbound, ip("198.51.100.9"), 17, Some(22)));
    assert!(!fw.admits(Inbound, ip("203.0.113.1"), 6, Some(22)));
    assert!(fw.admits(Inbound, ip("2001:db8:1::1"), 6, Some(22)));
    assert!(fw.admits(Inbound, ip("203.0.113.1"), 1, None));
    assert!(fw.admits(Inbound, ip("2001:db9::1"), 58, None));
    assert!(
        !fw.admits(Inbound, ip("2001:db9::1"), 1, None),
        "ICMP is not ICMPv6"
    );
    assert!(fw.admits(Outbound, ip("203.0.113.1"), 47, None));
    let closed = plan_of(json!({"enabled": true}));
    assert!(
        !closed
            .firewall
            .unwrap()
            .admits(Outbound, ip("203.0.113.1"), 6, Some(80))
    );
}

#[test]
fn direction_tells_forwarded_connections_from_the_netns_own() {
    let p = plan_of(serde_json::from_str(EXAMPLE).unwrap());
    let fw = p.firewall.as_ref().unwrap();
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    let guest = ip("172.16.0.2");
    let transit = IpAddr::V4(p.veth.as_ref().unwrap().peer_ipv4.addr());
    // The guest's own connection out; its connection to the metadata service is not forwarded.
    assert_eq!(
        fw.direction(guest, ip("198.51.100.10"), ip("198.51.100.10")),
        Some((FlowDirection::Outbound, ip("198.51.100.10")))
    );
    assert_eq!(
        fw.direction(guest, ip("169.254.169.254"), ip("169.254.169.254")),
        None
    );
    assert_eq!(
        fw.direction(guest, ip("172.16.0.1"), ip("172.16.0.1")),
        None
    );
    // Inbound through the public IPv4: the netns DNATs its transit address to the guest.
    assert_eq!(
        fw.direction(ip("203.0.113.1"), transit, guest),
        Some((FlowDirection::Inbound, ip("203.0.113.1")))
    );
    // Mesh traffic to the guest's mesh address.
    let mesh = ip("fdaa:1::7");
    assert_eq!(
        fw.direction(ip("fdaa:2::9"), mesh, mesh),
        Some((FlowDirection::Inbound, ip("fdaa:2::9")))
    );
    assert_eq!(fw.direction(ip("fe80::1"), mesh, mesh), None);
    assert_eq!(
        fw.direction(ip("10.9.9.9"), ip("10.9.9.8"), ip("10.9.9.8")),
        None
    );
}

#[test]
fn a_vm_without_a_veth_gets_no_filter_and_a_changed_firewall_a_new_fingerprint() {
    let cfg =
        parse_vm_config(br#"{"id":"cap","user_id":3,"tenant":0,"firewall":{"enabled":true}}"#)
            .unwrap();
    let p = plan_vm(&cfg, &NsSettings::default()).unwrap();
    assert!(p.firewall.is_none());
    let a = plan_of(serde_json::from_str(EXAMPLE).unwrap());
    let b = plan_of(json!({"enabled": true}));
    assert_ne!(a.nft_fingerprint, b.nft_fingerprint);
}
