use super::*;
use crate::nftdiff::{Tables, diff};
use vmnet_model::nic::NicSpec;

pub(crate) fn instance(id: &str, ip: &str, policy: NetworkPolicy, sandbox: bool) -> InstanceSpec {
    InstanceSpec {
        id: id.into(),
        allocation_id: format!("alloc-{id}"),
        policy,
        sandbox,
        nics: vec![NicSpec {
            network: Some("br0".parse().unwrap()),
            mac: MacAddr::for_instance(id),
            addresses: vec![format!("{ip}/24").parse().unwrap()],
            gateway: Some("10.0.0.1".parse().unwrap()),
            gateway6: None,
            nameservers: vec![],
        }],
    }
}

fn host() -> HostAddrs {
    HostAddrs {
        own: vec![
            "10.0.0.1".parse().unwrap(),
            "192.0.2.10".parse().unwrap(),
            "2001:db8::10".parse().unwrap(),
        ],
        gateways: vec!["10.0.0.1".parse().unwrap()],
    }
}

fn node(k: usize) -> NodeSpec {
    NodeSpec {
        instances: (0..k)
            .map(|i| {
                instance(
                    &format!("i-{i}"),
                    &format!("10.0.{}.{}", i / 200, i % 200 + 2),
                    NetworkPolicy::Public,
                    false,
                )
            })
            .collect(),
    }
}

#[test]
fn full_replace_has_add_delete_add_for_every_table() {
    let fw = plan(&node(2), &host()).unwrap();
    let doc = render_full(&fw);
    let cmds = doc["nftables"].as_array().unwrap();
    let table_ops: Vec<String> = cmds
        .iter()
        .filter_map(|c| {
            let (verb, body) = c.as_object()?.iter().next()?;
            let t = body.get("table")?;
            Some(format!(
                "{verb} {} {}",
                t["family"].as_str()?,
                t["name"].as_str()?
            ))
        })
        .collect();
    assert_eq!(
        table_ops,
        [
            "add bridge bcd_instances",
            "delete bridge bcd_instances",
            "add bridge bcd_instances",
            "add inet bcd_taps",
            "delete inet bcd_taps",
            "add arp bcd_taps",
            "delete arp bcd_taps",
            "add inet bcd_taps",
            "add arp bcd_taps",
        ]
    );
    let c = Tables::read(&doc, &OWNED_TABLES);
    assert_eq!(c.tables.len(), 3);
    assert_eq!(c.rule_counts()["inet bcd_taps"], 4);
    assert_eq!(c.rule_counts()["arp bcd_taps"], 2);
    assert_eq!(c.element_counts()["bridge bcd_instances tap_mac"], 2);
    assert_eq!(
        c.element_counts()["bridge bcd_instances host_block4"],
        1,
        "gateway exempt"
    );
    assert_eq!(c.element_counts()["bridge bcd_instances host_all4"], 2);
}

#[test]
fn no_nic_deletes_backstop_tables() {
    let fw = plan(&NodeSpec::default(), &host()).unwrap();
    let c = Tables::read(&render_full(&fw), &OWNED_TABLES);
    assert_eq!(
        c.tables.keys().collect::<Vec<_>>(),
        ["bridge bcd_instances"]
    );
}

#[test]
fn rule_count_is_fixed_in_k() {
    let r10 = Tables::read(
        &render_full(&plan(&node(10), &host()).unwrap()),
        &OWNED_TABLES,
    )
    .rule_counts();
    let r1000 = Tables::read(
        &render_full(&plan(&node(1000), &host()).unwrap()),
        &OWNED_TABLES,
    )
    .rule_counts();
    assert_eq!(r10, r1000);
}

#[test]
fn one_instance_delta_is_small_and_reverses() {
    let inst = instance("new-1", "10.0.9.9", NetworkPolicy::Private, true);
    let entries = tap_entries(&inst).unwrap();
    let add = render_instance(&entries, Change::Add);
    let s = add.to_string();
    assert!(s.len() < 1500, "{s}");
    assert!(s.contains(r#"{"concat":["bcb2e29df7d3n0","10.0.9.9"]}"#) || s.contains("10.0.9.9"));
    // Applying add then remove to the content lands back where it started.
    let fw = plan(&node(3), &host()).unwrap();
    let base = Tables::read(&render_full(&fw), &OWNED_TABLES);
    let mut items = render_full(&fw)["nftables"].as_array().unwrap().clone();
    items.extend(add["nftables"].as_array().unwrap().iter().cloned());
    let with = Tables::read(
        &serde_json::json!({ "nftables": items.clone() }),
        &OWNED_TABLES,
    );
    assert_eq!(with.element_counts()["bridge bcd_instances taps"], 4);
    assert_eq!(with.element_counts()["bridge bcd_instances in_policy"], 1);
    assert_eq!(
        with.element_counts()["bridge bcd_instances sandbox_taps"],
        1
    );
    items.extend(
        render_instance(&entries, Change::Remove)["nftables"]
            .as_array()
            .unwrap()
            .iter()
            .cloned(),
    );
    let back = Tables::read(&serde_json::json!({ "nftables": items }), &OWNED_TABLES);
    assert_eq!(back.element_counts(), base.element_counts());
    assert!(diff(&base, &back).is_empty());
    assert!(diff(&base.without_items(), &back).is_empty());
}

#[test]
fn drift_reports_flush_edits_and_swaps() {
    let fw = plan(&node(2), &host()).unwrap();
    let doc = render_full(&fw);
    let c = Tables::read(&doc, &OWNED_TABLES).without_items();
    let d = diff(&c, &Tables::default());
    assert!(
        d.iter()
            .any(|m| m.to_string() == "table bridge bcd_instances is missing"),
        "{d:?}"
    );
    let mut edited = Tables::read(&doc, &OWNED_TABLES);
    edited
        .tables
        .get_mut("inet bcd_taps")
        .unwrap()
        .rules
        .get_mut("forward")
        .unwrap()
        .pop();
    assert!(!diff(&c, &edited).is_empty());
    // One tap's MAC swapped for another: the count stays, the digest does not.
    let mut items = doc["nftables"].as_array().unwrap().clone();
    let tap = fw.taps[0].tap.as_str();
    items.push(
        serde_json::json!({"delete": {"element": {"family": "bridge",
        "table": "bcd_instances", "name": "tap_mac",
        "elem": [{"concat": [tap, fw.taps[0].mac.to_string()]}]}}}),
    );
    items.push(serde_json::json!({"add": {"element": {"family": "bridge",
        "table": "bcd_instances", "name": "tap_mac",
        "elem": [{"concat": [tap, "02:de:ad:be:ef:01"]}]}}}));
    let swapped = Tables::read(&serde_json::json!({ "nftables": items }), &OWNED_TABLES);
    assert_eq!(swapped.element_counts(), c.element_counts());
    let d = diff(&c, &swapped);
    assert_eq!(d.len(), 1, "{d:?}");
    assert!(d[0].to_string().contains("set tap_mac"), "{d:?}");
}

#[test]
fn entries_carry_link_local_and_unchecked() {
    let mut inst = instance("i-x", "10.0.0.5", NetworkPolicy::None, false);
    inst.nics[0].addresses.clear();
    inst.nics[0].gateway = None;
    let e = &tap_entries(&inst).unwrap()[0];
    assert!(e.ip4_unchecked());
    assert_eq!(e.ip6, vec![inst.nics[0].mac.link_local_v6()]);
}

#[test]
fn bc_bridge_fails_the_plan() {
    let mut n = node(1);
    n.instances[0].nics[0].network = Some("bcx".parse().unwrap());
    assert!(plan(&n, &host()).is_err());
}

#[test]
fn the_content_holds_chains_and_sets() {
    let fw = plan(&node(1), &host()).unwrap();
    let c = Tables::read(&render_full(&fw), &OWNED_TABLES);
    let t = &c.tables["bridge bcd_instances"];
    assert!(t.chains.contains_key("from_tap") && t.sets["in_policy"].decl.starts_with("map "));
    assert_eq!(
        t.chains["prerouting"],
        "type filter hook prerouting prio -200 policy accept"
    );
    assert!(t.sets.contains_key("tap_mac"));
    let mut extra = c.clone();
    extra
        .tables
        .get_mut("inet bcd_taps")
        .unwrap()
        .chains
        .insert("sneaky".into(), "regular".into());
    let d = diff(&c, &extra);
    assert!(d.iter().any(|m| m.to_string().contains("sneaky")), "{d:?}");
}

/// A dual-stack NIC (from the plan of a NIC with both leases): `tap_ip6` holds exactly its
/// EUI-64 link-local address and its IPv6 lease, so chain `from_tap` drops every other IPv6
/// source (neighbour discovery included: `::` only for DAD solicitations and MLD reports) and
/// the router advertisements it sends; the IPv4 lease is checked as before.
#[test]
fn dual_stack_entries_allow_the_ipv6_lease_only() {
    use crate::pool::nic::{Leases, instance_spec};
    let r = crate::pool::nic::tests::range();
    let r6 = crate::pool::nic::tests::range6();
    let leases = Leases {
        v4: Some(("10.0.0.2".parse().unwrap(), &r)),
        v6: Some(("2001:db8::2".parse().unwrap(), &r6)),
    };
    let br = "br0".parse().unwrap();
    let inst = instance_spec("inst-1", "a-1", &br, leases, NetworkPolicy::Public, false).unwrap();
    let e = &tap_entries(&inst).unwrap()[0];
    assert!(!e.ip4_unchecked());
    assert_eq!(e.ip4, ["10.0.0.2".parse::<Ipv4Addr>().unwrap()]);
    assert_eq!(
        e.ip6,
        [
            inst.nics[0].mac.link_local_v6(),
            "2001:db8::2".parse().unwrap()
        ]
    );
    let add = render_instance(std::slice::from_ref(e), Change::Add);
    let ip6: Vec<&Value> = add["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["add"]["element"]["name"] == "tap_ip6")
        .flat_map(|c| c["add"]["element"]["elem"].as_array().unwrap())
        .collect();
    assert_eq!(
        ip6,
        [
            &json!({"concat": ["bc81bf91245cn0", "fe80::81:bfff:fe91:245c"]}),
            &json!({"concat": ["bc81bf91245cn0", "2001:db8::2"]})
        ]
    );
    // The rules that make the set the only IPv6 sources: the source check and the `::`
    // exceptions, and the drop of router advertisements.
    let rules: Vec<String> = rules::from_tap()
        .iter()
        .map(|r| json!(r).to_string())
        .collect();
    let has = |parts: &[&str]| rules.iter().any(|r| parts.iter().all(|p| r.contains(p)));
    assert!(has(&[
        r#""field":"saddr","protocol":"ip6""#,
        r#""right":"@tap_ip6""#,
        r#""op":"!=""#
    ]));
    assert!(has(&[
        r#""right":"::""#,
        "nd-neighbor-solicit",
        "mld2-listener-report"
    ]));
    assert!(has(&["nd-router-advert", "nd-redirect", "drop"]));
    // An IPv6 gateway the host owns is reachable (ICMPv6 and DNS), not blocked.
    let host = HostAddrs {
        own: vec!["10.0.0.1".parse().unwrap(), "2001:db8::1".parse().unwrap()],
        gateways: vec!["10.0.0.1".parse().unwrap(), "2001:db8::1".parse().unwrap()],
    };
    let els: std::collections::BTreeMap<_, _> = host_elements(&host).into_iter().collect();
    assert_eq!(els["host_gw6"], [json!("2001:db8::1")]);
    assert!(els["host_block6"].is_empty());
    assert_eq!(els["reserved4"], [json!("10.0.0.1")]);
}
