//! Unit tests for namespace mode planning: names, transit mapping, routes and nft snapshots.

use std::collections::HashSet;

use proptest::prelude::*;
use vmnet_model::vm::{MAX_USER_ID, VmConfig, parse_vm_config};

use super::*;

fn cfg(json: &str) -> VmConfig {
    parse_vm_config(json.as_bytes()).unwrap()
}

fn spec_vm() -> VmConfig {
    cfg(
        r#"{"id":"vm-7","user_id":7,"tenant":3,"mesh_ipv6":"fdaa:1::7","network":{"routes":[
        {"destination":"0.0.0.0/0","via":"host"},{"destination":"2000::/3","via":"fdaa:1::56"}]}}"#,
    )
}

#[test]
fn names_fit_for_every_supported_uid_and_invert() {
    let prefix = "a".repeat(names::MAX_PREFIX_LEN);
    for uid in [0, 1, 0xff, 0x1000, 0xfffe, MAX_USER_ID] {
        for kind in [
            NameKind::Netns,
            NameKind::HostVeth,
            NameKind::PeerVeth,
            NameKind::Tap,
        ] {
            let n = name(&prefix, kind, uid);
            assert_eq!(n.len(), names::IFNAME_MAX, "{n}");
            assert_eq!(parse_uid(&prefix, kind, &n), Some(uid));
        }
    }
    assert_eq!(name("vmn", NameKind::HostVeth, 7), "vmnh0007");
    assert_eq!(name("vmn", NameKind::PeerVeth, 0xffff), "vmnpffff");
}

#[test]
fn parse_uid_rejects_other_prefixes_and_kinds() {
    assert_eq!(parse_uid("vmn", NameKind::HostVeth, "vmnxh0001"), None);
    assert_eq!(parse_uid("vmn", NameKind::HostVeth, "vmnp0001"), None);
    assert_eq!(parse_uid("vmn", NameKind::HostVeth, "vmnh00012"), None);
    assert_eq!(parse_uid("vmn", NameKind::HostVeth, "vmnh00A1"), None);
    assert_eq!(parse_uid("vmn", NameKind::HostVeth, "vmnh+001"), None);
    assert_eq!(parse_uid("vmn", NameKind::HostVeth, "eth0"), None);
}

#[test]
fn prefix_rules() {
    assert!(names::check_prefix("vmn").is_ok());
    assert!(names::check_prefix("t1a2b3c4d5").is_ok());
    for bad in ["", "Vmn", "1vm", "vm-n", "abcdefghijk"] {
        assert!(names::check_prefix(bad).is_err(), "{bad}");
    }
    let s = NsSettings {
        name_prefix: "toolongprefix".into(),
        ..NsSettings::default()
    };
    let e = s.validate().unwrap_err();
    assert_eq!(
        e.message(),
        "settings: name prefix \"toolongprefix\" must be 1..=10 bytes: a lowercase letter, then lowercase letters or digits"
    );
}

#[test]
fn the_netns_transit_address_names_its_user_id_and_nothing_else_does() {
    let s = NsSettings::default();
    for uid in [0, 1, 7, MAX_USER_ID] {
        let netns_side = std::net::Ipv4Addr::from(u32::from(s.transit_of(uid).network()) + 2);
        assert_eq!(s.uid_of_transit(netns_side), Some(uid), "{netns_side}");
    }
    for other in [
        "10.200.0.1",
        "10.200.0.4",
        "10.200.0.7",
        "10.199.255.254",
        "10.204.0.2",
    ] {
        assert_eq!(s.uid_of_transit(other.parse().unwrap()), None, "{other}");
    }
}

#[test]
fn transit_extremes_and_no_collisions() {
    let s = NsSettings::default();
    assert_eq!(s.max_user_id(), 0xffff);
    assert_eq!(s.transit_of(0).to_string(), "10.200.0.0/30");
    assert_eq!(s.transit_of(1).to_string(), "10.200.0.4/30");
    assert_eq!(s.transit_of(0xffff).to_string(), "10.203.255.252/30");
    let mut seen = HashSet::new();
    for uid in 0..=MAX_USER_ID {
        let t = s.transit_of(uid);
        assert!(s.transit_ipv4.contains(&t), "{t}");
        assert!(seen.insert(t.network()), "{t} collides");
    }
}

#[test]
fn smaller_transit_range_supports_fewer_ids() {
    let s = NsSettings {
        transit_ipv4: "10.9.0.0/24".parse().unwrap(),
        ..NsSettings::default()
    };
    assert_eq!(s.max_user_id(), 63);
    let c = cfg(r#"{"id":"big","user_id":64,"tenant":0}"#);
    let e = plan_vm(&c, &s).unwrap_err();
    assert_eq!(
        e.message(),
        "vm big: user_id 64 is outside the range 0..=63 supported by transit range 10.9.0.0/24"
    );
}

proptest! {
    #[test]
    fn distinct_uids_never_share_names_or_transit(a in 0..=MAX_USER_ID, b in 0..=MAX_USER_ID) {
        prop_assume!(a != b);
        let s = NsSettings::default();
        let (ta, tb) = (s.transit_of(a), s.transit_of(b));
        prop_assert!(!ta.contains(&tb.network()) && !tb.contains(&ta.network()));
        prop_assert_ne!(name("vmn", NameKind::HostVeth, a), name("vmn", NameKind::HostVeth, b));
        prop_assert!(name("vmn", NameKind::PeerVeth, a).len() <= names::IFNAME_MAX);
    }
}

#[test]
fn spec_vm_plan() {
    let p = plan_vm(&spec_vm(), &NsSettings::default()).unwrap();
    assert_eq!(p.netns, "vmnn0007");
    assert_eq!(p.tap.name, "vmnt0007");
    assert_eq!(p.tap.mtu, 1380);
    let v = p.veth.as_ref().unwrap();
    assert_eq!(
        (v.host_name.as_str(), v.peer_name.as_str()),
        ("vmnh0007", "vmnp0007")
    );
    assert_eq!(v.transit.to_string(), "10.200.0.28/30");
    assert_eq!(v.host_ipv4.to_string(), "10.200.0.29/30");
    assert_eq!(v.peer_ipv4.to_string(), "10.200.0.30/30");
    assert!(p.nat);
    assert_eq!(p.guest.mac, "06:00:ac:10:00:02");
    assert_eq!(p.guest.ipv4.to_string(), "172.16.0.2/30");
    let show = |rs: &[PlannedRoute]| {
        rs.iter()
            .map(|r| format!("{} {} {:?}", r.table, r.destination, r.kind))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        show(&p.ns_routes),
        [
            "100 ::/0 Via { gateway: fdaa:1::7, dev: \"vmnt0007\", onlink: true }",
            "254 0.0.0.0/0 Via { gateway: 10.200.0.29, dev: \"vmnp0007\", onlink: false }",
            "254 2000::/3 Via { gateway: fe80::1:7, dev: \"vmnp0007\", onlink: false }",
            "254 fdaa::/16 Via { gateway: fe80::1:7, dev: \"vmnp0007\", onlink: false }",
            "254 fdaa:1::7/128 Dev { dev: \"vmnt0007\" }",
        ]
    );
    assert_eq!(
        show(&p.host_routes),
        [
            "254 fdaa:1::7/128 Via { gateway: fe80::2, dev: \"vmnh0007\", onlink: false }",
            "16777223 2000::/3 ViaMesh { mesh: fdaa:1::56 }",
            "16777223 fdaa::/16 Throw",
        ]
    );
    assert_eq!(
        p.host_rules,
        [PlannedRule {
            iif: "vmnh0007".into(),
            table: 16_777_223,
            priority: 10000
        }]
    );
    let st = p.status();
    assert_eq!(st.transit.unwrap().to_string(), "10.200.0.28/30");
    assert_eq!(st.routes, spec_vm().network.routes);
}

#[test]
fn host_routes_only_get_a_table_with_a_mesh_via() {
    let c = cfg(
        r#"{"id":"a","user_id":2,"tenant":0,"mesh_ipv6":"fdaa::2","network":{"routes":[
        {"destination":"::/0","via":"host"}]}}"#,
    );
    let p = plan_vm(&c, &NsSettings::default()).unwrap();
    assert!(p.host_rules.is_empty());
    assert_eq!(p.host_routes.len(), 1);
    assert!(!p.nat, "no IPv4 route via host, no NAT");
    assert!(!p.nft.to_string().contains("snat"));
}

#[test]
fn host_via_routes_throw_in_the_vm_table() {
    let c = cfg(
        r#"{"id":"a","user_id":2,"tenant":0,"mesh_ipv6":"fdaa::2","network":{"routes":[
        {"destination":"2000::/3","via":"fdaa::56"},{"destination":"2001:db8::/32","via":"host"}]}}"#,
    );
    let p = plan_vm(&c, &NsSettings::default()).unwrap();
    let t: Vec<_> = p
        .host_routes
        .iter()
        .filter(|r| r.table == p.host_table)
        .map(|r| (r.destination.to_string(), r.kind.clone()))
        .collect();
    assert!(t.contains(&("2001:db8::/32".into(), RouteKind::Throw)));
    assert!(t.contains(&(
        "2000::/3".into(),
        RouteKind::ViaMesh {
            mesh: "fdaa::56".parse().unwrap()
        }
    )));
}

#[test]
fn vm_without_routes_reaches_only_mesh() {
    let c = cfg(r#"{"id":"a","user_id":3,"tenant":0,"mesh_ipv6":"fdaa::3"}"#);
    let p = plan_vm(&c, &NsSettings::default()).unwrap();
    let main: Vec<_> = p
        .ns_routes
        .iter()
        .filter(|r| r.table == MAIN_TABLE)
        .map(|r| r.destination.to_string())
        .collect();
    assert_eq!(main, ["fdaa::/16", "fdaa::3/128"]);
    assert!(!p.nat);
}

#[test]
fn vm_without_mesh_has_no_veth() {
    let c = cfg(r#"{"id":"cap","user_id":4,"tenant":0}"#);
    let p = plan_vm(&c, &NsSettings::default()).unwrap();
    assert!(p.veth.is_none());
    assert!(p.ns_routes.is_empty() && p.host_routes.is_empty() && p.host_rules.is_empty());
    assert!(!p.nat);
    assert_eq!(p.status().host_veth, None);
}

#[test]
fn nft_snapshot_with_nat() {
    let p = plan_vm(&spec_vm(), &NsSettings::default()).unwrap();
    let expected = serde_json::json!({"nftables": [
        {"add": {"table": {"family": "inet", "name": "vmn"}}},
        {"delete": {"table": {"family": "inet", "name": "vmn"}}},
        {"add": {"table": {"family": "inet", "name": "vmn"}}},
        {"add": {"chain": {"family": "inet", "table": "vmn", "name": "mss", "type": "filter", "hook": "forward", "prio": -150, "policy": "accept"}}},
        {"add": {"rule": {"family": "inet", "table": "vmn", "chain": "mss", "comment": format!("vmnet:{}", p.nft_shape), "expr": [
            {"match": {"op": "==", "left": {"meta": {"key": "nfproto"}}, "right": "ipv4"}},
            {"match": {"op": "in", "left": {"payload": {"protocol": "tcp", "field": "flags"}}, "right": "syn"}},
            {"match": {"op": ">", "left": {"tcp option": {"name": "maxseg", "field": "size"}}, "right": 1340}},
            {"mangle": {"key": {"tcp option": {"name": "maxseg", "field": "size"}}, "value": 1340}}]}}},
        {"add": {"rule": {"family": "inet", "table": "vmn", "chain": "mss", "expr": [
            {"match": {"op": "==", "left": {"meta": {"key": "nfproto"}}, "right": "ipv6"}},
            {"match": {"op": "in", "left": {"payload": {"protocol": "tcp", "field": "flags"}}, "right": "syn"}},
            {"match": {"op": ">", "left": {"tcp option": {"name": "maxseg", "field": "size"}}, "right": 1320}},
            {"mangle": {"key": {"tcp option": {"name": "maxseg", "field": "size"}}, "value": 1320}}]}}},
        {"add": {"chain": {"family": "inet", "table": "vmn", "name": "postrouting", "type": "nat", "hook": "postrouting", "prio": 100, "policy": "accept"}}},
        {"add": {"rule": {"family": "inet", "table": "vmn", "chain": "postrouting", "expr": [
            {"match": {"op": "==", "left": {"meta": {"key": "oifname"}}, "right": "vmnp0007"}},
            {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}}, "right": {"prefix": {"addr": "172.16.0.0", "len": 30}}}},
            {"snat": {"family": "ip", "addr": "10.200.0.30"}}]}}},
        {"add": {"chain": {"family": "inet", "table": "vmn", "name": "prerouting", "type": "nat", "hook": "prerouting", "prio": -100, "policy": "accept"}}}
    ]});
    assert_eq!(p.nft, expected);
    assert_eq!(p.nft_fingerprint.len(), 16);
}

#[test]
fn nft_fingerprint_changes_with_nat() {
    let with = plan_vm(&spec_vm(), &NsSettings::default()).unwrap();
    let without = plan_vm(
        &cfg(r#"{"id":"vm-7","user_id":7,"tenant":3,"mesh_ipv6":"fdaa:1::7"}"#),
        &NsSettings::default(),
    )
    .unwrap();
    assert_ne!(with.nft_fingerprint, without.nft_fingerprint);
    // The table and chain mss with its two rules: without NAT, no public DNAT chain either.
    assert_eq!(without.nft["nftables"].as_array().unwrap().len(), 6);
}

#[test]
fn host_plan_snapshot() {
    let h = plan_host(&NsSettings::default()).unwrap();
    assert_eq!(h.nft_table, "vmn_host");
    assert_eq!(h.nft_fingerprint.len(), 16);
    assert_eq!(
        h.nft["nftables"][4],
        serde_json::json!({"add": {"rule": {"family": "ip", "table": "vmn_host", "chain": "postrouting",
            "comment": format!("vmnet:{}", h.nft_fingerprint), "expr": [
            {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}}, "right": {"prefix": {"addr": "10.200.0.0", "len": 14}}}},
            {"match": {"op": "!=", "left": {"payload": {"protocol": "ip", "field": "daddr"}}, "right": {"prefix": {"addr": "10.200.0.0", "len": 14}}}},
            {"masquerade": null}]}}})
    );
    assert!(
        plan_host(&NsSettings {
            manage_host: false,
            ..NsSettings::default()
        })
        .is_none()
    );
    // The fingerprint follows the content (another transit range, another rule).
    let other = plan_host(&NsSettings {
        transit_ipv4: "10.100.0.0/16".parse().unwrap(),
        ..NsSettings::default()
    })
    .unwrap();
    assert_ne!(other.nft_fingerprint, h.nft_fingerprint);
}

#[test]
fn print_rulesets_for_manual_nft_check() {
    // `cargo test -p vmnet-plan print_rulesets -- --nocapture` prints JSON that `nft -j -f -` accepts.
    let p = plan_vm(&spec_vm(), &NsSettings::default()).unwrap();
    println!("{}", p.nft);
    println!("{}", plan_host(&NsSettings::default()).unwrap().nft);
}

#[test]
fn settings_rules() {
    let bad = |f: fn(&mut NsSettings)| {
        let mut s = NsSettings::default();
        f(&mut s);
        s.validate().unwrap_err().message()
    };
    assert_eq!(
        bad(|s| s.transit_ipv4 = "172.16.0.0/12".parse().unwrap()),
        "settings: transit_ipv4 172.16.0.0/12 overlaps the guest network 172.16.0.0/30"
    );
    assert_eq!(
        bad(|s| s.transit_ipv4 = "10.200.0.1/14".parse().unwrap()),
        "settings: transit_ipv4 10.200.0.1/14 must be a canonical prefix of length 30 or shorter"
    );
    assert_eq!(
        bad(|s| s.mtu = 1000),
        "settings: mtu 1000 must be in 1280..=9000"
    );
    assert_eq!(
        bad(|s| s.host_table_base = 10),
        "settings: host_table_base 10 leaves no room for 65536 tables above 255"
    );
    assert!(NsSettings::default().validate().is_ok());
    let json: NsSettings =
        serde_json::from_str(r#"{"name_prefix":"abc","tap_owner_uid":1000}"#).unwrap();
    assert_eq!(json.name_prefix, "abc");
    assert_eq!(json.mtu, 1380, "missing fields take the defaults");
    assert!(serde_json::from_str::<NsSettings>(r#"{"nme_prefix":"abc"}"#).is_err());
}

#[test]
fn host_veth_link_locals_are_unique_per_uid() {
    assert_eq!(host_veth_link_local(7).to_string(), "fe80::1:7");
    assert_eq!(host_veth_link_local(0xffff).to_string(), "fe80::1:ffff");
    let all: HashSet<_> = (0..=MAX_USER_ID).map(host_veth_link_local).collect();
    assert_eq!(all.len(), 65536);
    assert!(!all.contains(&HOST_LINK_LOCAL) && !all.contains(&PEER_LINK_LOCAL));
}

#[test]
fn veth_macs_are_unicast_local_and_unique_per_uid() {
    assert_eq!(veth_macs(7), ([6, 1, 0, 0, 0, 7], [6, 2, 0, 0, 0, 7]));
    let (h, p) = veth_macs(0x0102_0304);
    assert_eq!((&h[2..], &p[2..]), (&[1, 2, 3, 4][..], &[1, 2, 3, 4][..]));
    // Locally administered (bit 1), not multicast (bit 0); never the guest's 06:00:….
    assert!(h[0] & 2 != 0 && h[0] & 1 == 0 && h[1] != 0 && p[1] != 0);
    let all: HashSet<_> = (0..=MAX_USER_ID).map(|u| veth_macs(u).0).collect();
    assert_eq!(all.len(), 65536);
}

proptest! {
    /// For any valid route set: every destination reaches the host from the netns exactly once,
    /// NAT follows the IPv4-via-host rule, and the host table exists only with a mesh via and
    /// then lists every IPv6 destination once (plus the mesh range).
    #[test]
    fn route_plan_invariants(picks in proptest::collection::btree_set(0usize..8, 0..8), vias in proptest::collection::vec(any::<bool>(), 8)) {
        let dests = ["0.0.0.0/0", "10.0.0.0/8", "192.0.2.0/24", "::/0", "2000::/3", "2001:db8::/32", "2001:db8:1::/48", "fdaa::/16"];
        let routes: Vec<String> = picks.iter().map(|&i| {
            let v6 = dests[i].contains(':');
            // The mesh range never goes via host (the model refuses it): only via a mesh gateway.
            let via = if v6 && (vias[i] || dests[i] == "fdaa::/16") { "fdaa::99" } else { "host" };
            format!(r#"{{"destination":"{}","via":"{via}"}}"#, dests[i])
        }).collect();
        let c = cfg(&format!(r#"{{"id":"p","user_id":5,"tenant":0,"mesh_ipv6":"fdaa::5","network":{{"routes":[{}]}}}}"#, routes.join(",")));
        let p = plan_vm(&c, &NsSettings::default()).unwrap();
        let main: Vec<_> = p.ns_routes.iter().filter(|r| r.table == MAIN_TABLE).map(|r| r.destination).collect();
        let unique: HashSet<_> = main.iter().collect();
        prop_assert_eq!(unique.len(), main.len());
        for r in &c.network.routes {
            prop_assert!(main.contains(&r.destination));
        }
        prop_assert_eq!(p.nat, c.ipv4_via_host());
        let mesh_via = c.network.routes.iter().any(|r| matches!(r.via, vmnet_model::vm::Via::Mesh(_)));
        prop_assert_eq!(p.host_rules.len(), usize::from(mesh_via));
        let table: Vec<_> = p.host_routes.iter().filter(|r| r.table == p.host_table).map(|r| r.destination).collect();
        if mesh_via {
            let v6 = c.network.routes.iter().filter(|r| !vmnet_model::vm::is_ipv4(&r.destination)).count();
            let has_mesh_range = c.network.routes.iter().any(|r| r.destination.to_string() == "fdaa::/16");
            prop_assert_eq!(table.len(), v6 + usize::from(!has_mesh_range));
        } else {
            prop_assert!(table.is_empty());
        }
    }
}

#[test]
fn activity_entry_is_planned_with_the_tap_and_the_veth_end_only_when_turned_on() {
    let on = NsSettings {
        activity: true,
        ..NsSettings::default()
    };
    let p = plan_vm(&spec_vm(), &on).expect("plan");
    let a = p.activity.expect("planned");
    assert_eq!(a.dev, p.tap.name);
    assert_eq!(a.ingress_dev, p.veth.as_ref().expect("veth").peer_name);
    assert_eq!(a.user_id, p.user_id);
    assert_eq!(
        plan_vm(&spec_vm(), &NsSettings::default())
            .expect("plan")
            .activity,
        None
    );
    // No veth pair (no mesh address): no host path, no filter.
    let capture = cfg(r#"{"id":"cap","user_id":3,"tenant":1,"network":{"routes":[]}}"#);
    assert_eq!(plan_vm(&capture, &on).expect("plan").activity, None);
}
