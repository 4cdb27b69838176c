//! In-process API tests of the VM firewall config over a temporary SQLite file and a fake
//! namespace driver (no root needed): stored and returned, disabled too; refused with
//! `INVALID_INPUT` naming the rule and field. Every response is checked against openapi.json.

mod common;

use axum::http::Method;
use common::{Harness, assert_error, vm};
use serde_json::{Value, json};

fn with_firewall(id: &str, uid: u32, fw: Value) -> Value {
    let mut v = vm(id, uid);
    v["firewall"] = fw;
    v
}

#[tokio::test]
async fn a_firewall_is_stored_and_returned_enabled_or_disabled() {
    let h = Harness::new().await;
    let fw = json!({"enabled": true,
        "inbound": [{"protocol": "tcp", "ports": "22", "prefixes": ["198.51.100.0/24", "2001:db8::/32"]}],
        "outbound": [{"protocol": "any", "prefixes": ["0.0.0.0/0", "::/0"]}]});
    let (st, v) = h.put_vm(&with_firewall("fw", 5, fw.clone())).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["config"]["firewall"], fw);
    let plan = h.driver.applied(5).expect("applied");
    assert!(plan.firewall.is_some(), "the plan filters");
    // Disabled: the rules stay stored and GET returns them; the plan filters nothing.
    let mut off = fw.clone();
    off["enabled"] = json!(false);
    let (st, v) = h.put_vm(&with_firewall("fw", 5, off.clone())).await;
    assert_eq!(st, 200, "{v}");
    let (st, got) = h.call(Method::GET, "/v1/vms/fw", None).await;
    assert_eq!(st, 200);
    assert_eq!(got["config"]["firewall"], off);
    assert_eq!(got["status"]["state"], "applied");
    assert!(h.driver.applied(5).expect("applied").firewall.is_none());
    let (_, list) = h.call(Method::GET, "/v1/vms", None).await;
    assert_eq!(list[0]["config"]["firewall"], off);
}

#[tokio::test]
async fn firewall_rules_are_refused_naming_the_rule_and_field() {
    let h = Harness::new().await;
    let prefixes = |n: usize| -> Vec<String> { (0..n).map(|i| format!("10.{i}.0.0/16")).collect() };
    let cases: Vec<(Value, Vec<&str>)> = vec![
        (
            json!({"enabled": true, "inbound": [{"protocol": "tcp", "ports": "0", "prefixes": ["::/0"]}]}),
            vec!["firewall.inbound[0].ports", "port 0"],
        ),
        (
            json!({"enabled": true, "inbound": [{"protocol": "tcp", "ports": "65536", "prefixes": ["::/0"]}]}),
            vec!["firewall.inbound[0].ports", "65536"],
        ),
        (
            json!({"enabled": true, "inbound": [{"protocol": "tcp", "ports": "22,23", "prefixes": ["::/0"]}]}),
            vec!["firewall.inbound[0].ports", "22,23"],
        ),
        (
            json!({"enabled": true, "outbound": [{"protocol": "gre", "prefixes": ["::/0"]}]}),
            vec!["firewall.outbound[0].protocol", "gre"],
        ),
        (
            json!({"enabled": true, "outbound": [{"protocol": "icmp", "ports": "1", "prefixes": ["::/0"]}]}),
            vec![
                "firewall.outbound[0].ports",
                "only allowed with protocol tcp or udp",
            ],
        ),
        (
            json!({"enabled": true, "outbound": [{"protocol": "any", "prefixes": ["10.1.0.0/8"]}]}),
            vec!["firewall.outbound[0].prefixes[0]", "not canonical"],
        ),
        (
            json!({"enabled": true, "outbound": [{"protocol": "any", "prefixes": ["::ffff:10.0.0.0/104"]}]}),
            vec!["firewall.outbound[0].prefixes[0]", "IPv4-mapped"],
        ),
        (
            json!({"enabled": false, "inbound": [{"protocol": "tcp", "prefixes": prefixes(51)}]}),
            vec!["firewall has 51 prefix entries", "at most 50"],
        ),
    ];
    for (fw, needles) in cases {
        let got = h.put_vm(&with_firewall("bad", 6, fw)).await;
        assert_error(&got, 400, "INVALID_INPUT", &needles);
    }
    assert!(h.driver.applied(6).is_none(), "nothing refused is applied");
    let (st, v) = h
        .put_vm(&with_firewall(
            "ok",
            6,
            json!({"enabled": true, "inbound": [{"protocol": "tcp", "prefixes": prefixes(50)}]}),
        ))
        .await;
    assert_eq!(st, 200, "50 prefixes are fine: {v}");
}
