//! In-process API tests of the VM routes over a temporary SQLite file
//! and a fake namespace driver (no root needed). Every response is checked against openapi.json.

mod common;

use axum::http::Method;
use common::{FakeDriver, Harness, assert_error, settings, vm};
use serde_json::{Value, json};

#[tokio::test]
async fn put_get_list_delete() {
    let h = Harness::new().await;
    let (st, v) = h.put_vm(&vm("vm-1", 7)).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["status"]["state"], "applied");
    assert_eq!(v["status"]["netns"], "tstn0007");
    assert_eq!(v["status"]["veth_host"], "tsth0007");
    assert_eq!(v["status"]["veth_ns"], "tstp0007");
    assert_eq!(v["status"]["transit"], "10.200.0.28/30");
    assert_eq!(v["status"]["tap"], "tstt0007");
    assert_eq!(v["status"]["guest_ipv4"], "172.16.0.2");
    assert_eq!(v["status"]["guest_mac"], "06:00:ac:10:00:02");
    assert_eq!(v["status"]["mtu"], 1380);
    assert_eq!(v["status"]["mesh_ipv6"], "fdaa:1::7");
    assert_eq!(
        v["status"]["applied_routes"],
        json!([{"destination": "0.0.0.0/0", "via": "host"}])
    );
    assert_eq!(v["status"]["last_error"], Value::Null);
    assert!(h.driver.applied(7).is_some());

    let (st, got) = h.call(Method::GET, "/v1/vms/vm-1", None).await;
    assert_eq!(st, 200);
    assert_eq!(got, v);
    h.put_vm(&vm("vm-2", 8)).await;
    let (_, list) = h.call(Method::GET, "/v1/vms", None).await;
    let ids: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["config"]["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["vm-1", "vm-2"]);

    let (st, del) = h.call(Method::DELETE, "/v1/vms/vm-1", None).await;
    assert_eq!(st, 200);
    assert_eq!(del["config"]["id"], "vm-1");
    assert!(
        h.driver.applied(7).is_none(),
        "delete removes the kernel objects"
    );
    assert_error(
        &h.call(Method::GET, "/v1/vms/vm-1", None).await,
        404,
        "NOT_FOUND",
        &["vm vm-1"],
    );
    assert_error(
        &h.call(Method::DELETE, "/v1/vms/vm-1", None).await,
        404,
        "NOT_FOUND",
        &["vm vm-1"],
    );
    // An id no PUT would take is refused as such, as a PUT refuses it, not "not found".
    for method in [Method::GET, Method::DELETE] {
        assert_error(
            &h.call(method.clone(), "/v1/vms/..%2F..%2Fetc", None).await,
            400,
            "INVALID_INPUT",
            &["../../etc", "only A-Z a-z 0-9"],
        );
    }
}

#[tokio::test]
async fn a_vm_without_mesh_has_no_veth() {
    let h = Harness::new().await;
    let (st, v) = h
        .put_vm(&json!({"id": "warm", "user_id": 3, "tenant": 0}))
        .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["status"]["veth_host"], Value::Null);
    assert_eq!(v["status"]["transit"], Value::Null);
    assert_eq!(v["status"]["mesh_ipv6"], Value::Null);
}

/// One fixture per validation rule: the status, the code and the field named in the message.
#[tokio::test]
async fn every_validation_rule_is_400_naming_the_field() {
    let h = Harness::new().await;
    let good = vm("vm-1", 1);
    assert_eq!(h.put_vm(&good).await.0, 200);
    let applies_before = h.driver.kernel().applies.len();
    let with = |f: &dyn Fn(&mut Value)| {
        let mut v = good.clone();
        f(&mut v);
        v
    };
    let cases: Vec<(&str, Value, Vec<&str>)> = vec![
        (
            "unknown field",
            with(&|v| v["colour"] = json!("red")),
            vec!["colour", "unknown field"],
        ),
        (
            "future field",
            with(&|v| v["wireguard"] = json!({})),
            vec!["wireguard", "not supported yet"],
        ),
        (
            "metadata version",
            with(&|v| v["metadata"] = json!({"version": "v3"})),
            vec!["metadata.version", "not a metadata version"],
        ),
        (
            "future field under network",
            with(&|v| v["network"]["wireguard"] = json!({})),
            vec!["network.wireguard", "not supported yet"],
        ),
        (
            "firewall rule ports",
            with(&|v| {
                v["firewall"] = json!({"enabled": true, "inbound": [
                    {"protocol": "tcp", "prefixes": ["::/0"]},
                    {"protocol": "tcp", "ports": "10-5", "prefixes": ["::/0"]}]});
            }),
            vec!["firewall.inbound[1].ports", "10-5"],
        ),
        (
            "unknown network field",
            with(&|v| v["network"]["x"] = json!(1)),
            vec!["network.x"],
        ),
        (
            "user_id too large",
            with(&|v| v["user_id"] = json!(65536)),
            vec!["user_id", "65536"],
        ),
        (
            "user_id negative",
            with(&|v| v["user_id"] = json!(-1)),
            vec!["user_id"],
        ),
        (
            "user_id not a number",
            with(&|v| v["user_id"] = json!("7")),
            vec!["user_id"],
        ),
        (
            "user_id missing",
            with(&|v| {
                v.as_object_mut().unwrap().remove("user_id");
            }),
            vec!["user_id", "required"],
        ),
        (
            "tenant missing",
            with(&|v| {
                v.as_object_mut().unwrap().remove("tenant");
            }),
            vec!["tenant", "required"],
        ),
        (
            "tenant too large",
            with(&|v| v["tenant"] = json!(4_294_967_296_u64)),
            vec!["tenant"],
        ),
        (
            "private limit negative",
            with(&|v| v["private_network_throughput_mibps"] = json!(-1)),
            vec!["private_network_throughput_mibps", "negative"],
        ),
        (
            "private limit fractional",
            with(&|v| v["private_network_throughput_mibps"] = json!(2.5)),
            vec!["private_network_throughput_mibps", "whole number"],
        ),
        (
            "public limit too large",
            with(&|v| v["public_network_throughput_mibps"] = json!(100_001)),
            vec!["public_network_throughput_mibps", "too large"],
        ),
        (
            "public limit not a number",
            with(&|v| v["public_network_throughput_mibps"] = json!("20")),
            vec!["public_network_throughput_mibps", "must be a number"],
        ),
        (
            "mesh outside fdaa::/16",
            with(&|v| v["mesh_ipv6"] = json!("fd00::1")),
            vec!["mesh_ipv6", "fdaa::/16"],
        ),
        (
            "mesh not an address",
            with(&|v| v["mesh_ipv6"] = json!("nope")),
            vec!["mesh_ipv6"],
        ),
        (
            "mesh a larger prefix",
            with(&|v| v["mesh_ipv6"] = json!("fdaa:1::/64")),
            vec!["mesh_ipv6"],
        ),
        (
            "routes not an array",
            with(&|v| v["network"]["routes"] = json!({})),
            vec!["network.routes"],
        ),
        (
            "destination not canonical",
            with(&|v| {
                v["network"]["routes"] = json!([{"destination": "10.0.0.1/8", "via": "host"}])
            }),
            vec!["network.routes[0].destination", "canonical"],
        ),
        (
            "destination malformed",
            with(&|v| v["network"]["routes"] = json!([{"destination": "ten/8", "via": "host"}])),
            vec!["network.routes[0].destination"],
        ),
        (
            "destination twice",
            with(&|v| {
                v["network"]["routes"] = json!([{"destination": "0.0.0.0/0", "via": "host"},
                                                {"destination": "0.0.0.0/0", "via": "host"}]);
            }),
            vec!["network.routes[1].destination", "more than once"],
        ),
        (
            "via neither host nor mesh",
            with(&|v| {
                v["network"]["routes"] = json!([{"destination": "::/0", "via": "2001:db8::1"}])
            }),
            vec!["network.routes[0].via"],
        ),
        (
            "mesh via for IPv4",
            with(&|v| {
                v["network"]["routes"] = json!([{"destination": "0.0.0.0/0", "via": "fdaa:1::56"}])
            }),
            vec!["network.routes[0].via", "IPv6 only"],
        ),
        (
            "route unknown field",
            with(&|v| {
                v["network"]["routes"] =
                    json!([{"destination": "::/0", "via": "host", "metric": 1}])
            }),
            vec!["network.routes[0].metric"],
        ),
        (
            "route missing via",
            with(&|v| v["network"]["routes"] = json!([{"destination": "::/0"}])),
            vec!["network.routes[0].via", "required"],
        ),
        (
            "routes without mesh address",
            with(&|v| {
                v.as_object_mut().unwrap().remove("mesh_ipv6");
            }),
            vec!["network.routes", "mesh_ipv6"],
        ),
        ("body not an object", json!([1, 2]), vec!["object"]),
    ];
    for (rule, body, needles) in &cases {
        let got = h
            .call(Method::PUT, "/v1/vms/vm-1", Some(body.clone()))
            .await;
        assert_eq!(got.0, 400, "{rule}: {}", got.1);
        assert_error(&got, 400, "INVALID_INPUT", needles);
    }
    // Ids: bad characters, empty, too long, and a body/path mismatch.
    for (path_id, body_id, needle) in [
        ("a%3Bb", "a;b", "id"),
        ("x", "", "id"),
        ("long", &*"a".repeat(65), "id"),
        ("vm-9", "vm-1", "does not match"),
    ] {
        let got = h
            .call(
                Method::PUT,
                &format!("/v1/vms/{path_id}"),
                Some(with(&|v| v["id"] = json!(body_id))),
            )
            .await;
        assert_error(&got, 400, "INVALID_INPUT", &[needle]);
    }
    // Nothing reached the kernel, and the good VM is untouched.
    assert_eq!(h.driver.kernel().applies.len(), applies_before);
    let (_, v) = h.call(Method::GET, "/v1/vms/vm-1", None).await;
    assert_eq!(v["config"], good);
    assert_eq!(v["status"]["state"], "applied");
}

#[tokio::test]
async fn user_id_beyond_the_transit_range_is_400() {
    let tmp = tempfile::tempdir().unwrap();
    let s = vmnet_plan::ns::NsSettings {
        transit_ipv4: "10.9.0.0/24".parse().unwrap(),
        ..settings()
    };
    let h = Harness::open(tmp.path(), FakeDriver::default(), s).await;
    assert_eq!(h.put_vm(&vm("ok", 63)).await.0, 200);
    assert_error(
        &h.put_vm(&vm("big", 64)).await,
        400,
        "INVALID_INPUT",
        &["user_id 64", "10.9.0.0/24"],
    );
}

#[tokio::test]
async fn malformed_json_wrong_type_and_oversized_bodies() {
    let h = Harness::new().await;
    let got = h
        .raw(
            Method::PUT,
            "/v1/vms/vm-1",
            Some(b"{\"id\": \"vm-1\",".to_vec()),
            Some("application/json"),
        )
        .await;
    // The message names the VM of the path: the body could not.
    assert_error(&got, 400, "INVALID_INPUT", &["vm vm-1: malformed JSON"]);
    let got = h
        .raw(
            Method::PUT,
            "/v1/vms/vm-1",
            Some(b"not json".to_vec()),
            Some("application/json"),
        )
        .await;
    assert_error(&got, 400, "INVALID_INPUT", &["JSON"]);
    let body = serde_json::to_vec(&vm("vm-1", 1)).unwrap();
    let got = h
        .raw(
            Method::PUT,
            "/v1/vms/vm-1",
            Some(body.clone()),
            Some("text/plain"),
        )
        .await;
    assert_error(&got, 400, "INVALID_INPUT", &["Content-Type"]);
    let got = h.raw(Method::PUT, "/v1/vms/vm-1", Some(body), None).await;
    assert_error(&got, 400, "INVALID_INPUT", &["Content-Type"]);
    let mut big = vm("vm-1", 1);
    big["pad"] = json!("x".repeat(70 * 1024));
    let got = h.call(Method::PUT, "/v1/vms/vm-1", Some(big)).await;
    assert_error(&got, 400, "INVALID_INPUT", &["65536 bytes"]);
    // The same for a body the IPAM routes decode with serde.
    let got = h
        .raw(
            Method::PUT,
            "/v1/pools/p1/range",
            Some(b"{".to_vec()),
            Some("application/json"),
        )
        .await;
    assert_error(&got, 400, "INVALID_INPUT", &["request body"]);
    let got = h
        .raw(
            Method::PUT,
            "/v1/pools/p1/range",
            Some(vec![b' '; 70 * 1024]),
            Some("application/json"),
        )
        .await;
    assert_error(&got, 400, "INVALID_INPUT", &["65536 bytes"]);
    let got = h
        .call(
            Method::PUT,
            "/v1/hosts/h1",
            Some(json!({"vcpus": 1, "memory_mib": 1, "gpu": 1})),
        )
        .await;
    assert_error(&got, 400, "INVALID_INPUT", &["gpu"]);
    assert!(h.driver.kernel().applies.is_empty());
}

#[tokio::test]
async fn unknown_routes_and_methods_answer_the_error_body() {
    let h = Harness::new().await;
    assert_error(
        &h.call(Method::GET, "/v1/nope", None).await,
        404,
        "NOT_FOUND",
        &["no route GET /v1/nope"],
    );
    assert_error(
        &h.call(Method::GET, "/", None).await,
        404,
        "NOT_FOUND",
        &["no route"],
    );
    // A wrong method on a served path is 405 (the Allow header: api_ipam.rs).
    assert_error(
        &h.call(Method::PATCH, "/v1/vms/x", None).await,
        405,
        "METHOD_NOT_ALLOWED",
        &["method PATCH is not allowed on /v1/vms/{id}; allowed: GET, PUT, DELETE"],
    );
    assert_error(
        &h.call(Method::DELETE, "/v1/status", None).await,
        405,
        "METHOD_NOT_ALLOWED",
        &["method DELETE is not allowed on /v1/status; allowed: GET"],
    );
}

#[tokio::test]
async fn limits_are_stored_and_reported_per_class_and_direction() {
    let h = Harness::new().await;
    let mut body = vm("lim", 9);
    body["private_network_throughput_mibps"] = json!(20);
    body["public_network_throughput_mibps"] = json!(2);
    let (st, v) = h.put_vm(&body).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["config"]["public_network_throughput_mibps"], 2);
    let (_, got) = h.call(Method::GET, "/v1/vms/lim", None).await;
    let rows: Vec<(String, String, u64, bool)> = got["status"]["limits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            (
                l["direction"].as_str().unwrap().to_owned(),
                l["class"].as_str().unwrap().to_owned(),
                l["limit_mibps"].as_u64().unwrap(),
                l["applied"].as_bool().unwrap(),
            )
        })
        .collect();
    let row = |d: &str, c: &str, l, a| (d.to_owned(), c.to_owned(), l, a);
    assert_eq!(
        rows,
        [
            row("download", "private", 20, true),
            row("download", "public", 2, true),
            row("upload", "private", 20, true),
            row("upload", "public", 2, true),
        ]
    );
    // A public IPv6 path alone (no IPv4 route via host) is a public path: the limit applies.
    body["network"]["routes"] = json!([{"destination": "::/0", "via": "host"}]);
    let (st, v) = h.put_vm(&body).await;
    assert_eq!(st, 200, "{v}");
    assert!(
        v["status"]["limits"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|l| l["class"] == "public")
            .all(|l| l["limit_mibps"] == 2 && l["applied"] == true),
        "{v}"
    );
    // Without any route via host there is no public path: the limit is kept, not applied.
    body["network"]["routes"] = json!([]);
    let (st, v) = h.put_vm(&body).await;
    assert_eq!(st, 200, "{v}");
    let public: Vec<_> = v["status"]["limits"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["class"] == "public")
        .collect();
    assert!(
        public
            .iter()
            .all(|l| l["limit_mibps"] == 2 && l["applied"] == false),
        "{v}"
    );
}
