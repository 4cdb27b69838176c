//! Plans of VMs with public addresses.

use std::net::{IpAddr, Ipv4Addr};

use ipnet::IpNet;
use vmnet_model::ValidationError;
use vmnet_model::vm::parse_vm_config;

use super::public::{self, maps};
use super::*;

fn plan_of(extra: &str, settings: &NsSettings) -> Result<VmPlan, ValidationError> {
    let json = format!(
        r#"{{"id":"web","user_id":7,"tenant":1,"mesh_ipv6":"fdaa:1::7"{extra},"network":{{"routes":[{{"destination":"0.0.0.0/0","via":"host"}},{{"destination":"::/0","via":"host"}}]}}}}"#
    );
    plan_vm(&parse_vm_config(json.as_bytes()).unwrap(), settings)
}

#[test]
fn public_ipv4_and_mapped_ipv6_are_elements_keyed_by_what_the_uid_derives() {
    let p = plan_of(
        r#","public_ipv4":"203.0.113.57","public_ipv6":"2001:db8::57""#,
        &NsSettings::default(),
    )
    .unwrap();
    let pp = p.public.as_ref().unwrap();
    assert_eq!(pp.table, "vmn_pub");
    assert_eq!(pp.transit, "10.200.0.30".parse::<Ipv4Addr>().unwrap());
    let e: Vec<(&str, String, String)> = pp.elements();
    let s = |x: &str| x.to_owned();
    assert_eq!(
        e,
        vec![
            (maps::DNAT4, s("203.0.113.57"), s("10.200.0.30")),
            (maps::SNAT4, s("10.200.0.30"), s("203.0.113.57")),
            (maps::DNAT6, s("2001:db8::57"), s("fdaa:1::7")),
            (maps::SNAT6, s("fdaa:1::7"), s("2001:db8::57")),
            (maps::OWN6, s("10.200.0.30"), s("fdaa:1::7")),
        ]
    );
    assert!(
        p.host_routes
            .iter()
            .any(|r| r.destination.to_string() == "203.0.113.57/32"
                && r.kind
                    == RouteKind::Via {
                        gateway: "10.200.0.30".parse().unwrap(),
                        dev: "vmnh0007".into(),
                        onlink: false
                    })
    );
    let text = p.nft.to_string();
    assert!(
        text.contains(r#""dnat":{"addr":"172.16.0.2","family":"ip"}"#),
        "{text}"
    );
    let st = p.status();
    assert_eq!(st.public_ipv4, Some("203.0.113.57".parse().unwrap()));
    assert_eq!(st.public_ipv6.as_deref(), Some("2001:db8::57"));
    assert!(pp.proxy.is_none(), "routed by default");
}

#[test]
fn a_block_is_routed_not_translated() {
    let p = plan_of(
        r#","public_ipv6":"2001:db8:7::/56""#,
        &NsSettings::default(),
    )
    .unwrap();
    let pp = p.public.as_ref().unwrap();
    assert!(pp.elements().is_empty());
    assert_eq!(pp.ipv6_block, Some("2001:db8:7::/56".parse().unwrap()));
    let block: IpNet = "2001:db8:7::/56".parse().unwrap();
    assert!(p.host_routes.contains(&PlannedRoute {
        table: MAIN_TABLE,
        destination: block,
        kind: RouteKind::Via {
            gateway: IpAddr::V6(PEER_LINK_LOCAL),
            dev: "vmnh0007".into(),
            onlink: false
        }
    }));
    for table in [MAIN_TABLE, names::NS_INBOUND_TABLE] {
        assert!(p.ns_routes.contains(&PlannedRoute {
            table,
            destination: block,
            kind: RouteKind::Dev {
                dev: "vmnt0007".into()
            }
        }));
    }
    assert!(
        !p.nft.to_string().contains("172.16.0.2"),
        "no IPv4 DNAT without public_ipv4"
    );
    assert_eq!(p.status().public_ipv6.as_deref(), Some("2001:db8:7::/56"));
}

#[test]
fn no_public_fields_no_public_plan_and_an_empty_dnat_chain_of_the_same_shape() {
    let p = plan_of("", &NsSettings::default()).unwrap();
    assert!(p.public.is_none());
    let cmds = p.nft["nftables"].as_array().unwrap();
    assert!(
        cmds.iter()
            .any(|c| c["add"]["chain"]["name"] == "prerouting"),
        "the DNAT chain is there"
    );
    assert!(
        !cmds
            .iter()
            .any(|c| c["add"]["rule"]["chain"] == "prerouting"),
        "without a rule"
    );
    let with = plan_of(r#","public_ipv4":"203.0.113.57""#, &NsSettings::default()).unwrap();
    assert_eq!(p.nft_shape, with.nft_shape);
    assert_ne!(p.nft_fingerprint, with.nft_fingerprint);
}

#[test]
fn public_ipv4_in_the_transit_range_is_refused() {
    let s = NsSettings {
        transit_ipv4: "198.51.100.0/24".parse().unwrap(),
        ..NsSettings::default()
    };
    assert_eq!(
        plan_of(r#","public_ipv4":"198.51.100.9""#, &s)
            .unwrap_err()
            .message(),
        "vm web: public_ipv4 198.51.100.9 lies in the transit range 198.51.100.0/24"
    );
}

#[test]
fn proxy_mode_lists_the_neighbours_and_needs_an_uplink() {
    let mut s = NsSettings {
        public_neighbors: PublicNeighbors::Proxy,
        ..NsSettings::default()
    };
    assert_eq!(
        s.validate().unwrap_err().message(),
        "settings: public_neighbors proxy needs an uplink (--uplink IFACE) to answer ARP/NDP on"
    );
    s.uplink = Some("eth0".into());
    let p = plan_of(
        r#","public_ipv4":"203.0.113.57","public_ipv6":"2001:db8:7::/126""#,
        &s,
    )
    .unwrap();
    let (up, addrs) = p.public.unwrap().proxy.unwrap();
    assert_eq!(up, "eth0");
    let text: Vec<String> = addrs.iter().map(ToString::to_string).collect();
    assert_eq!(
        text,
        [
            "203.0.113.57",
            "2001:db8:7::",
            "2001:db8:7::1",
            "2001:db8:7::2",
            "2001:db8:7::3"
        ]
    );
    let h = plan_host(&s).unwrap();
    assert!(
        h.sysctls
            .contains(&("net/ipv6/conf/eth0/proxy_ndp".into(), "1".into()))
    );
    assert_eq!(h.proxy_uplink.as_deref(), Some("eth0"));
}

#[test]
fn host_public_table_snapshot() {
    let h = plan_host(&NsSettings::default()).unwrap();
    assert_eq!(h.pub_table, "vmn_pub");
    let cmds = h.pub_nft["nftables"].as_array().unwrap();
    assert_eq!(cmds.len(), 17);
    assert_eq!(
        cmds[15],
        serde_json::json!({"add": {"rule": {"family": "inet", "table": "vmn_pub", "chain": "postrouting", "expr": [
            {"match": {"op": "!=", "left": {"ct": {"key": "ip daddr", "dir": "original"}}, "right": {"prefix": {"addr": "10.200.0.0", "len": 14}}}},
            {"snat": {"family": "ip", "addr": {"map": {"key": {"payload": {"protocol": "ip", "field": "saddr"}}, "data": "@snat4"}}}}
        ]}}})
    );
    assert_eq!(
        public::element_cmd("delete", "vmn_pub", "dnat4", "203.0.113.5", None),
        serde_json::json!({"delete": {"element": {"family": "inet", "table": "vmn_pub", "name": "dnat4", "elem": ["203.0.113.5"]}}})
    );
}

/// The plan of VM `web` with `routes` (JSON array items) and a public limit of 2 MiB/s.
fn limited(routes: &str, extra: &str) -> VmPlan {
    let json = format!(
        r#"{{"id":"web","user_id":7,"tenant":1,"mesh_ipv6":"fdaa:1::7","public_network_throughput_mibps":2{extra},"network":{{"routes":[{routes}]}}}}"#
    );
    plan_vm(
        &parse_vm_config(json.as_bytes()).unwrap(),
        &NsSettings::default(),
    )
    .unwrap()
}

/// Whether the plan shapes the public class in both directions at `mibps`.
fn public_shaped(p: &VmPlan, mibps: u64) -> bool {
    p.limits.public_applied
        && p.limits.trees.len() == 2
        && p.limits.trees.iter().all(|t| {
            t.classes.iter().any(|c| {
                c.class == super::limits::TrafficClass::Public
                    && c.applied
                    && c.rate == mibps * super::limits::MIB
            })
        })
}

#[test]
fn the_public_limit_applies_to_a_public_ipv6_path_alone() {
    let v6 = r#"{"destination":"::/0","via":"host"}"#;
    let v4 = r#"{"destination":"0.0.0.0/0","via":"host"}"#;
    // Public IPv6 only (the issue's VM): shaped.
    let p = limited(v6, r#","public_ipv6":"2001:db8::57""#);
    assert!(!p.nat);
    assert!(public_shaped(&p, 2), "{:?}", p.limits);
    // A routed IPv6 prefix via host, no public address: still the uplink, still shaped.
    assert!(public_shaped(
        &limited(r#"{"destination":"2001:db8:5::/48","via":"host"}"#, ""),
        2
    ));
    // IPv4 via host, as before.
    assert!(public_shaped(&limited(v4, ""), 2));
    // No route via host (mesh only, or through a gateway VM): no public path, kept unapplied.
    for routes in ["", r#"{"destination":"2000::/3","via":"fdaa:2::56"}"#] {
        let p = limited(routes, "");
        assert!(!p.limits.public_applied, "{routes}: {:?}", p.limits);
        assert!(p.limits.trees.is_empty(), "{routes}");
        assert_eq!(p.limits.public_mibps, 2);
    }
}
