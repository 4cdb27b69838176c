use super::*;

fn nic(network: &str) -> NicSpec {
    NicSpec {
        network: Some(network.parse().unwrap()),
        mac: MacAddr::for_instance("inst-1"),
        addresses: vec!["10.0.0.2/24".parse().unwrap()],
        gateway: Some("10.0.0.1".parse().unwrap()),
        gateway6: None,
        nameservers: vec!["10.0.0.53".parse().unwrap()],
    }
}

fn inst(nics: Vec<NicSpec>) -> InstanceSpec {
    InstanceSpec {
        id: "inst-1".into(),
        allocation_id: "alloc-1".into(),
        policy: NetworkPolicy::Public,
        sandbox: false,
        nics,
    }
}

#[test]
fn mac_is_02_then_first_10_hex_of_sha256() {
    // sha256("inst-1") = 81bf91245ce284f9…
    assert_eq!(instance_hash10("inst-1"), "81bf91245c");
    assert_eq!(
        MacAddr::for_instance("inst-1").to_string(),
        "02:81:bf:91:24:5c"
    );
}

#[test]
fn tap_name_uses_the_same_digits_and_fits_15_bytes() {
    assert_eq!(tap_name("inst-1", 0).unwrap().as_str(), "bc81bf91245cn0");
    let t = tap_name("inst-1", 99).unwrap();
    assert_eq!(t.as_str(), "bc81bf91245cn99");
    assert_eq!(t.as_str().len(), 15);
    assert!(tap_name("inst-1", 100).is_err());
}

#[test]
fn link_local_is_modified_eui64() {
    let mac: MacAddr = "02:81:bf:91:24:5c".parse().unwrap();
    assert_eq!(mac.link_local_v6().to_string(), "fe80::81:bfff:fe91:245c");
}

#[test]
fn mac_parse_round_trips_and_refuses_junk() {
    let m: MacAddr = "02:AB:cd:00:11:ff".parse().unwrap();
    assert_eq!(m.to_string(), "02:ab:cd:00:11:ff");
    for bad in [
        "",
        "02:ab",
        "02:ab:cd:00:11:ff:00",
        "02-ab-cd-00-11-ff",
        "0g:ab:cd:00:11:ff",
        "2:ab:cd:00:11:ff0",
    ] {
        assert!(bad.parse::<MacAddr>().is_err(), "{bad}");
    }
}

#[test]
fn ifname_rules() {
    assert!("br0".parse::<IfName>().is_ok());
    for bad in ["", ".", "..", "a b", "x\"y", "0123456789abcdef", "br0;drop"] {
        assert!(bad.parse::<IfName>().is_err(), "{bad}");
    }
}

#[test]
fn valid_instance_passes() {
    inst(vec![nic("br0")]).validate().unwrap();
}

#[test]
fn nic_without_network_is_refused() {
    let mut n = nic("br0");
    n.network = None;
    let e = inst(vec![n]).validate().unwrap_err();
    assert!(
        e.message().contains("instance inst-1") && e.message().contains("nics[0].network"),
        "{e}"
    );
}

#[test]
fn bridge_starting_with_bc_fails_the_instance() {
    let e = inst(vec![nic("bcbridge")]).validate().unwrap_err();
    assert!(
        e.message()
            .contains("instance inst-1: nics[0].network \"bcbridge\""),
        "{e}"
    );
}

#[test]
fn gateway_without_address_is_refused() {
    let mut n = nic("br0");
    n.addresses.clear();
    let e = inst(vec![n]).validate().unwrap_err();
    assert!(e.message().contains("nics[0]: gateway"), "{e}");
}

#[test]
fn gateway_family_must_match_an_address() {
    let mut n = nic("br0");
    n.gateway = Some("2001:db8::1".parse().unwrap());
    let e = inst(vec![n]).validate().unwrap_err();
    assert!(e.message().contains("nics[0].gateway 2001:db8::1"), "{e}");
}

/// A dual-stack NIC: `gateway` the IPv4 range's, `gateway6` the IPv6 range's; each needs an
/// address of its family, there is one IPv6 gateway at most, and an IPv4-only NIC's JSON has no
/// `gateway6` key.
#[test]
fn gateway6_rules_and_wire_form() {
    let mut n = nic("br0");
    let v4_only = serde_json::to_value(&n).unwrap();
    assert!(v4_only.get("gateway6").is_none(), "{v4_only}");
    n.gateway6 = Some("2001:db8::1".parse().unwrap());
    let e = inst(vec![n.clone()]).validate().unwrap_err();
    assert!(
        e.message()
            .contains("nics[0].gateway6 2001:db8::1 has no address of its family"),
        "{e}"
    );
    n.addresses.push("2001:db8::5/64".parse().unwrap());
    inst(vec![n.clone()]).validate().unwrap();
    assert_eq!(
        n.gateways().map(|g| g.to_string()).collect::<Vec<_>>(),
        ["10.0.0.1", "2001:db8::1"]
    );
    let j = serde_json::to_value(&n).unwrap();
    assert_eq!(j["gateway6"], "2001:db8::1");
    assert_eq!(serde_json::from_value::<NicSpec>(j).unwrap(), n);
    // Two IPv6 gateways: refused.
    let mut two = n.clone();
    two.gateway = Some("2001:db8::2".parse().unwrap());
    let e = inst(vec![two]).validate().unwrap_err();
    assert!(e.message().contains("both IPv6"), "{e}");
    // An IPv6-only NIC with its gateway in gateway6.
    let mut v6 = n.clone();
    v6.addresses.remove(0);
    v6.gateway = None;
    inst(vec![v6.clone()]).validate().unwrap();
    // gateway6 without addresses.
    v6.addresses.clear();
    v6.nameservers.clear();
    let e = inst(vec![v6]).validate().unwrap_err();
    assert!(e.message().contains("without addresses"), "{e}");
    // An IPv4 address in gateway6 fails parsing.
    let bad = r#"{"network":"br0","mac":"02:00:00:00:00:01","addresses":["10.0.0.2/24"],"gateway6":"10.0.0.1"}"#;
    assert!(serde_json::from_str::<NicSpec>(bad).is_err());
}

#[test]
fn duplicate_mac_is_refused() {
    let e = inst(vec![nic("br0"), nic("br0")]).validate().unwrap_err();
    assert!(e.message().contains("nics[1].mac"), "{e}");
}

#[test]
fn bad_instance_id_is_refused() {
    let mut i = inst(vec![]);
    i.id = "a\nb".into();
    assert!(i.validate().is_err());
}

#[test]
fn node_spec_json_keeps_nic_order_and_refuses_injection() {
    let json = r#"{"instances":[{"id":"i-1","allocationId":"a-1","nics":[
        {"network":"br0","mac":"02:00:00:00:00:01","addresses":["10.0.0.2/24"],"gateway":"10.0.0.1"},
        {"network":"br1","mac":"02:00:00:00:00:02"}]}]}"#;
    let spec = NodeSpec::from_json(json).unwrap();
    let nets: Vec<_> = spec.instances[0]
        .nics
        .iter()
        .map(|n| n.network.clone().unwrap().to_string())
        .collect();
    assert_eq!(nets, ["br0", "br1"]);
    let back = serde_json::to_string(&spec).unwrap();
    assert_eq!(NodeSpec::from_json(&back).unwrap(), spec);

    for evil in [
        r#""10.0.0.2/24\n  - 6.6.6.6/32""#,
        r#""10.0.0.2/24\"}, {\"x\": 1""#,
        r#""10.0.0.2/24; flush ruleset""#,
        r#""{10.0.0.2/24}""#,
    ] {
        let j = format!(
            r#"{{"instances":[{{"id":"i-1","allocationId":"a-1","nics":[{{"network":"br0","mac":"02:00:00:00:00:01","addresses":[{evil}]}}]}}]}}"#
        );
        let e = NodeSpec::from_json(&j).unwrap_err();
        assert!(matches!(e, ValidationError::Json { .. }), "{evil}: {e}");
    }
    let j = r#"{"instances":[{"id":"i-1","allocationId":"a-1","nics":[{"network":"br0","mac":"02:00:00:00:00:01","addresses":["10.0.0.2/24"],"gateway":"10.0.0.1","nameservers":["1.1.1.1 # yaml"]}]}]}"#;
    assert!(NodeSpec::from_json(j).is_err());
}

#[test]
fn allocation_id_is_allocation_id_camel_case_on_the_wire() {
    let v = serde_json::to_value(inst(vec![])).unwrap();
    assert_eq!(v["allocationId"], "alloc-1");
    assert!(v.get("allocation_id").is_none(), "{v}");
    let node = NodeSpec {
        instances: vec![inst(vec![nic("br0")])],
    };
    let text = serde_json::to_string(&node).unwrap();
    assert!(text.contains(r#""allocationId":"alloc-1""#), "{text}");
    assert_eq!(NodeSpec::from_json(&text).unwrap(), node);

    // The old name is still accepted, never both at once.
    let old = r#"{"instances":[{"id":"i-1","allocation_id":"a-1"}]}"#;
    assert_eq!(
        NodeSpec::from_json(old).unwrap().instances[0].allocation_id,
        "a-1"
    );
    let both = r#"{"instances":[{"id":"i-1","allocation_id":"a-1","allocationId":"a-2"}]}"#;
    let e = NodeSpec::from_json(both).unwrap_err();
    assert!(matches!(e, ValidationError::Json { .. }), "{e}");
    let missing = r#"{"instances":[{"id":"i-1"}]}"#;
    let e = NodeSpec::from_json(missing).unwrap_err();
    assert!(e.message().contains("allocationId"), "{e}");
    let bad = r#"{"instances":[{"id":"i-1","allocationId":"a b"}]}"#;
    let e = NodeSpec::from_json(bad).unwrap_err();
    assert!(
        e.message().contains("instance i-1") && e.message().contains("allocationId"),
        "{e}"
    );
}

#[test]
fn lease_cidr_in_range_takes_its_prefix_outside_is_32() {
    let a: Ipv4Addr = "10.0.0.2".parse().unwrap();
    let net = |s: &str| Some(s.parse::<Ipv4Net>().unwrap());
    assert_eq!(lease_cidr(a, net("10.0.0.0/29")).to_string(), "10.0.0.2/29");
    assert_eq!(lease_cidr(a, net("10.0.0.0/8")).to_string(), "10.0.0.2/8");
    // Replaced range no longer containing the lease, or no range at all.
    assert_eq!(lease_cidr(a, net("10.0.1.0/24")).to_string(), "10.0.0.2/32");
    assert_eq!(lease_cidr(a, None).to_string(), "10.0.0.2/32");
    assert_eq!(lease_cidr(a, net("10.0.0.2/32")).to_string(), "10.0.0.2/32");
}

#[test]
fn reports_only_append() {
    let mut addrs: Vec<IpNet> = vec!["10.0.0.2/24".parse().unwrap()];
    append_reported(
        &mut addrs,
        &[
            "fd00::5/64".parse().unwrap(),
            "10.0.0.2/24".parse().unwrap(),
        ],
    );
    append_reported(&mut addrs, &["192.168.1.9/24".parse().unwrap()]);
    let s: Vec<String> = addrs.iter().map(ToString::to_string).collect();
    assert_eq!(s, ["10.0.0.2/24", "fd00::5/64", "192.168.1.9/24"]);
}

#[test]
fn provider_polls_replace_and_proxmox_drops_loopback_and_link_local() {
    let r: Vec<IpNet> = [
        "127.0.0.1/8",
        "203.0.113.7/32",
        "fe80::1/64",
        "2001:db8:1::/64",
        "10.1.0.5/24",
        "::1/128",
        "169.254.3.3/16",
    ]
    .iter()
    .map(|s| s.parse().unwrap())
    .collect();
    let all = provider_addresses(&r, false);
    assert_eq!(all, r);
    let pve: Vec<String> = provider_addresses(&r, true)
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(pve, ["203.0.113.7/32", "2001:db8:1::/64", "10.1.0.5/24"]);
    assert!(provider_addresses(&[], true).is_empty());
}

proptest::proptest! {
    #[test]
    fn tap_names_always_fit(id in "[a-zA-Z0-9_.:-]{1,128}", idx in 0usize..100) {
        let t = tap_name(&id, idx).unwrap();
        proptest::prop_assert!(t.as_str().len() <= IFNAME_MAX);
        proptest::prop_assert!(t.as_str().starts_with("bc"));
        let mac = MacAddr::for_instance(&id).to_string();
        proptest::prop_assert_eq!(&mac[..2], "02");
        proptest::prop_assert_eq!(mac.replace(':', "")[2..].to_string(), instance_hash10(&id));
    }
}
