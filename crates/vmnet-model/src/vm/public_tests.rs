//! One fixture per validation rule of `public_ipv4` / `public_ipv6`, each with its exact error.

use super::*;

fn cfg(extra: &str, routes: &str) -> String {
    format!(
        r#"{{"id":"vm-7","user_id":7,"tenant":1,"mesh_ipv6":"fdaa:1::7"{extra},"network":{{"routes":[{routes}]}}}}"#
    )
}

const BOTH: &str =
    r#"{"destination":"0.0.0.0/0","via":"host"},{"destination":"::/0","via":"host"}"#;

fn err(json: &str) -> String {
    let e = parse_vm_config(json.as_bytes()).expect_err("must be refused");
    assert!(matches!(e, ValidationError::Rule(_)), "{e:?}");
    e.message()
}

fn ok(extra: &str) -> VmConfig {
    parse_vm_config(cfg(extra, BOTH).as_bytes()).expect("valid")
}

#[test]
fn public_addresses_parse_and_round_trip() {
    let c = ok(r#","public_ipv4":"203.0.113.57","public_ipv6":"2001:db8:7::/56""#);
    assert_eq!(c.public_ipv4, Some("203.0.113.57".parse().unwrap()));
    assert_eq!(
        c.public_ipv6_block(),
        Some("2001:db8:7::/56".parse().unwrap())
    );
    assert_eq!(c.public_ipv6_mapped(), None);
    let v = serde_json::to_value(&c).unwrap();
    assert_eq!(v["public_ipv4"], "203.0.113.57");
    assert_eq!(v["public_ipv6"], "2001:db8:7::/56");
    assert_eq!(serde_json::from_value::<VmConfig>(v).unwrap(), c);
}

#[test]
fn a_slash_128_is_the_address_form_and_a_slash_32_the_address() {
    let c = ok(r#","public_ipv4":"198.51.100.7/32","public_ipv6":"2001:db8::7/128""#);
    assert_eq!(c.public_ipv4, Some("198.51.100.7".parse().unwrap()));
    assert_eq!(c.public_ipv6_mapped(), Some("2001:db8::7".parse().unwrap()));
    let v = serde_json::to_value(&c).unwrap();
    assert_eq!(v["public_ipv4"], "198.51.100.7");
    assert_eq!(v["public_ipv6"], "2001:db8::7");
    let plain = ok(r#","public_ipv6":"2001:db8::7""#);
    assert_eq!(plain.public_ipv6, c.public_ipv6);
    let none = ok("");
    let v = serde_json::to_value(&none).unwrap();
    assert!(v.get("public_ipv4").is_none() && v.get("public_ipv6").is_none());
}

#[test]
fn rule_public_ipv4_needs_an_ipv4_route_via_host() {
    let only_v6 = r#"{"destination":"::/0","via":"host"}"#;
    assert_eq!(
        err(&cfg(r#","public_ipv4":"203.0.113.57""#, only_v6)),
        "vm vm-7: public_ipv4 203.0.113.57 needs an IPv4 route via host (e.g. 0.0.0.0/0 via host): its replies leave through the host uplink"
    );
    assert_eq!(
        err(r#"{"id":"vm-7","user_id":7,"tenant":1,"public_ipv4":"203.0.113.57"}"#),
        "vm vm-7: public_ipv4 203.0.113.57 needs an IPv4 route via host (e.g. 0.0.0.0/0 via host): its replies leave through the host uplink"
    );
}

#[test]
fn rule_public_ipv6_needs_an_ipv6_route_via_host() {
    let only_v4 = r#"{"destination":"0.0.0.0/0","via":"host"}"#;
    assert_eq!(
        err(&cfg(r#","public_ipv6":"2001:db8::7""#, only_v4)),
        "vm vm-7: public_ipv6 2001:db8::7 needs an IPv6 route via host (e.g. ::/0 via host): its replies leave through the host uplink"
    );
    let via_gateway =
        r#"{"destination":"0.0.0.0/0","via":"host"},{"destination":"::/0","via":"fdaa:1::56"}"#;
    assert_eq!(
        err(&cfg(r#","public_ipv6":"2001:db8:7::/56""#, via_gateway)),
        "vm vm-7: public_ipv6 2001:db8:7::/56 is a block: a VM that owns a block needs the route ::/0 via host (its ::/0 goes via fdaa:1::56 instead): its replies to any address leave through the host uplink"
    );
    assert_eq!(
        err(&cfg(r#","public_ipv6":"2001:db8::7""#, via_gateway)),
        "vm vm-7: public_ipv6 2001:db8::7 needs an IPv6 route via host (e.g. ::/0 via host) (its ::/0 goes via fdaa:1::56 instead): its replies leave through the host uplink"
    );
}

#[test]
fn rule_a_block_needs_the_default_route_via_host() {
    let narrower = r#"{"destination":"2000::/3","via":"host"}"#;
    assert_eq!(
        err(&cfg(r#","public_ipv6":"2001:db8:7::/56""#, narrower)),
        "vm vm-7: public_ipv6 2001:db8:7::/56 is a block: a VM that owns a block needs the route ::/0 via host: its replies to any address leave through the host uplink"
    );
    // A /128 is mapped by the host: any IPv6 route via host will do.
    assert!(parse_vm_config(cfg(r#","public_ipv6":"2001:db8::7""#, narrower).as_bytes()).is_ok());
    let default = r#"{"destination":"::/0","via":"host"}"#;
    assert!(
        parse_vm_config(cfg(r#","public_ipv6":"2001:db8:7::/56""#, default).as_bytes()).is_ok()
    );
}

#[test]
fn rule_public_ipv4_is_global_unicast() {
    let cases = [
        ("10.1.2.3", "10.1.2.3 lies in the private range 10.0.0.0/8"),
        (
            "172.16.0.2",
            "172.16.0.2 lies in the private range 172.16.0.0/12",
        ),
        (
            "192.168.1.1",
            "192.168.1.1 lies in the private range 192.168.0.0/16",
        ),
        (
            "100.64.0.1",
            "100.64.0.1 lies in the shared range 100.64.0.0/10",
        ),
        (
            "127.0.0.1",
            "127.0.0.1 lies in the loopback range 127.0.0.0/8",
        ),
        (
            "169.254.169.254",
            "169.254.169.254 lies in the link-local range 169.254.0.0/16",
        ),
        (
            "224.0.0.1",
            "224.0.0.1 lies in the multicast range 224.0.0.0/4",
        ),
        ("0.0.0.0", "0.0.0.0 lies in the unspecified range 0.0.0.0/8"),
        (
            "240.0.0.1",
            "240.0.0.1 lies in the reserved range 240.0.0.0/4",
        ),
        (
            "192.0.0.8",
            "192.0.0.8 lies in the IETF protocol assignments range 192.0.0.0/24",
        ),
        (
            "192.88.99.1",
            "192.88.99.1 lies in the 6to4 relay anycast range 192.88.99.0/24",
        ),
        (
            "198.19.255.1",
            "198.19.255.1 lies in the benchmarking range 198.18.0.0/15",
        ),
    ];
    for (a, m) in cases {
        assert_eq!(
            err(&cfg(&format!(r#","public_ipv4":"{a}""#), BOTH)),
            format!("vm vm-7: public_ipv4 {m}; a public address must be global unicast")
        );
    }
    assert_eq!(
        err(&cfg(r#","public_ipv4":"255.255.255.255""#, BOTH)),
        "vm vm-7: public_ipv4 255.255.255.255 is the broadcast address, not a global unicast address"
    );
}

#[test]
fn rule_public_ipv4_is_one_address() {
    assert_eq!(
        err(&cfg(r#","public_ipv4":"203.0.113.0/28""#, BOTH)),
        "vm vm-7: public_ipv4 203.0.113.0/28 must be a single IPv4 address (a /32)"
    );
    assert_eq!(
        err(&cfg(r#","public_ipv4":"2001:db8::1""#, BOTH)),
        "vm vm-7: public_ipv4 \"2001:db8::1\" is not an IPv4 address"
    );
    assert_eq!(
        err(&cfg(r#","public_ipv4":7"#, BOTH)),
        "vm vm-7: public_ipv4 must be a string, got 7"
    );
}

#[test]
fn rule_public_ipv6_is_global_unicast() {
    let cases = [
        ("fdaa:1::9", "fdaa:1::9 lies in the mesh range fdaa::/16"),
        ("fdaa::/16", "fdaa::/16 overlaps the mesh range fdaa::/16"),
        (
            "fd00::/8",
            "fd00::/8 overlaps the unique local range fc00::/7",
        ),
        ("::1", "::1 lies in the loopback address ::1/128"),
        ("::", ":: lies in the unspecified address ::/128"),
        ("fe80::5", "fe80::5 lies in the link-local range fe80::/10"),
        ("ff02::1", "ff02::1 lies in the multicast range ff00::/8"),
        (
            "::ffff:203.0.113.1",
            "::ffff:203.0.113.1 lies in the IPv4-mapped range ::ffff:0:0/96",
        ),
        ("100::1", "100::1 lies in the discard-only range 100::/64"),
        (
            "2001::1",
            "2001::1 lies in the IETF protocol assignments range 2001::/23",
        ),
        (
            "2001:100::/24",
            "2001:100::/24 overlaps the IETF protocol assignments range 2001::/23",
        ),
    ];
    for (a, m) in cases {
        assert_eq!(
            err(&cfg(&format!(r#","public_ipv6":"{a}""#), BOTH)),
            format!("vm vm-7: public_ipv6 {m}; a public address must be global unicast")
        );
    }
}

#[test]
fn rule_public_ipv6_block_is_canonical() {
    assert_eq!(
        err(&cfg(r#","public_ipv6":"2001:db8:7::1/56""#, BOTH)),
        "vm vm-7: public_ipv6 2001:db8:7::1/56 is not canonical (host bits set; did you mean 2001:db8:7::/56?)"
    );
    assert_eq!(
        err(&cfg(r#","public_ipv6":"203.0.113.7/32""#, BOTH)),
        "vm vm-7: public_ipv6 \"203.0.113.7/32\" is not an IPv6 address or prefix"
    );
}

#[test]
fn rule_public_ipv6_block_is_at_most_a_48() {
    assert_eq!(
        err(&cfg(r#","public_ipv6":"2001:db8::/47""#, BOTH)),
        "vm vm-7: public_ipv6 2001:db8::/47 is larger than a /48; a VM's routed block is at most a /48"
    );
    assert_eq!(
        err(&cfg(r#","public_ipv6":"3000::/4""#, BOTH)),
        "vm vm-7: public_ipv6 3000::/4 is larger than a /48; a VM's routed block is at most a /48"
    );
    assert!(
        ok(r#","public_ipv6":"2001:db8:7::/48""#)
            .public_ipv6_block()
            .is_some()
    );
}

#[test]
fn documentation_ranges_are_allowed() {
    for a in ["192.0.2.9", "198.51.100.9", "203.0.113.9"] {
        assert_eq!(
            ok(&format!(r#","public_ipv4":"{a}""#)).public_ipv4,
            Some(a.parse().unwrap())
        );
    }
    assert!(
        ok(r#","public_ipv6":"2001:db8::/48""#)
            .public_ipv6_block()
            .is_some()
    );
}

#[test]
fn validate_checks_a_struct_built_by_hand() {
    let mut c = ok("");
    c.public_ipv4 = Some("10.0.0.1".parse().unwrap());
    assert_eq!(
        c.validate().unwrap_err().message(),
        "vm vm-7: public_ipv4 10.0.0.1 lies in the private range 10.0.0.0/8; a public address must be global unicast"
    );
    c.public_ipv4 = None;
    c.public_ipv6 = Some("2001:db8::1/64".parse().unwrap());
    assert!(
        c.validate()
            .unwrap_err()
            .message()
            .contains("not canonical")
    );
}

#[test]
fn a_huge_ipv6_prefix_is_named_by_its_size() {
    let e = err(&cfg(
        r#","public_ipv6":"::/0""#,
        r#"{"destination":"::/0","via":"host"}"#,
    ));
    assert!(e.contains("::/0 is larger than a /48"), "{e}");
}
