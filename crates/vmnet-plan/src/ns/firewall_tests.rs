//! Unit tests of the firewall plan ([`super::firewall`]): the chains and sets in the VM table,
//! disjoint interval elements, and the decision the conntrack sweep uses.

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde_json::{Value, json};
use vmnet_model::vm::firewall::PortRange;
use vmnet_model::vm::parse_vm_config;

use super::firewall::{FlowDirection, disjoint_ports};
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

fn set<'a>(p: &'a VmPlan, name: &str) -> Option<&'a Value> {
    added(p, "set").into_iter().find(|s| s["name"] == name)
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
    assert!(added(&off, "set").is_empty());
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
fn the_example_becomes_one_lookup_per_family_and_kind_then_drop() {
    let p = plan_of(serde_json::from_str(EXAMPLE).unwrap());
    assert_eq!(
        set(&p, "fw_in4_port").unwrap()["elem"],
        json!([{"concat": [{"prefix": {"addr": "198.51.100.0", "len": 24}}, "tcp", 22]}])
    );
    assert_eq!(
        set(&p, "fw_in4_port").unwrap()["type"],
        json!(["ipv4_addr", "inet_proto", "inet_service"])
    );
    assert_eq!(
        set(&p, "fw_in6_port").unwrap()["elem"],
        json!([{"concat": [{"prefix": {"addr": "2001:db8::", "len": 32}}, "tcp", 22]}])
    );
    // icmp means ICMP in the IPv4 set and ICMPv6 in the IPv6 one, by meta l4proto.
    assert_eq!(
        set(&p, "fw_in4_proto").unwrap()["elem"],
        json!([{"concat": [{"prefix": {"addr": "0.0.0.0", "len": 0}}, "icmp"]}])
    );
    assert_eq!(
        set(&p, "fw_in6_proto").unwrap()["elem"],
        json!([{"concat": [{"prefix": {"addr": "::", "len": 0}}, "ipv6-icmp"]}])
    );
    assert_eq!(
        set(&p, "fw_out4_any").unwrap()["elem"],
        json!([{"prefix": {"addr": "0.0.0.0", "len": 0}}])
    );
    assert_eq!(
        set(&p, "fw_out4_any").unwrap()["flags"],
        json!(["interval"])
    );
    // Every set is declared, empty or not: the table's shape does not depend on the rules.
    assert_eq!(added(&p, "set").len(), 12);
    assert!(set(&p, "fw_in4_any").unwrap().get("elem").is_none());
    assert!(set(&p, "fw_out4_port").unwrap().get("elem").is_none());
    let fw_in = rules_of(&p, "fw_in");
    assert_eq!(fw_in.len(), 7);
    assert_eq!(
        fw_in[2],
        json!([{"match": {"op": "==", "left": {"concat": [
                {"payload": {"protocol": "ip", "field": "saddr"}},
                {"meta": {"key": "l4proto"}},
                {"payload": {"protocol": "th", "field": "dport"}}]},
            "right": "@fw_in4_port"}}, {"accept": null}])
    );
    assert_eq!(fw_in[6], json!([{"drop": null}]));
    let fw_out = rules_of(&p, "fw_out");
    assert_eq!(
        fw_out[0],
        json!([{"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "daddr"}},
            "right": "@fw_out4_any"}}, {"accept": null}])
    );
    assert_eq!(fw_out.len(), 7);
}

#[test]
fn another_firewall_changes_the_set_elements_and_keeps_the_shape() {
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
    // The typed sets are what the JSON holds.
    let sets = a.firewall.as_ref().unwrap().sets();
    assert_eq!(sets.len(), 12);
    for s in &sets {
        let elems: Vec<Value> = s.elements.iter().map(|e| e.to_json()).collect();
        let want = set(&a, &s.name).unwrap().get("elem").cloned();
        assert_eq!(want.unwrap_or(json!([])), json!(elems), "{}", s.name);
    }
}

#[test]
fn an_empty_list_is_drop_only() {
    let p = plan_of(json!({"enabled": true}));
    assert_eq!(rules_of(&p, "fw_in").last(), Some(&json!([{"drop": null}])));
    assert_eq!(
        rules_of(&p, "fw_out").last(),
        Some(&json!([{"drop": null}]))
    );
    assert!(added(&p, "set").iter().all(|s| s.get("elem").is_none()));
}

#[test]
fn nested_prefixes_are_made_disjoint_without_changing_what_matches() {
    let p = plan_of(json!({"enabled": true, "inbound": [
        {"protocol": "any", "prefixes": ["10.0.0.0/8", "10.1.0.0/16", "198.51.100.7"]},
        {"protocol": "tcp", "prefixes": ["10.0.0.0/8"]},
        {"protocol": "tcp", "prefixes": ["10.2.0.0/16", "10.0.0.0/8"]},
        {"protocol": "tcp", "ports": "20-30", "prefixes": ["192.0.2.0/24"]},
        {"protocol": "tcp", "ports": "25-40", "prefixes": ["192.0.2.0/24", "192.0.2.128/25"]},
        {"protocol": "tcp", "ports": "10-50", "prefixes": ["192.0.2.128/25"]},
        {"protocol": "udp", "ports": "41-41", "prefixes": ["192.0.2.0/24"]}]}));
    assert_eq!(
        set(&p, "fw_in4_any").unwrap()["elem"],
        json!([{"prefix": {"addr": "10.0.0.0", "len": 8}}, "198.51.100.7"])
    );
    assert_eq!(
        set(&p, "fw_in4_proto").unwrap()["elem"],
        json!([{"concat": [{"prefix": {"addr": "10.0.0.0", "len": 8}}, "tcp"]}])
    );
    let c = |n: &str, proto: &str, port: Value| {
        let (a, l) = n.split_once('/').unwrap();
        json!({"concat": [{"prefix": {"addr": a, "len": l.parse::<u8>().unwrap()}}, proto, port]})
    };
    assert_eq!(
        set(&p, "fw_in4_port").unwrap()["elem"],
        json!([
            c("192.0.2.0/24", "tcp", json!({"range": [20, 40]})),
            c("192.0.2.128/25", "tcp", json!({"range": [10, 19]})),
            c("192.0.2.128/25", "tcp", json!({"range": [41, 50]})),
            c("192.0.2.0/24", "udp", json!(41)),
        ])
    );
}

#[test]
fn disjoint_ports_keep_each_address_and_port_matched_once() {
    let n = |s: &str| s.parse::<ipnet::IpNet>().unwrap();
    let r = |a: u16, b: u16| PortRange { first: a, last: b };
    let by: BTreeMap<_, _> = [
        (n("10.0.0.0/8"), vec![r(1, 100), r(200, 300)]),
        (n("10.1.0.0/16"), vec![r(50, 250)]),
        (n("10.1.2.0/24"), vec![r(1, 65535)]),
        (n("10.9.0.0/16"), vec![r(7, 7), r(8, 9)]),
        (n("11.9.0.0/16"), vec![r(7, 7), r(8, 9)]),
    ]
    .into_iter()
    .collect();
    let out = disjoint_ports(&by);
    assert_eq!(
        out,
        vec![
            (n("10.0.0.0/8"), r(1, 100)),
            (n("10.0.0.0/8"), r(200, 300)),
            (n("10.1.0.0/16"), r(101, 199)),
            (n("10.1.2.0/24"), r(301, 65535)),
            (n("11.9.0.0/16"), r(7, 9)),
        ]
    );
    // Every (address, port) probe matches exactly as often as the rules say: once or never.
    for addr in [
        "10.1.2.3",
        "10.1.9.9",
        "10.200.0.1",
        "10.9.0.1",
        "11.9.0.1",
        "11.0.0.1",
    ] {
        let a: IpAddr = addr.parse().unwrap();
        for port in [
            1u16, 7, 9, 10, 50, 100, 101, 150, 199, 200, 250, 251, 300, 301, 65535,
        ] {
            let want = by.iter().any(|(p, rs)| {
                p.contains(&a) && rs.iter().any(|r| (r.first..=r.last).contains(&port))
            });
            let hits = out
                .iter()
                .filter(|(p, r)| p.contains(&a) && (r.first..=r.last).contains(&port))
                .count();
            assert_eq!(hits, usize::from(want), "{addr} port {port}");
        }
    }
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
