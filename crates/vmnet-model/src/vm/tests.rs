//! One fixture per validation rule of [`super`], each asserting the exact error.

use super::*;

fn err(json: &str) -> String {
    let e = parse_vm_config(json.as_bytes()).expect_err("must be refused");
    e.message()
}

const GOOD: &str = r#"{"id": "vm-7", "user_id": 7, "tenant": 3, "mesh_ipv6": "fdaa:1::7",
  "network": {"routes": [{"destination": "0.0.0.0/0", "via": "host"},
                         {"destination": "2000::/3", "via": "fdaa:1::56"}]}}"#;

#[test]
fn spec_example_parses() {
    let c = parse_vm_config(GOOD.as_bytes()).unwrap();
    assert_eq!(c.id, "vm-7");
    assert_eq!(c.user_id, 7);
    assert_eq!(c.tenant, 3);
    assert_eq!(c.mesh_ipv6, Some("fdaa:1::7".parse().unwrap()));
    assert_eq!(c.network.routes.len(), 2);
    assert_eq!(c.network.routes[0].via, Via::Host);
    assert_eq!(
        c.network.routes[1].via,
        Via::Mesh("fdaa:1::56".parse().unwrap())
    );
    assert!(c.ipv4_via_host());
}

#[test]
fn serde_round_trip_is_the_spec_shape() {
    let c = parse_vm_config(GOOD.as_bytes()).unwrap();
    let v = serde_json::to_value(&c).unwrap();
    assert_eq!(
        v["network"]["routes"][0],
        serde_json::json!({"destination": "0.0.0.0/0", "via": "host"})
    );
    assert_eq!(v["network"]["routes"][1]["via"], "fdaa:1::56");
    assert_eq!(v["mesh_ipv6"], "fdaa:1::7");
    let back: VmConfig = serde_json::from_value(v).unwrap();
    assert_eq!(back, c);
}

#[test]
fn mesh_ipv6_accepts_slash_128() {
    let c =
        parse_vm_config(br#"{"id":"a","user_id":1,"tenant":0,"mesh_ipv6":"fdaa::1/128"}"#).unwrap();
    assert_eq!(c.mesh_ipv6, Some("fdaa::1".parse().unwrap()));
    assert!(c.network.routes.is_empty());
}

#[test]
fn mesh_ipv6_is_never_the_ranges_subnet_router_anycast_address() {
    for m in ["fdaa::", "fdaa::/128"] {
        let body = format!(r#"{{"id":"a","user_id":1,"tenant":1,"mesh_ipv6":"{m}"}}"#);
        let e = parse_vm_config(body.as_bytes()).unwrap_err().to_string();
        assert!(
            e.contains("mesh_ipv6") && e.contains("subnet-router anycast"),
            "{e}"
        );
    }
}

#[test]
fn no_mesh_and_no_routes_is_a_capture_vm() {
    let c =
        parse_vm_config(br#"{"id":"cap","user_id":9,"tenant":0,"network":{"routes":[]}}"#).unwrap();
    assert_eq!(c.mesh_ipv6, None);
}

#[test]
fn rule_malformed_json() {
    assert!(err("{").starts_with("vm: malformed JSON: "));
}

#[test]
fn rule_id_required() {
    assert_eq!(err(r#"{"user_id":1,"tenant":0}"#), "vm: id is required");
}

#[test]
fn rule_id_not_empty() {
    assert_eq!(
        err(r#"{"id":"","user_id":1,"tenant":0}"#),
        "vm: id must not be empty"
    );
}

#[test]
fn rule_id_at_most_64_bytes() {
    let id = "a".repeat(65);
    assert_eq!(
        err(&format!(r#"{{"id":"{id}","user_id":1,"tenant":0}}"#)),
        "vm aaaaaaaaaaaaaaaa…: id is 65 bytes, at most 64 are allowed"
    );
    let ok = "a".repeat(64);
    assert!(
        parse_vm_config(format!(r#"{{"id":"{ok}","user_id":1,"tenant":0}}"#).as_bytes()).is_ok()
    );
}

#[test]
fn rule_id_charset() {
    assert_eq!(
        err(r#"{"id":"vm 7","user_id":1,"tenant":0}"#),
        r#"vm "vm 7": id contains ' '; only A-Z a-z 0-9 . _ - are allowed"#
    );
}

#[test]
fn rule_id_starts_with_a_letter_or_digit() {
    for id in [".", "..", ".hidden", "-x", "_x"] {
        assert_eq!(
            err(&format!(r#"{{"id":"{id}","user_id":1,"tenant":0}}"#)),
            format!("vm {id:?}: id must start with a letter or digit"),
            "{id}"
        );
    }
    for id in ["a.", "0..1", "x_-."] {
        assert!(validate_vm_id(id).is_ok(), "{id}");
    }
}

#[test]
fn rule_user_id_range() {
    assert_eq!(
        err(r#"{"id":"vm-7","user_id":65536,"tenant":0}"#),
        "vm vm-7: user_id 65536 is outside the supported range 0..=65535"
    );
    assert_eq!(
        err(r#"{"id":"vm-7","user_id":-1,"tenant":0}"#),
        "vm vm-7: user_id must be a non-negative integer, got -1"
    );
    assert_eq!(
        err(r#"{"id":"vm-7","tenant":0}"#),
        "vm vm-7: user_id is required"
    );
}

#[test]
fn rule_tenant_required_u32() {
    assert_eq!(
        err(r#"{"id":"vm-7","user_id":1}"#),
        "vm vm-7: tenant is required"
    );
    assert_eq!(
        err(r#"{"id":"vm-7","user_id":1,"tenant":"x"}"#),
        r#"vm vm-7: tenant must be an integer in 0..=4294967295, got "x""#
    );
}

#[test]
fn rule_mesh_ipv6_in_fdaa() {
    assert_eq!(
        err(r#"{"id":"vm-7","user_id":1,"tenant":0,"mesh_ipv6":"fd00::1"}"#),
        "vm vm-7: mesh_ipv6 fd00::1 is not in fdaa::/16"
    );
    assert_eq!(
        err(r#"{"id":"vm-7","user_id":1,"tenant":0,"mesh_ipv6":"fdaa::/64"}"#),
        "vm vm-7: mesh_ipv6 fdaa::/64 must be a single address (a /128)"
    );
    assert_eq!(
        err(r#"{"id":"vm-7","user_id":1,"tenant":0,"mesh_ipv6":"nope"}"#),
        r#"vm vm-7: mesh_ipv6 "nope" is not an IPv6 address"#
    );
}

#[test]
fn rule_unknown_fields_refused() {
    assert_eq!(
        err(r#"{"id":"vm-7","user_id":1,"tenant":0,"colour":1}"#),
        "vm vm-7: colour is an unknown field"
    );
    assert_eq!(
        err(r#"{"id":"vm-7","user_id":1,"tenant":0,"network":{"rutes":[]}}"#),
        "vm vm-7: network.rutes is an unknown field"
    );
    assert_eq!(
        err(
            r#"{"id":"vm-7","user_id":1,"tenant":0,"mesh_ipv6":"fdaa::1","network":{"routes":[{"destination":"::/0","via":"host","metric":1}]}}"#
        ),
        "vm vm-7: network.routes[0].metric is an unknown field"
    );
}

#[test]
fn rule_future_fields_not_supported_yet() {
    for f in FUTURE_FIELDS {
        assert_eq!(
            err(&format!(
                r#"{{"id":"vm-7","user_id":1,"tenant":0,"{f}":null}}"#
            )),
            format!("vm vm-7: {f} is not supported yet")
        );
        assert_eq!(
            err(&format!(
                r#"{{"id":"vm-7","user_id":1,"tenant":0,"network":{{"{f}":1}}}}"#
            )),
            format!("vm vm-7: network.{f} is not supported yet")
        );
    }
}

fn with_routes(routes: &str) -> String {
    format!(
        r#"{{"id":"vm-7","user_id":7,"tenant":0,"mesh_ipv6":"fdaa:1::7","network":{{"routes":{routes}}}}}"#
    )
}

#[test]
fn rule_destination_canonical() {
    assert_eq!(
        err(&with_routes(
            r#"[{"destination":"0.0.0.0/0","via":"host"},{"destination":"10.0.0.1/8","via":"host"}]"#
        )),
        "vm vm-7: network.routes[1].destination 10.0.0.1/8 is not canonical (host bits set; did you mean 10.0.0.0/8?)"
    );
    assert_eq!(
        err(&with_routes(
            r#"[{"destination":"2000::1/3","via":"host"}]"#
        )),
        "vm vm-7: network.routes[0].destination 2000::1/3 is not canonical (host bits set; did you mean 2000::/3?)"
    );
}

#[test]
fn rule_destination_is_a_prefix() {
    assert_eq!(
        err(&with_routes(r#"[{"destination":"10.0.0.0","via":"host"}]"#)),
        r#"vm vm-7: network.routes[0].destination "10.0.0.0" is not a prefix like 10.0.0.0/8 or 2000::/3"#
    );
    assert_eq!(
        err(&with_routes(r#"[{"via":"host"}]"#)),
        "vm vm-7: network.routes[0].destination is required"
    );
}

#[test]
fn rule_destination_once() {
    assert_eq!(
        err(&with_routes(
            r#"[{"destination":"::/0","via":"host"},{"destination":"::/0","via":"fdaa:1::56"}]"#
        )),
        "vm vm-7: network.routes[1].destination ::/0 appears more than once"
    );
}

#[test]
fn rule_via_host_or_mesh() {
    assert_eq!(
        err(&with_routes(
            r#"[{"destination":"::/0","via":"2001:db8::1"}]"#
        )),
        "vm vm-7: network.routes[0].via 2001:db8::1 is not a mesh address in fdaa::/16"
    );
    assert_eq!(
        err(&with_routes(r#"[{"destination":"::/0","via":"uplink"}]"#)),
        r#"vm vm-7: network.routes[0].via "uplink" is neither "host" nor a mesh address in fdaa::/16"#
    );
    assert_eq!(
        err(&with_routes(r#"[{"destination":"::/0","via":5}]"#)),
        "vm vm-7: network.routes[0].via must be a string, got 5"
    );
}

#[test]
fn rule_mesh_via_ipv6_only() {
    assert_eq!(
        err(&with_routes(
            r#"[{"destination":"0.0.0.0/0","via":"fdaa:1::56"}]"#
        )),
        "vm vm-7: network.routes[0].via fdaa:1::56 carries IPv6 only, but destination 0.0.0.0/0 is IPv4"
    );
}

#[test]
fn rule_mesh_via_not_self() {
    assert_eq!(
        err(&with_routes(
            r#"[{"destination":"2000::/3","via":"fdaa:1::7"}]"#
        )),
        "vm vm-7: network.routes[0].via fdaa:1::7 is the VM's own mesh address"
    );
}

#[test]
fn rule_routes_need_mesh() {
    assert_eq!(
        err(
            r#"{"id":"cap","user_id":1,"tenant":0,"network":{"routes":[{"destination":"0.0.0.0/0","via":"host"}]}}"#
        ),
        "vm cap: network.routes needs mesh_ipv6 (a VM without a mesh address has no veth pair)"
    );
}

#[test]
fn rule_not_an_object() {
    assert_eq!(err("[]"), "vm: the config must be a JSON object");
    assert_eq!(
        err(r#"{"id":"vm-7","user_id":1,"tenant":0,"network":[]}"#),
        "vm vm-7: network must be an object, got []"
    );
}

#[test]
fn serde_deserialize_runs_validation() {
    let r: Result<VmConfig, _> =
        serde_json::from_str(r#"{"id":"vm-7","user_id":1,"tenant":0,"wireguard":{}}"#);
    assert_eq!(
        r.unwrap_err().to_string(),
        "vm vm-7: wireguard is not supported yet"
    );
    let r: Result<VmConfig, _> =
        serde_json::from_str(r#"{"id":"vm-7","user_id":1,"tenant":0,"firewall":{}}"#);
    assert_eq!(
        r.unwrap_err().to_string(),
        "vm vm-7: firewall.enabled is required (true or false)"
    );
}

#[test]
fn rule_destination_parsed_strictly() {
    for d in [
        "010.0.0.0/8",
        " 10.0.0.0/8",
        "10.0.0.0/8 ",
        "10.0.0.0/08",
        "10.0.0.0/+8",
    ] {
        assert_eq!(
            err(&with_routes(&format!(
                r#"[{{"destination":{d:?},"via":"host"}}]"#
            ))),
            format!(
                "vm vm-7: network.routes[0].destination {d:?} is not a prefix like 10.0.0.0/8 or 2000::/3"
            )
        );
    }
    assert_eq!(
        err(r#"{"id":"vm-7","user_id":7,"tenant":0,"mesh_ipv6":" fdaa:1::7"}"#),
        r#"vm vm-7: mesh_ipv6 " fdaa:1::7" is not an IPv6 address"#
    );
    assert_eq!(
        err(r#"{"id":"vm-7","user_id":7,"tenant":0,"mesh_ipv6":"fdaa:1::7/0128"}"#),
        "vm vm-7: mesh_ipv6 fdaa:1::7/0128 must be a single address (a /128)"
    );
    assert_eq!(parse_net("10.0.0.0/8"), Some("10.0.0.0/8".parse().unwrap()));
    assert_eq!(parse_net("2000::/3"), Some("2000::/3".parse().unwrap()));
    assert_eq!(parse_net("10.0.0.0/33"), None);
    assert_eq!(parse_net("10.0.0.0"), None);
}

#[test]
fn rule_destination_not_inside_the_guest_link() {
    for d in ["172.16.0.0/30", "172.16.0.0/31", "172.16.0.2/32"] {
        assert_eq!(
            err(&with_routes(&format!(
                r#"[{{"destination":"{d}","via":"host"}}]"#
            ))),
            format!(
                "vm vm-7: network.routes[0].destination {d} lies inside the guest link 172.16.0.0/30, which is always connected"
            )
        );
    }
    // A wider prefix containing the guest link is fine: the connected /30 is longer.
    let c = parse_vm_config(
        with_routes(r#"[{"destination":"172.16.0.0/12","via":"host"}]"#).as_bytes(),
    )
    .unwrap();
    assert_eq!(c.network.routes.len(), 1);
}

#[test]
fn rule_mesh_range_never_via_host() {
    assert_eq!(
        err(&with_routes(
            r#"[{"destination":"fdaa:2::/32","via":"host"}]"#
        )),
        "vm vm-7: network.routes[0].destination fdaa:2::/32 lies inside the mesh range fdaa::/16; mesh traffic never goes via host"
    );
    assert_eq!(
        err(&with_routes(
            r#"[{"destination":"fdaa::/16","via":"host"}]"#
        )),
        "vm vm-7: network.routes[0].destination fdaa::/16 lies inside the mesh range fdaa::/16; mesh traffic never goes via host"
    );
    // Wider prefixes containing the mesh range stay allowed via host; a mesh via may carry it.
    assert!(
        parse_vm_config(with_routes(r#"[{"destination":"::/0","via":"host"}]"#).as_bytes()).is_ok()
    );
    assert!(
        parse_vm_config(
            with_routes(r#"[{"destination":"fdaa:2::/32","via":"fdaa:1::56"}]"#).as_bytes()
        )
        .is_ok()
    );
}

fn with_limit(field: &str, value: &str) -> String {
    format!(r#"{{"id":"vm-7","user_id":7,"tenant":3,"mesh_ipv6":"fdaa:1::7","{field}":{value}}}"#)
}

#[test]
fn limits_default_to_unlimited_and_round_trip() {
    let c = parse_vm_config(GOOD.as_bytes()).unwrap();
    assert_eq!(c.private_network_throughput_mibps, 0);
    assert_eq!(c.public_network_throughput_mibps, 0);
    let v = serde_json::to_value(&c).unwrap();
    assert!(v.get("private_network_throughput_mibps").is_none());
    let c = parse_vm_config(
        br#"{"id":"a","user_id":1,"tenant":0,"mesh_ipv6":"fdaa::1",
             "private_network_throughput_mibps":100000,"public_network_throughput_mibps":20}"#,
    )
    .unwrap();
    assert_eq!(c.private_network_throughput_mibps, 100_000);
    assert_eq!(c.public_network_throughput_mibps, 20);
    let v = serde_json::to_value(&c).unwrap();
    assert_eq!(v["public_network_throughput_mibps"], 20);
    let back: VmConfig = serde_json::from_value(v).unwrap();
    assert_eq!(back, c);
    let c = parse_vm_config(with_limit(limits::PUBLIC_FIELD, "null").as_bytes()).unwrap();
    assert_eq!(c.public_network_throughput_mibps, 0);
}

#[test]
fn bad_limits_are_refused_naming_the_field() {
    let tail = "it must be a whole number of MiB/s in 0..=100000 (0 = unlimited)";
    for field in [limits::PRIVATE_FIELD, limits::PUBLIC_FIELD] {
        for (value, what) in [
            ("-1", "-1 is negative"),
            ("1.5", "1.5 is not a whole number"),
            (
                "10.0",
                "10.0 is written with a decimal point or an exponent (write 10)",
            ),
            (
                "1e3",
                "1000.0 is written with a decimal point or an exponent (write 1000)",
            ),
            ("1e12", "1000000000000.0 is too large"),
            ("-2.0", "-2.0 is negative"),
            ("100001", "100001 is too large"),
            (
                "18446744073709551616",
                "1.8446744073709552e+19 is too large",
            ),
            ("-1e20", "-1e+20 is negative"),
            (r#""10""#, r#"must be a number, got "10""#),
            ("true", "must be a number, got true"),
            ("[]", "must be a number, got []"),
        ] {
            assert_eq!(
                err(&with_limit(field, value)),
                format!("vm vm-7: {field} {what}; {tail}"),
                "{field} = {value}"
            );
        }
    }
}

#[test]
fn validate_refuses_a_too_large_limit_built_in_code() {
    let mut c = parse_vm_config(GOOD.as_bytes()).unwrap();
    c.public_network_throughput_mibps = 100_001;
    let e = c.validate().unwrap_err();
    assert!(matches!(e, ValidationError::Rule(_)), "{e:?}");
    assert!(
        e.to_string()
            .starts_with("vm vm-7: public_network_throughput_mibps 100001 is too large"),
        "{e}"
    );
}

#[test]
fn a_repeated_key_is_refused_not_last_wins() {
    let e = err(r#"{"id": "vm-7", "user_id": 1, "tenant": 1, "tenant": 2}"#);
    assert!(e.contains("duplicate key \"tenant\""), "{e}");
}
