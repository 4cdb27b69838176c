//! In-process API tests of the IPAM routes (pools, ranges, hosts, instances, leases) over a
//! temporary SQLite file. Every response is checked against openapi.json.

mod common;

use axum::http::Method;
use common::{Harness, assert_error};
use serde_json::json;

async fn setup(h: &Harness) {
    let (st, r) = h
        .call(
            Method::PUT,
            "/v1/pools/p1/range",
            Some(json!({"cidr": "10.0.0.0/29", "gateway": "10.0.0.1"})),
        )
        .await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(
        r,
        json!({"pool_id": "p1", "cidr": "10.0.0.0/29", "gateway": "10.0.0.1",
                         "first_host": "10.0.0.2", "last_host": "10.0.0.6", "dns": []})
    );
    let (st, host) = h
        .call(
            Method::PUT,
            "/v1/hosts/h1",
            Some(json!({"vcpus": 64, "memory_mib": 65536})),
        )
        .await;
    assert_eq!(st, 200, "{host}");
}

fn inst(id: &str) -> serde_json::Value {
    json!({"instance_id": id, "pool_id": "p1", "vcpus": 1, "memory_mib": 512})
}

#[tokio::test]
async fn the_spec_example_over_the_api() {
    let h = Harness::new().await;
    setup(&h).await;
    for (i, want) in ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5", "10.0.0.6"]
        .iter()
        .enumerate()
    {
        let (st, v) = h
            .call(Method::POST, "/v1/instances", Some(inst(&format!("i{i}"))))
            .await;
        assert_eq!(st, 201, "{v}");
        assert_eq!(v["address"], *want);
        assert_eq!(v["host_id"], "h1");
    }
    // Exhausted: 503 CAPACITY_UNAVAILABLE, nothing kept (no instance, no host claim).
    let got = h
        .call(Method::POST, "/v1/instances", Some(inst("i5")))
        .await;
    assert_error(
        &got,
        503,
        "CAPACITY_UNAVAILABLE",
        &["Pool p1 has no free IP address"],
    );
    assert_eq!(h.call(Method::GET, "/v1/instances/i5", None).await.0, 404);
    let (_, host) = h.call(Method::GET, "/v1/hosts/h1", None).await;
    assert_eq!(host["used_vcpus"], 5);

    // Delete one, the sixth gets the freed address (PUT is the same as POST).
    let (st, del) = h.call(Method::DELETE, "/v1/instances/i2", None).await;
    assert_eq!(st, 200);
    assert_eq!(del["address"], "10.0.0.4");
    let (st, v) = h.call(Method::PUT, "/v1/instances", Some(inst("i5"))).await;
    assert_eq!(st, 201);
    assert_eq!(v["address"], "10.0.0.4");

    let (_, leases) = h.call(Method::GET, "/v1/pools/p1/leases", None).await;
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
    let (_, pool) = h.call(Method::GET, "/v1/pools/p1", None).await;
    assert_eq!(pool["leases"], 5);
    let (_, pools) = h.call(Method::GET, "/v1/pools", None).await;
    assert_eq!(pools.as_array().unwrap().len(), 1);
    let (_, list) = h.call(Method::GET, "/v1/instances", None).await;
    assert_eq!(list.as_array().unwrap().len(), 5);
}

#[tokio::test]
async fn duplicate_instance_is_409_and_unknowns_are_404() {
    let h = Harness::new().await;
    setup(&h).await;
    assert_eq!(
        h.call(Method::POST, "/v1/instances", Some(inst("a")))
            .await
            .0,
        201
    );
    let mut bigger = inst("a");
    bigger["vcpus"] = json!(2);
    assert_error(
        &h.call(Method::POST, "/v1/instances", Some(bigger)).await,
        409,
        "CONFLICT",
        &["instance a already exists with vcpus 1 (this request: 2)"],
    );
    let mut other = inst("b");
    other["pool_id"] = json!("nope");
    assert_error(
        &h.call(Method::POST, "/v1/instances", Some(other)).await,
        404,
        "NOT_FOUND",
        &["nope"],
    );
    assert_error(
        &h.call(Method::GET, "/v1/instances/zz", None).await,
        404,
        "NOT_FOUND",
        &["zz"],
    );
    assert_error(
        &h.call(Method::DELETE, "/v1/instances/zz", None).await,
        404,
        "NOT_FOUND",
        &["zz"],
    );
    assert_error(
        &h.call(Method::GET, "/v1/pools/zz", None).await,
        404,
        "NOT_FOUND",
        &["zz"],
    );
    assert_error(
        &h.call(Method::GET, "/v1/pools/zz/leases", None).await,
        404,
        "NOT_FOUND",
        &["zz"],
    );
    assert_error(
        &h.call(Method::GET, "/v1/hosts/zz", None).await,
        404,
        "NOT_FOUND",
        &["zz"],
    );
    assert_error(
        &h.call(Method::POST, "/v1/hosts/zz/lose", None).await,
        404,
        "NOT_FOUND",
        &["zz"],
    );
}

#[tokio::test]
async fn range_and_instance_validation_name_the_field() {
    let h = Harness::new().await;
    let got = h
        .call(
            Method::PUT,
            "/v1/pools/p1/range",
            Some(json!({"cidr": "10.0.0.1/24", "gateway": "10.0.0.1"})),
        )
        .await;
    assert_error(&got, 400, "INVALID_INPUT", &["pool p1", "cidr"]);
    let got = h
        .call(
            Method::PUT,
            "/v1/pools/p1/range",
            Some(json!({"cidr": "10.0.0.0/24", "gateway": "10.0.0.1", "first_host": "10.0.1.2"})),
        )
        .await;
    assert_error(&got, 400, "INVALID_INPUT", &["pool p1", "first_host"]);
    let got = h
        .call(
            Method::PUT,
            "/v1/pools/p1/range",
            Some(json!({"cidr": "2001:db8::/64", "gateway": "2001:db8::1"})),
        )
        .await;
    assert_error(&got, 400, "INVALID_INPUT", &["cidr", "IPv6"]);
    let got = h
        .call(
            Method::PUT,
            "/v1/pools/p1/range",
            Some(json!({"cidr": "10.0.0.0/24"})),
        )
        .await;
    assert_error(&got, 400, "INVALID_INPUT", &["gateway"]);
    let got = h
        .call(
            Method::PUT,
            "/v1/pools/a;b/range",
            Some(json!({"cidr": "10.0.0.0/24", "gateway": "10.0.0.1"})),
        )
        .await;
    assert_error(&got, 400, "INVALID_INPUT", &["pool_id"]);
    setup(&h).await;
    let mut bad = inst("x");
    bad["vcpus"] = json!(0);
    assert_error(
        &h.call(Method::POST, "/v1/instances", Some(bad)).await,
        400,
        "INVALID_INPUT",
        &["vcpus"],
    );
    let mut bad = inst("x");
    bad["memory"] = json!(1);
    assert_error(
        &h.call(Method::POST, "/v1/instances", Some(bad)).await,
        400,
        "INVALID_INPUT",
        &["memory"],
    );
    let got = h
        .call(
            Method::PUT,
            "/v1/hosts/h1",
            Some(json!({"vcpus": 1, "memory_mib": 1})),
        )
        .await;
    assert_error(&got, 409, "CONFLICT", &["host h1", "capacity"]);
    let got = h
        .call(
            Method::PUT,
            "/v1/hosts/h1",
            Some(json!({"vcpus": 64, "memory_mib": 65536})),
        )
        .await;
    assert_eq!(got.0, 200, "the same capacity again is a no-op");
    let got = h
        .call(
            Method::PUT,
            "/v1/hosts/h2",
            Some(json!({"vcpus": -1, "memory_mib": 1})),
        )
        .await;
    assert_error(&got, 400, "INVALID_INPUT", &["vcpus"]);
}

#[tokio::test]
async fn host_loss_recreates_or_loses() {
    let h = Harness::new().await;
    setup(&h).await;
    h.call(
        Method::PUT,
        "/v1/hosts/h2",
        Some(json!({"vcpus": 4, "memory_mib": 4096})),
    )
    .await;
    let mut a = inst("a");
    a["host_id"] = json!("h1");
    a["recreate_on_host_loss"] = json!(true);
    let mut b = inst("b");
    b["host_id"] = json!("h1");
    h.call(Method::POST, "/v1/instances", Some(a)).await;
    h.call(Method::POST, "/v1/instances", Some(b)).await;
    let (st, loss) = h.call(Method::POST, "/v1/hosts/h1/lose", None).await;
    assert_eq!(st, 200, "{loss}");
    assert_eq!(loss["host_id"], "h1");
    let (_, a) = h.call(Method::GET, "/v1/instances/a", None).await;
    assert_eq!(a["host_id"], "h2");
    assert_eq!(a["state"], "running");
    let (_, b) = h.call(Method::GET, "/v1/instances/b", None).await;
    assert_eq!(b["state"], "lost");
    assert_eq!(b["address"], serde_json::Value::Null);
    let (_, hosts) = h.call(Method::GET, "/v1/hosts", None).await;
    assert_eq!(hosts.as_array().unwrap().len(), 2);
}

#[tokio::test]
async fn instance_defaults_vcpus_and_memory_like_the_cli() {
    let h = Harness::new().await;
    setup(&h).await;
    let (st, v) = h
        .call(
            Method::POST,
            "/v1/instances",
            Some(json!({"instance_id": "d1", "pool_id": "p1"})),
        )
        .await;
    assert_eq!(st, 201, "{v}");
    assert_eq!(
        (v["vcpus"].clone(), v["memory_mib"].clone()),
        (json!(1), json!(512))
    );
}

fn exact(got: &(axum::http::StatusCode, serde_json::Value), message: &str) {
    assert_eq!(got.0.as_u16(), 400, "{}", got.1);
    assert_eq!(
        got.1,
        json!({"error": {"code": "INVALID_INPUT", "message": message}})
    );
}

#[tokio::test]
async fn body_errors_name_the_object_and_field_in_vmnet_words() {
    let h = Harness::new().await;
    setup(&h).await;
    let mut bad = inst("x");
    bad["vcpus"] = json!("x");
    exact(
        &h.call(Method::POST, "/v1/instances", Some(bad)).await,
        r#"instance: vcpus: invalid type: string "x", expected u32"#,
    );
    exact(
        &h.call(
            Method::POST,
            "/v1/instances",
            Some(json!({"instance_id": "x"})),
        )
        .await,
        "instance: missing field `pool_id`",
    );
    exact(
        &h.call(
            Method::PUT,
            "/v1/hosts/h2",
            Some(json!({"vcpus": 1, "memory_mib": 1, "gpu": 1})),
        )
        .await,
        "host: gpu: unknown field `gpu`, expected `vcpus` or `memory_mib`",
    );
    exact(
        &h.call(
            Method::PUT,
            "/v1/pools/p2/range",
            Some(json!({"cidr": 5, "gateway": "10.0.0.1"})),
        )
        .await,
        "pool: cidr: invalid type: integer `5`, expected a string",
    );
    exact(
        &h.call(
            Method::PUT,
            "/v1/pools/p2/range",
            Some(json!({"cidr": "010.5.0.0/24", "gateway": "10.5.0.1"})),
        )
        .await,
        r#"pool p2: cidr "010.5.0.0/24" is not an IPv4 CIDR such as 10.0.0.0/24"#,
    );
    exact(
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
async fn wrong_method_on_a_served_path_is_405_with_allow() {
    use axum::body::Body;
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let h = Harness::new().await;
    let cases = [
        (
            Method::POST,
            "/v1/vms/a0",
            "GET, PUT, DELETE",
            "method POST is not allowed on /v1/vms/{id}; allowed: GET, PUT, DELETE",
        ),
        (
            Method::DELETE,
            "/v1/instances",
            "GET, POST, PUT",
            "method DELETE is not allowed on /v1/instances; allowed: GET, POST, PUT",
        ),
        (
            Method::GET,
            "/v1/hosts/h1/lose",
            "POST",
            "method GET is not allowed on /v1/hosts/{id}/lose; allowed: POST",
        ),
    ];
    for (method, path, allow, message) in cases {
        let req = axum::http::Request::builder()
            .method(method.clone())
            .uri(path)
            .body(Body::empty())
            .unwrap();
        let resp = h.router.clone().oneshot(req).await.unwrap();
        assert_eq!(resp.status().as_u16(), 405, "{method} {path}");
        assert_eq!(resp.headers()["allow"], allow, "{method} {path}");
        assert_eq!(resp.headers()["content-type"], "application/json");
        assert!(resp.headers().get("x-vmnet-error-body").is_none());
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            v,
            json!({"error": {"code": "METHOD_NOT_ALLOWED", "message": message}})
        );
        // The harness also checks the answer against openapi.json.
        assert_error(
            &h.call(method, path, None).await,
            405,
            "METHOD_NOT_ALLOWED",
            &[message],
        );
    }
    // An unknown path stays 404.
    assert_error(
        &h.call(Method::POST, "/v1/vms/a0/x", None).await,
        404,
        "NOT_FOUND",
        &["no route POST /v1/vms/a0/x"],
    );
}

#[tokio::test]
async fn network_policy_sandbox_and_allocation_id() {
    let h = Harness::new().await;
    setup(&h).await;
    // Defaults: public, no sandbox, an allocation id.
    let (st, d) = h.call(Method::POST, "/v1/instances", Some(inst("d"))).await;
    assert_eq!(st, 201, "{d}");
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
        let (_, got) = h
            .call(Method::GET, &format!("/v1/instances/{id}"), None)
            .await;
        assert_eq!(got, v);
        assert_ne!(got["allocation_id"], json!(d_alloc));
    }
    let (_, list) = h.call(Method::GET, "/v1/instances", None).await;
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
        let got = h.call(Method::POST, "/v1/instances", Some(bad)).await;
        assert_error(&got, 400, "INVALID_INPUT", &["instance: network_policy: "]);
    }
    let mut bad = inst("x");
    bad["network_policy"] = json!("open");
    exact(
        &h.call(Method::POST, "/v1/instances", Some(bad)).await,
        r#"instance: network_policy: unknown network_policy "open", expected one of public, private, none"#,
    );
    let mut bad = inst("x");
    bad["sandbox"] = json!("yes");
    let got = h.call(Method::POST, "/v1/instances", Some(bad)).await;
    assert_error(&got, 400, "INVALID_INPUT", &["instance: sandbox: "]);
    assert_eq!(h.call(Method::GET, "/v1/instances/x", None).await.0, 404);
    // Re-placement after a host loss keeps policy and sandbox, with a new allocation id.
    h.call(
        Method::PUT,
        "/v1/hosts/h2",
        Some(json!({"vcpus": 4, "memory_mib": 4096})),
    )
    .await;
    let (_, before) = h.call(Method::GET, "/v1/instances/p", None).await;
    let (st, loss) = h.call(Method::POST, "/v1/hosts/h1/lose", None).await;
    assert_eq!(st, 200, "{loss}");
    let (_, after) = h.call(Method::GET, "/v1/instances/p", None).await;
    assert_eq!(after["host_id"], "h2");
    assert_eq!(
        (&after["network_policy"], &after["sandbox"]),
        (&json!("private"), &json!(true))
    );
    assert_ne!(after["allocation_id"], before["allocation_id"]);
}

#[tokio::test]
async fn status_reports_append_addresses_after_the_lease() {
    let h = Harness::new().await;
    setup(&h).await;
    h.call(
        Method::PUT,
        "/v1/hosts/h2",
        Some(json!({"vcpus": 4, "memory_mib": 4096})),
    )
    .await;
    let mut a = inst("a");
    a["host_id"] = json!("h1");
    a["recreate_on_host_loss"] = json!(true);
    let (st, v) = h.call(Method::POST, "/v1/instances", Some(a)).await;
    assert_eq!(st, 201, "{v}");
    assert_eq!(v["addresses"], json!(["10.0.0.2/29"]));
    let mut b = inst("b");
    b["host_id"] = json!("h2");
    h.call(Method::POST, "/v1/instances", Some(b)).await;

    let report = json!({"instances": [
        {"instance_id": "a", "addresses": ["10.0.0.2/29", "2001:db8::5/64"]},
        {"instance_id": "b", "addresses": ["10.9.0.1/24"]},
        {"instance_id": "zz", "addresses": []}
    ]});
    let (st, out) = h
        .call(Method::POST, "/v1/hosts/h1/status", Some(report))
        .await;
    assert_eq!(st, 200, "{out}");
    assert_eq!(
        out,
        json!({
            "host_id": "h1",
            "updated": [{"instance_id": "a", "added": ["2001:db8::5/64"],
                         "addresses": ["10.0.0.2/29", "2001:db8::5/64"]}],
            "skipped": [
                {"instance_id": "b", "reason": "not_on_host",
                 "message": "instance b is placed on host h2, not h1"},
                {"instance_id": "zz", "reason": "unknown_instance",
                 "message": "instance zz not found"}
            ]
        })
    );
    let report = json!({"instances": [
        {"instance_id": "a", "addresses": ["192.168.7.2/24", "2001:db8::5/64"]}
    ]});
    let (st, out) = h
        .call(Method::POST, "/v1/hosts/h1/status", Some(report))
        .await;
    assert_eq!(st, 200, "{out}");
    assert_eq!(out["updated"][0]["added"], json!(["192.168.7.2/24"]));
    let want = json!(["10.0.0.2/29", "2001:db8::5/64", "192.168.7.2/24"]);
    let (_, got) = h.call(Method::GET, "/v1/instances/a", None).await;
    assert_eq!(got["addresses"], want);
    assert_eq!(got["address"], "10.0.0.2", "the lease is still the lease");
    let (_, list) = h.call(Method::GET, "/v1/instances", None).await;
    assert_eq!(list[0]["addresses"], want);
    assert_eq!(list[1]["addresses"], json!(["10.0.0.3/29"]));

    // A malformed report: 400 naming the instance and field, nothing written.
    let got = h
        .call(
            Method::POST,
            "/v1/hosts/h1/status",
            Some(json!({"instances": [
                {"instance_id": "a", "addresses": ["10.1.1.1/24"]},
                {"instance_id": "b", "addresses": ["10.1.1.2"]}
            ]})),
        )
        .await;
    exact(
        &got,
        "instance b: addresses[0] \"10.1.1.2\" is not an address in CIDR form such as 10.0.0.2/24",
    );
    let got = h
        .call(
            Method::POST,
            "/v1/hosts/h1/status",
            Some(json!({"instances": [], "extra": 1})),
        )
        .await;
    assert_error(&got, 400, "INVALID_INPUT", &["status report", "extra"]);
    let (_, got) = h.call(Method::GET, "/v1/instances/a", None).await;
    assert_eq!(got["addresses"], want);
    assert_error(
        &h.call(
            Method::POST,
            "/v1/hosts/h9/status",
            Some(json!({"instances": []})),
        )
        .await,
        404,
        "NOT_FOUND",
        &["host h9 not found"],
    );

    // A host loss clears what the lost host reported; the new host reports afresh.
    let (st, loss) = h.call(Method::POST, "/v1/hosts/h1/lose", None).await;
    assert_eq!(st, 200, "{loss}");
    assert_eq!(loss["instances"][0]["host_id"], "h2");
    assert_eq!(loss["instances"][0]["addresses"], json!(["10.0.0.2/29"]));
    let (st, out) = h
        .call(
            Method::POST,
            "/v1/hosts/h2/status",
            Some(json!({"instances": [{"instance_id": "a", "addresses": ["10.8.0.1/24"]}]})),
        )
        .await;
    assert_eq!(st, 200, "{out}");
    assert_eq!(
        out["updated"][0]["addresses"],
        json!(["10.0.0.2/29", "10.8.0.1/24"])
    );
}
