//! Bad input: lease, gateway and nameserver strings carrying YAML, JSON or nft syntax cannot
//! reach a seed or a ruleset. They fail where the strings are parsed — the pool range
//! (`SetIpPool::validate`) and the NodeSpec — with `INVALID_INPUT`; everything after that holds
//! only parsed addresses, and what is printed from them is plain address text.

use proptest::prelude::*;
use vmnet_model::ValidationError;
use vmnet_model::nic::NodeSpec;
use vmnet_model::pool::SetIpPool;
use vmnet_plan::pool::nft::{HostAddrs, plan, render_full};
use vmnet_plan::pool::seed::seed;

const EVIL: [&str; 10] = [
    "10.0.0.1\n  - 6.6.6.6",
    "10.0.0.1 # comment",
    "10.0.0.1\"}, {\"x\": \"y",
    "10.0.0.1; flush ruleset",
    "{ 10.0.0.1, 0.0.0.0/0 }",
    "10.0.0.1/29\nnameservers: {addresses: [6.6.6.6]}",
    "!!python/object/apply:os.system ['id']",
    "10.0.0.1 accept",
    "@host_all4",
    "0x0a000001",
];

fn pool(cidr: &str, gateway: &str, dns: &str) -> SetIpPool {
    SetIpPool {
        pool_id: "pool-1".into(),
        cidr: cidr.into(),
        gateway: gateway.into(),
        first_host: None,
        last_host: None,
        dns: vec![dns.into()],
    }
}

#[test]
fn evil_range_strings_are_refused() {
    for e in EVIL {
        for req in [
            pool(e, "10.0.0.1", "10.0.0.1"),
            pool("10.0.0.0/29", e, "10.0.0.1"),
            pool("10.0.0.0/29", "10.0.0.1", e),
        ] {
            let err = req.validate().expect_err(e);
            assert!(matches!(err, ValidationError::Rule(_)), "{e}: {err}");
            assert!(err.message().contains("pool-1"), "{err}");
        }
    }
}

fn node_json(address: &str, gateway: &str, ns: &str) -> String {
    let s = |v: &str| serde_json::to_string(v).unwrap();
    format!(
        r#"{{"instances":[{{"id":"i-1","allocation_id":"a-1","nics":[{{"network":"br0","mac":"02:00:00:00:00:01","addresses":[{}],"gateway":{},"nameservers":[{}]}}]}}]}}"#,
        s(address),
        s(gateway),
        s(ns)
    )
}

#[test]
fn evil_nic_strings_are_refused() {
    assert!(NodeSpec::from_json(&node_json("10.0.0.2/29", "10.0.0.1", "10.0.0.1")).is_ok());
    for e in EVIL {
        for j in [
            node_json(e, "10.0.0.1", "10.0.0.1"),
            node_json("10.0.0.2/29", e, "10.0.0.1"),
            node_json("10.0.0.2/29", "10.0.0.1", e),
        ] {
            let err = NodeSpec::from_json(&j).expect_err(e);
            assert!(matches!(err, ValidationError::Json { .. }), "{e}: {err}");
        }
    }
}

proptest! {
    /// Whatever string is offered, either it is refused or what reaches the seed and the ruleset
    /// is plain address text (digits, hex, dots, colons, slashes).
    #[test]
    fn only_address_text_reaches_seed_and_ruleset(
        addr in prop_oneof![
            "\\PC{0,24}",
            (any::<u8>(), any::<u8>(), 8u8..=30).prop_map(|(a, b, p)| format!("10.{a}.{b}.9/{p}")),
        ],
        gw in prop_oneof![
            "[0-9a-f.:/ ;#\"{}]{0,20}",
            any::<u8>().prop_map(|a| format!("10.{a}.0.1")),
        ],
    ) {
        if let Ok(node) = NodeSpec::from_json(&node_json(&addr, &gw, "10.0.0.1")) {
            let nic = &node.instances[0].nics[0];
            let texts: Vec<String> = nic.addresses.iter().map(ToString::to_string)
                .chain(nic.gateway.iter().map(ToString::to_string)).collect();
            for t in &texts {
                prop_assert!(t.chars().all(|c| c.is_ascii_hexdigit() || ".:/".contains(c)), "{t}");
            }
            let s = seed(&node.instances[0], None).unwrap();
            if let Some(nc) = &s.network_config {
                let v: serde_json::Value = serde_json::from_str(nc).unwrap();
                prop_assert_eq!(v["ethernets"]["eth0"]["addresses"][0].as_str().unwrap(), texts[0].as_str());
            }
            let fw = plan(&node, &HostAddrs::default()).unwrap();
            prop_assert!(vmnet_plan::pool::validate::validate(&render_full(&fw).to_string()).is_ok());
        }
    }
}
