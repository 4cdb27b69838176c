//! In-process API tests of the host routes over a temporary SQLite file: a host loss recreates
//! or loses its instances, and status reports append addresses after the lease. Every response
//! is checked against openapi.json.

mod common;

use axum::http::Method;
use common::{Harness, assert_error, assert_invalid, instance_on};
use serde_json::{Value, json};

/// The IPAM fixture with a second host `h2` (4 vCPUs, 4 GiB).
async fn two_hosts() -> Harness {
    let h = Harness::new().await;
    h.with_pool_and_host().await;
    h.with_host("h2", 4, 4096).await;
    h
}

/// Instance `id` in pool p1 on `host`, recreated elsewhere on a host loss when `recreate`.
fn on(id: &str, host: &str, recreate: bool) -> Value {
    let mut v = instance_on(id, "p1", host);
    if recreate {
        v["recreate_on_host_loss"] = json!(true);
    }
    v
}

#[tokio::test]
async fn host_loss_recreates_or_loses() {
    let h = two_hosts().await;
    h.with_instance(on("a", "h1", true)).await;
    h.with_instance(on("b", "h1", false)).await;
    let (st, loss) = h.call(Method::POST, "/v1/hosts/h1/lose", None).await;
    assert_eq!(st, 200, "{loss}");
    assert_eq!(loss["host_id"], "h1");
    let (_, a) = h.get("/v1/instances/a").await;
    assert_eq!(a["host_id"], "h2");
    assert_eq!(a["state"], "running");
    let (_, b) = h.get("/v1/instances/b").await;
    assert_eq!(b["state"], "lost");
    assert_eq!(b["address"], Value::Null);
    let (_, hosts) = h.get("/v1/hosts").await;
    assert_eq!(hosts.as_array().unwrap().len(), 2);
}

#[tokio::test]
async fn status_reports_append_addresses_after_the_lease() {
    let h = two_hosts().await;
    let v = h.with_instance(on("a", "h1", true)).await;
    assert_eq!(v["addresses"], json!(["10.0.0.2/29"]));
    h.with_instance(on("b", "h2", false)).await;

    let report = json!({"instances": [
        {"instance_id": "a", "addresses": ["10.0.0.2/29", "2001:db8::5/64"]},
        {"instance_id": "b", "addresses": ["10.9.0.1/24"]},
        {"instance_id": "zz", "addresses": []}
    ]});
    let (st, out) = h.post("/v1/hosts/h1/status", report).await;
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
    let (st, out) = h.post("/v1/hosts/h1/status", report).await;
    assert_eq!(st, 200, "{out}");
    assert_eq!(out["updated"][0]["added"], json!(["192.168.7.2/24"]));
    let want = json!(["10.0.0.2/29", "2001:db8::5/64", "192.168.7.2/24"]);
    let (_, got) = h.get("/v1/instances/a").await;
    assert_eq!(got["addresses"], want);
    assert_eq!(got["address"], "10.0.0.2", "the lease is still the lease");
    let (_, list) = h.get("/v1/instances").await;
    assert_eq!(list[0]["addresses"], want);
    assert_eq!(list[1]["addresses"], json!(["10.0.0.3/29"]));

    // A malformed report: 400 naming the instance and field, nothing written.
    let got = h
        .post(
            "/v1/hosts/h1/status",
            json!({"instances": [
                {"instance_id": "a", "addresses": ["10.1.1.1/24"]},
                {"instance_id": "b", "addresses": ["10.1.1.2"]}
            ]}),
        )
        .await;
    assert_invalid(
        &got,
        "instance b: addresses[0] \"10.1.1.2\" is not an address in CIDR form such as 10.0.0.2/24",
    );
    let got = h
        .post("/v1/hosts/h1/status", json!({"instances": [], "extra": 1}))
        .await;
    assert_error(&got, 400, "INVALID_INPUT", &["status report", "extra"]);
    let (_, got) = h.get("/v1/instances/a").await;
    assert_eq!(got["addresses"], want);
    assert_error(
        &h.post("/v1/hosts/h9/status", json!({"instances": []}))
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
        .post(
            "/v1/hosts/h2/status",
            json!({"instances": [{"instance_id": "a", "addresses": ["10.8.0.1/24"]}]}),
        )
        .await;
    assert_eq!(st, 200, "{out}");
    assert_eq!(
        out["updated"][0]["addresses"],
        json!(["10.0.0.2/29", "10.8.0.1/24"])
    );
}
