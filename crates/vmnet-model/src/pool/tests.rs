use super::*;

fn req(cidr: &str, gw: &str) -> SetIpPool {
    SetIpPool {
        pool_id: "p1".into(),
        cidr: cidr.into(),
        gateway: gw.into(),
        ..Default::default()
    }
}

#[test]
fn defaults_follow_the_spec() {
    let r = req("10.0.0.0/24", "10.0.0.1").validate().unwrap();
    assert_eq!(r.first_host, Ipv4Addr::new(10, 0, 0, 2));
    assert_eq!(r.last_host, Ipv4Addr::new(10, 0, 0, 254));
    assert!(r.dns.is_empty());
    assert_eq!(r.size(), 253);
}

#[test]
fn slash31_and_slash32() {
    let r = req("10.0.0.0/31", "10.0.0.0").validate().unwrap();
    assert_eq!(
        (r.first_host, r.last_host),
        (Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 1))
    );
    let mut q = req("10.0.0.5/32", "10.0.0.1");
    assert!(q.validate().is_err());
    q.first_host = Some("10.0.0.5".into());
    let r = q.validate().unwrap();
    assert_eq!(r.size(), 1);
}

fn invalid(r: &SetIpPool) -> String {
    let e = r.validate().expect_err("must be refused");
    e.message()
}

#[test]
fn addresses_are_parsed_strictly() {
    assert_eq!(
        invalid(&req("010.5.0.0/24", "10.5.0.1")),
        r#"pool p1: cidr "010.5.0.0/24" is not an IPv4 CIDR such as 10.0.0.0/24"#
    );
    assert_eq!(
        invalid(&req(" 10.5.0.0/24", "10.5.0.1")),
        r#"pool p1: cidr " 10.5.0.0/24" is not an IPv4 CIDR such as 10.0.0.0/24"#
    );
    assert_eq!(
        invalid(&req("10.5.0.0/024", "10.5.0.1")),
        r#"pool p1: cidr "10.5.0.0/024" is not an IPv4 CIDR such as 10.0.0.0/24"#
    );
    assert_eq!(
        invalid(&req("10.5.0.0/24", "10.5.0.01")),
        r#"pool p1: gateway "10.5.0.01" is not an IPv4 address"#
    );
    assert_eq!(
        invalid(&req("10.5.0.0/24", "10.5.0.1 ")),
        r#"pool p1: gateway "10.5.0.1 " is not an IPv4 address"#
    );
    let mut q = req("10.5.0.0/24", "10.5.0.1");
    q.first_host = Some("10.5.0.010".into());
    assert_eq!(
        invalid(&q),
        r#"pool p1: first_host "10.5.0.010" is not an IPv4 address"#
    );
    let mut q = req("10.5.0.0/24", "10.5.0.1");
    q.dns = vec![" 1.1.1.1".into()];
    assert_eq!(
        invalid(&q),
        r#"pool p1: dns[0] " 1.1.1.1" is not an IP address"#
    );
    assert_eq!(
        invalid(&req("fd00::/64", "10.5.0.1")),
        "pool p1: cidr fd00::/64 is IPv6; only IPv4 ranges are supported"
    );
    assert!(req("10.5.0.0/24", "10.5.0.1").validate().is_ok());
}

#[test]
fn gateway_on_network_or_broadcast_is_refused() {
    assert_eq!(
        invalid(&req("10.5.0.0/24", "10.5.0.0")),
        "pool p1: gateway 10.5.0.0 is the network address of 10.5.0.0/24"
    );
    assert_eq!(
        invalid(&req("10.5.0.0/24", "10.5.0.255")),
        "pool p1: gateway 10.5.0.255 is the broadcast address of 10.5.0.0/24"
    );
    assert_eq!(
        invalid(&req("10.5.0.4/30", "10.5.0.7")),
        "pool p1: gateway 10.5.0.7 is the broadcast address of 10.5.0.4/30"
    );
    // A gateway outside the cidr stays allowed (spec: "The gateway may lie outside the range").
    let mut q = req("10.5.0.0/24", "10.9.0.1");
    q.first_host = Some("10.5.0.1".into());
    assert_eq!(q.validate().unwrap().size(), 254);
    // /31: both addresses are usable (RFC 3021), so either may be the gateway.
    assert!(req("10.5.0.0/31", "10.5.0.1").validate().is_err());
    assert!(req("10.5.0.0/31", "10.5.0.0").validate().is_ok());
}

#[test]
fn slash32_default_first_host_gets_the_hint() {
    assert_eq!(
        invalid(&req("10.0.0.5/32", "10.0.0.1")),
        "pool p1: first_host 10.0.0.2 is outside cidr 10.0.0.5/32 (the default is the address after the gateway; set first_host explicitly)"
    );
    assert_eq!(
        invalid(&req("10.0.0.5/32", "10.0.0.5")),
        "pool p1: first_host 10.0.0.6 is outside cidr 10.0.0.5/32 (the default is the address after the gateway; set first_host explicitly)"
    );
    let mut q = req("10.0.0.5/32", "10.0.0.1");
    q.first_host = Some("10.0.0.9".into());
    assert_eq!(
        invalid(&q),
        "pool p1: first_host 10.0.0.9 is outside cidr 10.0.0.5/32"
    );
    let mut q = req("10.0.0.5/32", "10.0.0.5");
    q.first_host = Some("10.0.0.5".into());
    assert_eq!(q.validate().unwrap().size(), 0);
}

#[test]
fn new_instance_defaults_vcpus_and_memory() {
    let i: NewInstance = serde_json::from_str(r#"{"instance_id":"vm1","pool_id":"p1"}"#).unwrap();
    assert_eq!((i.vcpus, i.memory_mib), (1, 512));
    assert_eq!((i.vcpus, i.memory_mib), (DEFAULT_VCPUS, DEFAULT_MEMORY_MIB));
    let i: NewInstance =
        serde_json::from_str(r#"{"instance_id":"vm1","pool_id":"p1","vcpus":4,"memory_mib":2048}"#)
            .unwrap();
    assert_eq!((i.vcpus, i.memory_mib), (4, 2048));
}

#[test]
fn new_instance_policy_and_sandbox() {
    let i: NewInstance = serde_json::from_str(r#"{"instance_id":"vm1","pool_id":"p1"}"#).unwrap();
    assert_eq!(i, NewInstance::new("vm1", "p1"));
    assert_eq!(
        (i.network_policy, i.sandbox),
        (NetworkPolicy::Public, false)
    );
    let i: NewInstance = serde_json::from_str(
        r#"{"instance_id":"vm1","pool_id":"p1","network_policy":"none","sandbox":true}"#,
    )
    .unwrap();
    assert_eq!((i.network_policy, i.sandbox), (NetworkPolicy::None, true));
    let e = serde_json::from_str::<NewInstance>(
        r#"{"instance_id":"vm1","pool_id":"p1","network_policy":"Private"}"#,
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains(r#"unknown network_policy "Private", expected one of public, private, none"#),
        "{e}"
    );
    for p in NetworkPolicy::ALL {
        assert_eq!(p.as_str().parse::<NetworkPolicy>().unwrap(), p);
        assert_eq!(serde_json::to_string(&p).unwrap(), format!("\"{p}\""));
    }
    assert_eq!(
        "open".parse::<NetworkPolicy>().unwrap_err().message(),
        "network_policy \"open\" is not one of public, private, none"
    );
}

#[test]
fn allocation_ids_are_valid_and_distinct() {
    assert_eq!(Instance::allocation_id_for("vm1", 7), "alloc-7-vm1");
    let long = "a".repeat(MAX_ID_LEN);
    let a = Instance::allocation_id_for(&long, 1);
    let b = Instance::allocation_id_for(&long, 2);
    assert_ne!(a, b);
    for id in [&a, &b] {
        assert_eq!(id.len(), MAX_ID_LEN);
        validate_id("allocation_id", id).unwrap();
    }
    let huge = Instance::allocation_id_for(&long, u64::MAX);
    validate_id("allocation_id", &huge).unwrap();
    assert!(huge.starts_with(&format!("alloc-{}-", u64::MAX)));
}

fn report(json: &str) -> Result<Vec<(String, Vec<IpNet>)>, ValidationError> {
    let r: StatusReport =
        serde_json::from_str(json).map_err(|e| ValidationError::rule(e.to_string()))?;
    r.validate()
}

#[test]
fn status_report_parses_cidrs_in_order_without_repeats() {
    let got = report(
        r#"{"instances": [
            {"instance_id": "vm1", "addresses": ["10.0.0.2/29", "2001:db8::5/64", "10.0.0.2/29"]},
            {"instance_id": "vm2", "addresses": []},
            {"instance_id": "vm3"}
        ]}"#,
    )
    .unwrap();
    let want: Vec<(String, Vec<IpNet>)> = vec![
        (
            "vm1".into(),
            vec![
                "10.0.0.2/29".parse().unwrap(),
                "2001:db8::5/64".parse().unwrap(),
            ],
        ),
        ("vm2".into(), vec![]),
        ("vm3".into(), vec![]),
    ];
    assert_eq!(got, want);
}

#[test]
fn status_report_is_strict() {
    let bad = |json: &str| {
        let e = report(json).expect_err(json);
        e.message()
    };
    assert!(bad(r#"{"instances": [], "extra": 1}"#).contains("unknown field `extra`"));
    assert!(
        bad(r#"{"instances": [{"instance_id": "vm1", "address": "10.0.0.2/29"}]}"#)
            .contains("unknown field `address`")
    );
    assert!(bad("{}").contains("missing field `instances`"));
    for (a, why) in [
        ("10.0.0.2", "no prefix length"),
        ("10.0.0.2/33", "prefix too long"),
        ("10.0.0.2/024", "leading zero in the prefix"),
        (" 10.0.0.2/24", "whitespace"),
        ("010.0.0.2/24", "leading zero in the address"),
        ("2001:db8::5/129", "IPv6 prefix too long"),
        ("vm", "not an address"),
    ] {
        let json = format!(
            r#"{{"instances": [{{"instance_id": "vm1", "addresses": ["10.0.0.3/29", "{a}"]}}]}}"#
        );
        assert_eq!(
            bad(&json),
            format!(
                "instance vm1: addresses[1] {a:?} is not an address in CIDR form such as 10.0.0.2/24"
            ),
            "{why}"
        );
    }
    assert_eq!(
        bad(r#"{"instances": [{"instance_id": "vm1"}, {"instance_id": "vm1"}]}"#),
        "status report: instance vm1 appears twice"
    );
    assert_eq!(
        bad(r#"{"instances": [{"instance_id": "vm1"}, {"instance_id": "a;b"}]}"#),
        "status report: instances[1].instance_id \"a;b\" may only contain A-Z a-z 0-9 . _ - and must start with a letter or digit"
    );
    let many = StatusReport {
        instances: vec![ReportedInstance {
            instance_id: "vm1".into(),
            addresses: (0..=MAX_REPORTED_ADDRESSES)
                .map(|i| format!("10.0.{i}.1/24"))
                .collect(),
        }],
    };
    assert_eq!(
        many.validate().unwrap_err().message(),
        "instance vm1: 65 addresses; at most 64 are allowed"
    );
}

#[test]
fn instance_addresses_default_to_empty() {
    let i: Instance = serde_json::from_value(serde_json::json!({
        "instance_id": "vm1", "pool_id": "p1", "host_id": null, "vcpus": 1, "memory_mib": 512,
        "recreate_on_host_loss": false, "state": "lost", "conditions": [], "address": null
    }))
    .unwrap();
    assert!(i.addresses.is_empty());
}

#[test]
fn ranges_that_cannot_hold_guests_are_refused() {
    for (cidr, gw, message) in [
        (
            "127.0.0.0/24",
            "127.0.0.1",
            "pool p1: cidr 127.0.0.0/24 lies in 127.0.0.0/8 (loopback), which cannot hold guest addresses",
        ),
        (
            "224.1.0.0/24",
            "224.1.0.1",
            "pool p1: cidr 224.1.0.0/24 lies in 224.0.0.0/4 (multicast), which cannot hold guest addresses",
        ),
        (
            "240.0.0.0/16",
            "240.0.0.1",
            "pool p1: cidr 240.0.0.0/16 lies in 240.0.0.0/4 (reserved), which cannot hold guest addresses",
        ),
        (
            "255.255.255.255/32",
            "10.0.0.1",
            "pool p1: cidr 255.255.255.255/32 lies in 240.0.0.0/4 (reserved), which cannot hold guest addresses",
        ),
        (
            "0.0.0.0/24",
            "0.0.0.1",
            "pool p1: cidr 0.0.0.0/24 lies in 0.0.0.0/8 (\"this network\"), which cannot hold guest addresses",
        ),
        (
            "169.254.0.0/16",
            "169.254.0.1",
            "pool p1: cidr 169.254.0.0/16 lies in 169.254.0.0/16 (link-local), which cannot hold guest addresses",
        ),
        (
            "0.0.0.0/0",
            "10.0.0.1",
            "pool p1: cidr 0.0.0.0/0 has prefix length 0; it must be between /16 and /32",
        ),
        (
            "10.0.0.0/8",
            "10.0.0.1",
            "pool p1: cidr 10.0.0.0/8 has prefix length 8; it must be between /16 and /32",
        ),
        (
            "172.16.0.0/15",
            "172.16.0.1",
            "pool p1: cidr 172.16.0.0/15 has prefix length 15; it must be between /16 and /32",
        ),
    ] {
        assert_eq!(invalid(&req(cidr, gw)), message, "{cidr}");
    }
    // The limits themselves are accepted.
    let r = req("10.20.0.0/16", "10.20.0.1").validate().unwrap();
    assert_eq!(r.size(), 65_533);
    let mut q = req("203.0.113.7/32", "169.254.1.1");
    q.first_host = Some("203.0.113.7".into());
    assert_eq!(
        q.validate().unwrap().size(),
        1,
        "a link-local gateway for a routed /32"
    );
}

#[test]
fn gateways_that_cannot_route_are_refused() {
    for (gw, message) in [
        (
            "127.0.0.1",
            "pool p1: gateway 127.0.0.1 lies in 127.0.0.0/8 (loopback), which cannot be a gateway",
        ),
        (
            "0.0.0.0",
            "pool p1: gateway 0.0.0.0 lies in 0.0.0.0/8 (\"this network\"), which cannot be a gateway",
        ),
        (
            "255.255.255.255",
            "pool p1: gateway 255.255.255.255 lies in 240.0.0.0/4 (reserved), which cannot be a gateway",
        ),
        (
            "224.0.0.1",
            "pool p1: gateway 224.0.0.1 lies in 224.0.0.0/4 (multicast), which cannot be a gateway",
        ),
    ] {
        let mut q = req("10.5.0.0/24", gw);
        q.first_host = Some("10.5.0.2".into());
        assert_eq!(invalid(&q), message, "{gw}");
    }
}

fn with_dns(dns: &[&str]) -> SetIpPool {
    let mut q = req("10.5.0.0/24", "10.5.0.1");
    q.dns = dns.iter().map(|s| (*s).to_owned()).collect();
    q
}

#[test]
fn dns_servers_must_be_unicast_once_and_few() {
    for (dns, message) in [
        (
            &["0.0.0.0"][..],
            "pool p1: dns[0] 0.0.0.0 is the unspecified address",
        ),
        (
            &["10.5.0.1", "::"][..],
            "pool p1: dns[1] :: is the unspecified address",
        ),
        (
            &["255.255.255.255"][..],
            "pool p1: dns[0] 255.255.255.255 is the broadcast address",
        ),
        (
            &["::ffff:10.5.0.1"][..],
            "pool p1: dns[0] ::ffff:10.5.0.1 is an IPv4-mapped IPv6 address; give the IPv4 address 10.5.0.1",
        ),
        (
            &["10.5.0.53", "2001:db8::53", "10.5.0.53"][..],
            "pool p1: dns[2] 10.5.0.53 repeats dns[0]",
        ),
        (
            &["2001:db8::53", "2001:DB8:0::53"][..],
            "pool p1: dns[1] 2001:db8::53 repeats dns[0]",
        ),
        (
            &["224.0.0.251"][..],
            "pool p1: dns[0] 224.0.0.251 is a multicast address",
        ),
        (
            &["ff02::fb"][..],
            "pool p1: dns[0] ff02::fb is a multicast address",
        ),
    ] {
        assert_eq!(invalid(&with_dns(dns)), message, "{dns:?}");
    }
    let many: Vec<String> = (1..=9).map(|i| format!("10.5.0.{i}")).collect();
    let many: Vec<&str> = many.iter().map(String::as_str).collect();
    assert_eq!(
        invalid(&with_dns(&many)),
        "pool p1: dns has 9 entries; at most 8 are allowed"
    );
    let thousand: Vec<String> = (0..1000)
        .map(|i| format!("10.6.{}.{}", i / 250, i % 250 + 1))
        .collect();
    let thousand: Vec<&str> = thousand.iter().map(String::as_str).collect();
    assert_eq!(
        invalid(&with_dns(&thousand)),
        "pool p1: dns has 1000 entries; at most 8 are allowed"
    );
    let r = with_dns(&many[..8]).validate().unwrap();
    assert_eq!(r.dns.len(), 8);
    let r = with_dns(&["10.5.0.1", "2001:db8::53", "127.0.0.53"])
        .validate()
        .unwrap();
    assert_eq!(
        r.dns.len(),
        3,
        "the gateway, IPv6 and a loopback resolver are fine"
    );
}

#[test]
fn ranges_clash_on_overlap_or_a_leased_gateway() {
    let r = |pool: &str, cidr: &str, gw: &str, first: Option<&str>| {
        let mut q = req(cidr, gw);
        q.pool_id = pool.into();
        q.first_host = first.map(Into::into);
        q.validate().unwrap()
    };
    let a = r("a", "10.0.0.0/24", "10.0.0.1", None);
    assert_eq!(
        r("b", "10.0.0.0/16", "10.0.9.1", None).clash(&a).as_deref(),
        Some("cidr 10.0.0.0/16 overlaps cidr 10.0.0.0/24 of pool a")
    );
    assert_eq!(
        r("b", "10.0.0.200/29", "10.0.0.201", None)
            .clash(&a)
            .as_deref(),
        Some("cidr 10.0.0.200/29 overlaps cidr 10.0.0.0/24 of pool a")
    );
    assert_eq!(
        r("b", "10.0.1.0/24", "10.0.0.7", Some("10.0.1.1"))
            .clash(&a)
            .as_deref(),
        Some("gateway 10.0.0.7 is a leasable address of pool a (10.0.0.2 to 10.0.0.254)")
    );
    assert_eq!(
        a.clash(&r("b", "10.0.1.5/32", "10.0.0.7", Some("10.0.1.5")))
            .as_deref(),
        Some(
            "the gateway 10.0.0.7 of pool b would be leased by this range (10.0.0.2 to 10.0.0.254)"
        )
    );
    // Neighbours, a shared gateway that neither leases, routed /32s: no clash.
    assert_eq!(r("b", "10.0.1.0/24", "10.0.1.1", None).clash(&a), None);
    assert_eq!(
        r("b", "10.0.1.5/32", "10.0.0.1", Some("10.0.1.5")).clash(&a),
        None
    );
}
