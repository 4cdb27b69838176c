//! One fixture per rule of [`super::firewall`], each asserting the exact error.

use serde_json::{Value, json};

use super::firewall::{Firewall, FirewallRule, PortRange, Protocol};
use super::*;

#[allow(clippy::needless_pass_by_value)]
fn base(firewall: Value) -> Value {
    json!({"id": "vm-7", "user_id": 7, "tenant": 1, "mesh_ipv6": "fdaa:1::7",
        "network": {"routes": [{"destination": "0.0.0.0/0", "via": "host"}]},
        "firewall": firewall})
}

fn err(firewall: Value) -> String {
    from_value(&base(firewall))
        .expect_err("must be refused")
        .message()
}

#[allow(clippy::needless_pass_by_value)]
fn inbound(rule: Value) -> String {
    err(json!({"enabled": true, "inbound": [rule]}))
}

#[test]
fn the_design_example_parses_and_serializes_back() {
    let fw = json!({"enabled": true,
        "inbound": [{"protocol": "tcp", "ports": "22", "prefixes": ["198.51.100.0/24", "2001:db8::/32"]},
                    {"protocol": "udp", "ports": "8000-8100", "prefixes": ["0.0.0.0/0"]},
                    {"protocol": "icmp", "prefixes": ["0.0.0.0/0", "::/0"]}],
        "outbound": [{"protocol": "any", "prefixes": ["0.0.0.0/0", "::/0"]}]});
    let c = from_value(&base(fw.clone())).unwrap();
    let f = c.firewall.as_ref().unwrap();
    assert!(f.enabled);
    assert_eq!(f.prefix_count(), 7);
    assert_eq!(
        f.inbound[1],
        FirewallRule {
            protocol: Protocol::Udp,
            ports: Some(PortRange {
                first: 8000,
                last: 8100
            }),
            prefixes: vec!["0.0.0.0/0".parse().unwrap()],
        }
    );
    let v = serde_json::to_value(&c).unwrap();
    assert_eq!(v["firewall"], fw);
    let back: VmConfig = serde_json::from_value(v).unwrap();
    assert_eq!(back, c);
}

#[test]
fn a_disabled_firewall_keeps_its_rules_and_absent_is_none() {
    let c = from_value(&base(json!({"enabled": false,
        "inbound": [{"protocol": "tcp", "ports": "22", "prefixes": ["10.0.0.0/8"]}]})))
    .unwrap();
    let f = c.firewall.clone().unwrap();
    assert!(!f.enabled);
    assert_eq!(f.inbound.len(), 1);
    assert!(f.outbound.is_empty());
    let v = serde_json::to_value(&c).unwrap();
    assert_eq!(v["firewall"]["inbound"][0]["ports"], "22");
    assert_eq!(v["firewall"]["outbound"], json!([]));
    let mut none = base(Value::Null);
    none.as_object_mut().unwrap().remove("firewall");
    let c = from_value(&none).unwrap();
    assert_eq!(c.firewall, None);
    assert!(serde_json::to_value(&c).unwrap().get("firewall").is_none());
    // `null` is absent too; an enabled firewall with no rules blocks everything new.
    assert_eq!(from_value(&base(Value::Null)).unwrap().firewall, None);
    let c = from_value(&base(json!({"enabled": true}))).unwrap();
    assert_eq!(
        c.firewall,
        Some(Firewall {
            enabled: true,
            ..Firewall::default()
        })
    );
}

#[test]
fn a_bare_address_is_its_full_length_prefix() {
    let c = from_value(&base(json!({"enabled": true, "outbound": [
        {"protocol": "tcp", "prefixes": ["198.51.100.7", "2001:db8::7"]}]})))
    .unwrap();
    let v = serde_json::to_value(&c).unwrap();
    assert_eq!(
        v["firewall"]["outbound"][0]["prefixes"],
        json!(["198.51.100.7/32", "2001:db8::7/128"])
    );
}

#[test]
fn rule_firewall_shape() {
    assert_eq!(
        err(json!([])),
        "vm vm-7: firewall must be an object, got []"
    );
    assert_eq!(
        err(json!({"enabled": true, "rules": []})),
        "vm vm-7: firewall.rules is an unknown field"
    );
    assert_eq!(
        err(json!({"inbound": []})),
        "vm vm-7: firewall.enabled is required (true or false)"
    );
    assert_eq!(
        err(json!({"enabled": "yes"})),
        "vm vm-7: firewall.enabled must be true or false, got \"yes\""
    );
    assert_eq!(
        err(json!({"enabled": true, "outbound": {}})),
        "vm vm-7: firewall.outbound must be an array of rules, got {}"
    );
    assert_eq!(
        err(json!({"enabled": true, "inbound": ["tcp"]})),
        "vm vm-7: firewall.inbound[0] must be an object with protocol, ports and prefixes"
    );
    assert_eq!(
        inbound(json!({"protocol": "tcp", "prefixes": ["10.0.0.0/8"], "action": "drop"})),
        "vm vm-7: firewall.inbound[0].action is an unknown field"
    );
}

#[test]
fn rule_protocol() {
    assert_eq!(
        inbound(json!({"prefixes": ["10.0.0.0/8"]})),
        "vm vm-7: firewall.inbound[0].protocol is required (any, tcp, udp or icmp)"
    );
    for p in ["sctp", "TCP", "icmpv6", "ip", ""] {
        assert_eq!(
            inbound(json!({"protocol": p, "prefixes": ["10.0.0.0/8"]})),
            format!(
                "vm vm-7: firewall.inbound[0].protocol {p:?} is not a protocol; use any, tcp, udp or icmp"
            )
        );
    }
    assert_eq!(
        inbound(json!({"protocol": 6, "prefixes": ["10.0.0.0/8"]})),
        "vm vm-7: firewall.inbound[0].protocol must be a string, got 6"
    );
}

#[test]
fn rule_ports_format() {
    for p in [
        "65536", "22,23", "22 ", " 22", "022", "-5", "5-", "1-2-3", "+22", "", "ssh", "22-65536",
    ] {
        assert_eq!(
            inbound(json!({"protocol": "tcp", "ports": p, "prefixes": ["10.0.0.0/8"]})),
            format!(
                "vm vm-7: firewall.inbound[0].ports {p:?} is not one port or one range of ports 1-65535, like \"22\" or \"8000-8100\""
            ),
            "{p}"
        );
    }
    assert_eq!(
        inbound(json!({"protocol": "tcp", "ports": 22, "prefixes": ["10.0.0.0/8"]})),
        "vm vm-7: firewall.inbound[0].ports must be a string like \"22\" or \"8000-8100\", got 22"
    );
}

#[test]
fn rule_ports_zero() {
    for p in ["0", "0-10"] {
        assert_eq!(
            inbound(json!({"protocol": "udp", "ports": p, "prefixes": ["10.0.0.0/8"]})),
            format!(
                "vm vm-7: firewall.inbound[0].ports \"{p}\": port 0 is not a port; ports are 1-65535"
            )
        );
    }
}

#[test]
fn rule_ports_in_order() {
    assert_eq!(
        inbound(json!({"protocol": "tcp", "ports": "10-5", "prefixes": ["10.0.0.0/8"]})),
        "vm vm-7: firewall.inbound[0].ports \"10-5\": the first port is above the last (did you mean \"5-10\"?)"
    );
    // The edges are fine, and a one-port range is one port.
    let c = from_value(&base(json!({"enabled": true, "inbound": [
        {"protocol": "tcp", "ports": "1-65535", "prefixes": ["10.0.0.0/8"]},
        {"protocol": "udp", "ports": "7-7", "prefixes": ["10.0.0.0/8"]}]})))
    .unwrap();
    let v = serde_json::to_value(&c).unwrap();
    assert_eq!(v["firewall"]["inbound"][0]["ports"], "1-65535");
    assert_eq!(v["firewall"]["inbound"][1]["ports"], "7");
}

#[test]
fn rule_ports_only_on_tcp_and_udp() {
    for p in ["icmp", "any"] {
        assert_eq!(
            err(json!({"enabled": true, "outbound": [
                {"protocol": "tcp", "prefixes": ["::/0"]},
                {"protocol": p, "ports": "22", "prefixes": ["::/0"]}]})),
            format!(
                "vm vm-7: firewall.outbound[1].ports \"22\" is only allowed with protocol tcp or udp (this rule is {p})"
            )
        );
    }
}

#[test]
fn rule_prefixes_required_and_non_empty() {
    assert_eq!(
        inbound(json!({"protocol": "tcp"})),
        "vm vm-7: firewall.inbound[0].prefixes is required (one or more prefixes; 0.0.0.0/0 and ::/0 for everyone)"
    );
    assert_eq!(
        inbound(json!({"protocol": "tcp", "prefixes": []})),
        "vm vm-7: firewall.inbound[0].prefixes must hold at least one prefix (0.0.0.0/0 and ::/0 for everyone)"
    );
    assert_eq!(
        inbound(json!({"protocol": "tcp", "prefixes": "10.0.0.0/8"})),
        "vm vm-7: firewall.inbound[0].prefixes must be an array of prefixes, got \"10.0.0.0/8\""
    );
    assert_eq!(
        inbound(json!({"protocol": "tcp", "prefixes": [8]})),
        "vm vm-7: firewall.inbound[0].prefixes[0] must be a string, got 8"
    );
}

#[test]
fn rule_prefixes_written_strictly() {
    for p in [
        "10.0.0.0/33",
        "10.0.0/8",
        "010.0.0.0/8",
        "10.0.0.0/08",
        " ::/0",
        "::/129",
        "any",
    ] {
        assert_eq!(
            inbound(json!({"protocol": "any", "prefixes": ["::/0", p]})),
            format!(
                "vm vm-7: firewall.inbound[0].prefixes[1] {p:?} is not a prefix like 198.51.100.0/24 or 2001:db8::/32"
            )
        );
    }
}

#[test]
fn rule_prefixes_canonical() {
    assert_eq!(
        inbound(json!({"protocol": "tcp", "prefixes": ["198.51.100.7/24"]})),
        "vm vm-7: firewall.inbound[0].prefixes[0] 198.51.100.7/24 is not canonical (host bits set; did you mean 198.51.100.0/24?)"
    );
    assert_eq!(
        inbound(json!({"protocol": "tcp", "prefixes": ["2001:db8::1/32"]})),
        "vm vm-7: firewall.inbound[0].prefixes[0] 2001:db8::1/32 is not canonical (host bits set; did you mean 2001:db8::/32?)"
    );
}

#[test]
fn rule_prefixes_not_ipv4_mapped() {
    for p in [
        "::ffff:198.51.100.0/120",
        "::ffff:0:0/96",
        "::ffff:198.51.100.7",
    ] {
        let e = inbound(json!({"protocol": "tcp", "prefixes": [p]}));
        assert!(
            e.starts_with("vm vm-7: firewall.inbound[0].prefixes[0] ::ffff:")
                && e.ends_with(
                    " lies in the IPv4-mapped range ::ffff:0:0/96; give the IPv4 prefix"
                ),
            "{e}"
        );
    }
    // A wider prefix holding the mapped range is fine.
    assert!(
        from_value(&base(json!({"enabled": true, "inbound": [
        {"protocol": "tcp", "prefixes": ["::/0", "::/64"]}]})))
        .is_ok()
    );
}

#[test]
fn rule_prefixes_once_per_rule() {
    assert_eq!(
        inbound(json!({"protocol": "tcp", "prefixes": ["10.0.0.0/8", "10.0.0.0/8"]})),
        "vm vm-7: firewall.inbound[0].prefixes[1] 10.0.0.0/8 appears more than once in the rule"
    );
}

fn with_prefixes(n_in: usize, n_out: usize) -> Value {
    let p = |n: usize, off: usize| -> Vec<String> {
        (0..n).map(|i| format!("10.{}.0.0/16", i + off)).collect()
    };
    json!({"enabled": true,
        "inbound": [{"protocol": "tcp", "ports": "22", "prefixes": p(n_in, 0)}],
        "outbound": [{"protocol": "any", "prefixes": p(n_out, 100)}]})
}

#[test]
fn rule_at_most_50_prefixes_across_both_directions() {
    let ok = from_value(&base(with_prefixes(30, 20))).unwrap();
    assert_eq!(ok.firewall.unwrap().prefix_count(), 50);
    assert_eq!(
        err(with_prefixes(30, 21)),
        "vm vm-7: firewall has 51 prefix entries across inbound and outbound; at most 50 are allowed"
    );
}

#[test]
fn validate_checks_a_firewall_built_in_code() {
    let mut c = from_value(&base(json!({"enabled": true}))).unwrap();
    c.firewall = Some(Firewall {
        enabled: true,
        inbound: vec![FirewallRule {
            protocol: Protocol::Icmp,
            ports: Some(PortRange { first: 1, last: 2 }),
            prefixes: vec!["::/0".parse().unwrap()],
        }],
        outbound: Vec::new(),
    });
    assert_eq!(
        c.validate().unwrap_err().message(),
        "vm vm-7: firewall.inbound[0].ports \"1-2\" is only allowed with protocol tcp or udp (this rule is icmp)"
    );
}
