//! In-process API tests of the IPAM routes for pools, ranges and instances over a temporary
//! SQLite file: placement and leases, conflicts and unknowns, validation naming the field, body
//! errors in vmnet's words, policy and sandbox. Hosts are in `api_hosts.rs`. Every response is
//! checked against openapi.json.

mod common;

use axum::http::Method;
use common::{Harness, assert_error, assert_invalid, instance, range};
use serde_json::json;

fn inst(id: &str) -> serde_json::Value {
    instance(id, "p1")
}

#[tokio::test]
async fn the_spec_example_over_the_api() {
    let h = Harness::new().await;
    let r = h.with_range("p1", range("10.0.0.0/29", "10.0.0.1")).await;
    assert_eq!(
        r,
        json!({"pool_id": "p1", "cidr": "10.0.0.0/29", "gateway": "10.0.0.1",
               "first_host": "10.0.0.2", "last_host": "10.0.0.6", "dns": []})
    );
    h.with_host("h1", 64, 65536).await;
    for (i, want) in ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5", "10.0.0.6"]
        .iter()
        .enumerate()
    {
        let v = h.with_instance(inst(&format!("i{i}"))).await;
        assert_eq!(v["address"], *want);
        assert_eq!(v["host_id"], "h1");
    }
    // Exhausted: 503 CAPACITY_UNAVAILABLE, nothing kept (no instance, no host claim).
    assert_error(
        &h.post("/v1/instances", inst("i5")).await,
        503,
        "CAPACITY_UNAVAILABLE",
        &["Pool p1 has no free IP address"],
    );
    assert_eq!(h.get("/v1/instances/i5").await.0, 404);
    let (_, host) = h.get("/v1/hosts/h1").await;
    assert_eq!(host["used_vcpus"], 5);

    // Delete one, the sixth gets the freed address (PUT is the same as POST).
    let (st, del) = h.delete("/v1/instances/i2").await;
    assert_eq!(st, 200);
    assert_eq!(del["address"], "10.0.0.4");
    let (st, v) = h.put("/v1/instances", inst("i5")).await;
    assert_eq!(st, 201);
    assert_eq!(v["address"], "10.0.0.4");

    let (_, leases) = h.get("/v1/pools/p1/leases").await;
    let addrs: Vec<&str> = leases
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["address"].as_str().unwrap())
        .collect();
    assert_eq!(
        addrs,
        ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5", "10.0.0.6"]
    );
    let (_, pool) = h.get("/v1/pools/p1").await;
    assert_eq!(pool["leases"], 5);
    let (_, pools) = h.get("/v1/pools").await;
    assert_eq!(pools.as_array().unwrap().len(), 1);
    let (_, list) = h.get("/v1/instances").await;
    assert_eq!(list.as_array().unwrap().len(), 5);
}

#[tokio::test]
async fn duplicate_instance_is_409_and_unknowns_are_404() {
    let h = Harness::new().await;
    h.with_pool_and_host().await;
    h.with_instance(inst("a")).await;
    let mut bigger = inst("a");
    bigger["vcpus"] = json!(2);
    assert_error(
        &h.post("/v1/instances", bigger).await,
        409,
        "CONFLICT",
        &["instance a already exists with vcpus 1 (this request: 2)"],
    );
    let mut other = inst("b");
    other["pool_id"] = json!("nope");
    assert_error(
        &h.post("/v1/instances", other).await,
        404,
        "NOT_FOUND",
        &["nope"],
    );
    for (method, path) in [
        (Method::GET, "/v1/instances/zz"),
        (Method::DELETE, "/v1/instances/zz"),
        (Method::GET, "/v1/pools/zz"),
        (Method::GET, "/v1/pools/zz/leases"),
        (Method::GET, "/v1/hosts/zz"),
        (Method::POST, "/v1/hosts/zz/lose"),
    ] {
        assert_error(&h.call(method, path, None).await, 404, "NOT_FOUND", &["zz"]);
    }
}

#[tokio::test]
async fn range_and_instance_validation_name_the_field() {
    let h = Harness::new().await;
    for (pool, body, needles) in [
        (
            "p1",
            range("10.0.0.1/24", "10.0.0.1"),
            &["pool p1", "cidr"][..],
        ),
        (
            "p1",
            json!({"cidr": "10.0.0.0/24", "gateway": "10.0.0.1", "first_host": "10.0.1.2"}),
            &["pool p1", "first_host"],
        ),
        (
            "p1",
            range("2001:db8::/64", "2001:db8::1"),
            &["cidr", "IPv6"],
        ),
        ("p1", json!({"cidr": "10.0.0.0/24"}), &["gateway"]),
        ("a;b", range("10.0.0.0/24", "10.0.0.1"), &["pool_id"]),
    ] {
        let got = h.put_range(pool, body).await;
        assert_error(&got, 400, "INVALID_INPUT", needles);
    }
    h.with_pool_and_host().await;
    for (field, value) in [("vcpus", json!(0)), ("memory", json!(1))] {
        let mut bad = inst("x");
        bad[field] = value;
        assert_error(
            &h.post("/v1/instances", bad).await,
            400,
            "INVALID_INPUT",
            &[field],
        );
    }
    let got = h.put_host("h1", 1, 1).await;
    assert_error(&got, 409, "CONFLICT", &["host h1", "capacity"]);
    let got = h.put_host("h1", 64, 65536).await;
    assert_eq!(got.0, 200, "the same capacity again is a no-op");
    let got = h.put_host("h2", -1, 1).await;
    assert_error(&got, 400, "INVALID_INPUT", &["vcpus"]);
}

#[tokio::test]
async fn instance_defaults_vcpus_and_memory_like_the_cli() {
    let h = Harness::new().await;
    h.with_pool_and_host().await;
    let v = h
        .with_instance(json!({"instance_id": "d1", "pool_id": "p1"}))
        .await;
    assert_eq!(
        (v["vcpus"].clone(), v["memory_mib"].clone()),
        (json!(1), json!(512))
    );
}

#[tokio::test]
async fn body_errors_name_the_object_and_field_in_vmnet_words() {
    let h = Harness::new().await;
    h.with_pool_and_host().await;
    let mut bad = inst("x");
    bad["vcpus"] = json!("x");
    assert_invalid(
        &h.post("/v1/instances", bad).await,
        r#"instance: vcpus: invalid type: string "x", expected u32"#,
    );
    assert_invalid(
        &h.post("/v1/instances", json!({"instance_id": "x"})).await,
        "instance: missing field `pool_id`",
    );
    assert_invalid(
        &h.put(
            "/v1/hosts/h2",
            json!({"vcpus": 1, "memory_mib": 1, "gpu": 1}),
        )
        .await,
        "host: gpu: unknown field `gpu`, expected `vcpus` or `memory_mib`",
    );
    assert_invalid(
        &h.put_range("p2", json!({"cidr": 5, "gateway": "10.0.0.1"}))
            .await,
        "pool: cidr: invalid type: integer `5`, expected a string",
    );
    assert_invalid(
        &h.put_range("p2", range("010.5.0.0/24", "10.5.0.1")).await,
        r#"pool p2: cidr "010.5.0.0/24" is not an IPv4 CIDR such as 10.0.0.0/24"#,
    );
    assert_invalid(
        &h.raw(
            Method::POST,
            "/v1/instances",
            Some(b"{\"instance_id\": ".to_vec()),
            Some("application/json"),
        )
        .await,
        "instance: request body is not valid JSON: instance_id: EOF while parsing a value at line 1 column 16",
    );
}

#[tokio::test]
async fn network_policy_sandbox_and_allocation_id() {
    let h = Harness::new().await;
    h.with_pool_and_host().await;
    // Defaults: public, no sandbox, an allocation id.
    let d = h.with_instance(inst("d")).await;
    assert_eq!(
        (&d["network_policy"], &d["sandbox"]),
        (&json!("public"), &json!(false))
    );
    let d_alloc = d["allocation_id"].as_str().unwrap().to_owned();
    assert!(
        d_alloc.starts_with("alloc-") && d_alloc.ends_with("-d"),
        "{d_alloc}"
    );
    for (id, policy, method) in [("p", "private", Method::POST), ("n", "none", Method::PUT)] {
        let mut body = inst(id);
        body["network_policy"] = json!(policy);
        body["sandbox"] = json!(true);
        body["recreate_on_host_loss"] = json!(true);
        let (st, v) = h.call(method, "/v1/instances", Some(body)).await;
        assert_eq!(st, 201, "{v}");
        assert_eq!(
            (&v["network_policy"], &v["sandbox"]),
            (&json!(policy), &json!(true))
        );
        let (_, got) = h.get(&format!("/v1/instances/{id}")).await;
        assert_eq!(got, v);
        assert_ne!(got["allocation_id"], json!(d_alloc));
    }
    let (_, list) = h.get("/v1/instances").await;
    let policies: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["network_policy"].as_str().unwrap())
        .collect();
    assert_eq!(policies, ["public", "none", "private"]);
    // An unknown policy (or a wrong type) is 400 INVALID_INPUT naming network_policy; nothing kept.
    for bad_policy in [json!("open"), json!("Public"), json!(1)] {
        let mut bad = inst("x");
        bad["network_policy"] = bad_policy;
        let got = h.post("/v1/instances", bad).await;
        assert_error(&got, 400, "INVALID_INPUT", &["instance: network_policy: "]);
    }
    let mut bad = inst("x");
    bad["network_policy"] = json!("open");
    assert_invalid(
        &h.post("/v1/instances", bad).await,
        r#"instance: network_policy: unknown network_policy "open", expected one of public, private, none"#,
    );
    let mut bad = inst("x");
    bad["sandbox"] = json!("yes");
    let got = h.post("/v1/instances", bad).await;
    assert_error(&got, 400, "INVALID_INPUT", &["instance: sandbox: "]);
    assert_eq!(h.get("/v1/instances/x").await.0, 404);
    // Re-placement after a host loss keeps policy and sandbox, with a new allocation id.
    h.with_host("h2", 4, 4096).await;
    let (_, before) = h.get("/v1/instances/p").await;
    let (st, loss) = h.call(Method::POST, "/v1/hosts/h1/lose", None).await;
    assert_eq!(st, 200, "{loss}");
    let (_, after) = h.get("/v1/instances/p").await;
    assert_eq!(after["host_id"], "h2");
    assert_eq!(
        (&after["network_policy"], &after["sandbox"]),
        (&json!("private"), &json!(true))
    );
    assert_ne!(after["allocation_id"], before["allocation_id"]);
}
