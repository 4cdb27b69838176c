//! In-process API tests of public addresses (no root): shown in the config and status, every
//! validation rule 400 naming the field, a held or overlapping address 409 naming the holder,
//! and nothing changed by a refused PUT. Every response is checked against openapi.json.

mod common;

use axum::http::Method;
use common::{Harness, assert_error, vm};
use serde_json::{Value, json};

fn public(id: &str, uid: u32, v4: Option<&str>, v6: Option<&str>) -> Value {
    let mut v = vm(id, uid);
    v["network"]["routes"] = json!([{"destination": "0.0.0.0/0", "via": "host"},
                                    {"destination": "::/0", "via": "host"}]);
    if let Some(a) = v4 {
        v["public_ipv4"] = json!(a);
    }
    if let Some(a) = v6 {
        v["public_ipv6"] = json!(a);
    }
    v
}

#[tokio::test]
async fn public_addresses_show_in_config_and_status() {
    let h = Harness::new().await;
    let (st, v) = h
        .put_vm(&public(
            "web",
            7,
            Some("203.0.113.57"),
            Some("2001:db8:7::/56"),
        ))
        .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["config"]["public_ipv4"], "203.0.113.57");
    assert_eq!(v["config"]["public_ipv6"], "2001:db8:7::/56");
    assert_eq!(v["status"]["applied_public_ipv4"], "203.0.113.57");
    assert_eq!(v["status"]["applied_public_ipv6"], "2001:db8:7::/56");
    assert_eq!(v["status"]["public_neighbors"], "routed");
    let (_, got) = h.call(Method::GET, "/v1/vms/web", None).await;
    assert_eq!(got, v);
    let (st, v) = h
        .put_vm(&public("api", 8, None, Some("2001:db8::8/128")))
        .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        v["config"]["public_ipv6"], "2001:db8::8",
        "a /128 shows as the address"
    );
    assert_eq!(v["status"]["applied_public_ipv4"], Value::Null);
}

#[tokio::test]
async fn a_held_or_overlapping_public_address_is_409_naming_the_holder_and_nothing_changes() {
    let h = Harness::new().await;
    assert_eq!(
        h.put_vm(&public(
            "a",
            1,
            Some("203.0.113.5"),
            Some("2001:db8:7::/56")
        ))
        .await
        .0,
        200
    );
    assert_eq!(h.put_vm(&public("b", 2, None, None)).await.0, 200);
    let applies = h.driver.kernel().applies.len();
    let (_, before) = h.call(Method::GET, "/v1/vms/b", None).await;
    for (v4, v6, needle) in [
        (
            Some("203.0.113.5"),
            None,
            "public_ipv4 203.0.113.5 is already used by vm a",
        ),
        (
            None,
            Some("2001:db8:7:9::1"),
            "public_ipv6 2001:db8:7:9::1 overlaps public_ipv6 2001:db8:7::/56 of vm a",
        ),
        (
            None,
            Some("2001:db8:7::/48"),
            "public_ipv6 2001:db8:7::/48 overlaps public_ipv6 2001:db8:7::/56 of vm a",
        ),
    ] {
        assert_error(
            &h.put_vm(&public("b", 2, v4, v6)).await,
            409,
            "CONFLICT",
            &["vm b:", needle],
        );
    }
    assert_eq!(h.driver.kernel().applies.len(), applies, "nothing applied");
    assert_eq!(
        h.call(Method::GET, "/v1/vms/b", None).await.1,
        before,
        "b unchanged"
    );
    // a itself may keep (re-PUT) its addresses; once a gives one up, b may take it.
    assert_eq!(
        h.put_vm(&public(
            "a",
            1,
            Some("203.0.113.5"),
            Some("2001:db8:7::/56")
        ))
        .await
        .0,
        200
    );
    assert_eq!(
        h.put_vm(&public("a", 1, None, Some("2001:db8:7::/56")))
            .await
            .0,
        200
    );
    assert_eq!(
        h.put_vm(&public("b", 2, Some("203.0.113.5"), None)).await.0,
        200
    );
}

#[tokio::test]
async fn every_public_validation_rule_is_400_naming_the_field() {
    let h = Harness::new().await;
    let mut only_v4 = public("c", 3, None, Some("2001:db8::3"));
    only_v4["network"]["routes"] = json!([{"destination": "0.0.0.0/0", "via": "host"}]);
    let mut only_v6 = public("c", 3, Some("203.0.113.3"), None);
    only_v6["network"]["routes"] = json!([{"destination": "::/0", "via": "host"}]);
    let cases: Vec<(Value, Vec<&str>)> = vec![
        (
            only_v4,
            vec!["public_ipv6 2001:db8::3 needs an IPv6 route via host"],
        ),
        (
            only_v6,
            vec!["public_ipv4 203.0.113.3 needs an IPv4 route via host"],
        ),
        (
            public("c", 3, Some("10.0.0.3"), None),
            vec!["public_ipv4 10.0.0.3 lies in the private range 10.0.0.0/8"],
        ),
        (
            public("c", 3, None, Some("fdaa:1::3")),
            vec!["public_ipv6 fdaa:1::3 lies in the mesh range fdaa::/16"],
        ),
        (
            public("c", 3, None, Some("2001:db8:7::1/56")),
            vec!["public_ipv6 2001:db8:7::1/56 is not canonical"],
        ),
        (
            public("c", 3, Some("10.200.0.9"), None),
            vec!["public_ipv4 10.200.0.9 lies in the private range"],
        ),
    ];
    for (body, needles) in cases {
        let mut n = vec!["vm c:"];
        n.extend(needles);
        assert_error(&h.put_vm(&body).await, 400, "INVALID_INPUT", &n);
    }
    assert!(h.driver.kernel().applies.is_empty(), "nothing applied");
    assert_error(
        &h.call(Method::GET, "/v1/vms/c", None).await,
        404,
        "NOT_FOUND",
        &["vm c"],
    );
}
