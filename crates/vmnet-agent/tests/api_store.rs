//! In-process API tests of store rules, on SQLite and on PostgreSQL: overlapping pool ranges are
//! `409 CONFLICT` naming the other pool; a repeated identical instance create answers the
//! existing instance with `200` (a different one stays `409`); `PUT /v1/vms/{id}` is an upsert.
//! Every response is checked against openapi.json.

mod common;

use axum::http::Method;
use common::{Harness, assert_error, instance, range, vm};
use serde_json::json;

async fn overlapping_range_is_409_naming_the_other_pool(h: &Harness) {
    h.with_range("p1", range("10.20.0.0/24", "10.20.0.1")).await;
    let got = h
        .put_range("p2", range("10.20.0.0/16", "10.20.128.1"))
        .await;
    assert_error(
        &got,
        409,
        "CONFLICT",
        &["pool p2: cidr 10.20.0.0/16 overlaps cidr 10.20.0.0/24 of pool p1"],
    );
    let (_, pools) = h.get("/v1/pools").await;
    assert_eq!(
        pools.as_array().unwrap().len(),
        1,
        "the refused range created no pool: {pools}"
    );
    let got = h.put_range("p2", range("0.0.0.0/0", "10.20.0.1")).await;
    assert_error(&got, 400, "INVALID_INPUT", &["pool p2: cidr 0.0.0.0/0"]);
}

async fn repeated_identical_create_is_200_with_the_instance(h: &Harness) {
    h.with_range("p1", range("10.0.0.0/29", "10.0.0.1")).await;
    h.with_host("h1", 4, 4096).await;
    let body = instance("vm1", "p1");
    let first = h.with_instance(body.clone()).await;
    // The reply was lost; the client sends the same request again (POST or PUT).
    for m in [Method::POST, Method::PUT] {
        let (st, again) = h.call(m.clone(), "/v1/instances", Some(body.clone())).await;
        assert_eq!(st, 200, "{m}: {again}");
        assert_eq!(again, first, "{m}: the existing instance as it is");
    }
    // Defaults spelled out or left out are the same request.
    let (st, _) = h
        .post(
            "/v1/instances",
            json!({"instance_id": "vm1", "pool_id": "p1"}),
        )
        .await;
    assert_eq!(st, 200);
    let (_, host) = h.get("/v1/hosts/h1").await;
    assert_eq!(host["used_vcpus"], 1, "claimed once: {host}");
    let (_, leases) = h.get("/v1/pools/p1/leases").await;
    assert_eq!(leases.as_array().unwrap().len(), 1, "leased once: {leases}");
    let mut other = body.clone();
    other["memory_mib"] = json!(1024);
    assert_error(
        &h.post("/v1/instances", other).await,
        409,
        "CONFLICT",
        &["instance vm1 already exists with memory_mib 512 (this request: 1024)"],
    );
}

/// `PUT /v1/vms/{id}` is an upsert: the same body again answers the same VM and changes nothing
/// in the kernel; a different body replaces the config (no `409` for the VM's own id).
async fn repeated_vm_put_is_an_upsert(h: &Harness) {
    let vm = vm("vm-1", 7);
    let (st, first) = h.put_vm(&vm).await;
    assert_eq!(st, 200, "{first}");
    let applied = h.driver.applied(7).unwrap();
    let (st, again) = h.put_vm(&vm).await;
    assert_eq!(st, 200, "{again}");
    assert_eq!(again["config"], first["config"]);
    assert_eq!(again["status"]["state"], "applied");
    assert_eq!(
        h.driver.applied(7).unwrap(),
        applied,
        "the kernel holds the same plan"
    );
    let (_, list) = h.get("/v1/vms").await;
    assert_eq!(list.as_array().unwrap().len(), 1);
    let mut other = vm.clone();
    other["network"]["routes"] = json!([{"destination": "192.0.2.0/24", "via": "host"}]);
    let (st, replaced) = h.put_vm(&other).await;
    assert_eq!(st, 200, "{replaced}");
    assert_eq!(
        replaced["config"]["network"]["routes"],
        other["network"]["routes"]
    );
}

/// A host loss answered while 40 creates and deletes run at the same time, 5 times: every
/// request succeeds (on PostgreSQL the store's lock order keeps them from deadlocking, and a
/// transaction that still fails so is retried; no answer carries the database's message).
async fn host_loss_amid_creates_and_deletes_always_answers(h: &Harness) {
    h.with_range("p1", range("10.60.0.0/20", "10.60.0.1")).await;
    for host in ["h0", "h1"] {
        h.with_host(host, 10_000, 10_000_000).await;
    }
    let mut live: Vec<String> = Vec::new();
    for r in 0..5 {
        let lost = format!("lost{r}");
        h.with_host(&lost, 100, 100_000).await;
        for i in 0..10 {
            let body = json!({"instance_id": format!("r{r}-on-{i}"), "pool_id": "p1",
                              "host_id": lost, "recreate_on_host_loss": i % 2 == 0});
            h.with_instance(body).await;
        }
        while live.len() < 20 {
            let id = format!("r{r}-pre-{}", live.len());
            h.with_instance(json!({"instance_id": id, "pool_id": "p1"}))
                .await;
            live.push(id);
        }
        let mut calls = Vec::new();
        for id in live.drain(..) {
            calls.push((Method::DELETE, format!("/v1/instances/{id}"), None));
        }
        for i in 0..20 {
            let body = json!({"instance_id": format!("r{r}-new-{i}"), "pool_id": "p1"});
            calls.push((Method::POST, "/v1/instances".to_owned(), Some(body)));
            live.push(format!("r{r}-new-{i}"));
        }
        calls.insert(20, (Method::POST, format!("/v1/hosts/{lost}/lose"), None));
        let answers = futures::future::join_all(
            calls
                .iter()
                .map(|(m, path, body)| h.call(m.clone(), path, body.clone())),
        )
        .await;
        for ((m, path, _), (st, v)) in calls.iter().zip(&answers) {
            assert!(st.is_success(), "round {r}: {m} {path}: {st} {v}");
        }
    }
}

macro_rules! both {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(&super::Harness::new().await).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(&super::Harness::postgres().await).await;
                }
            )*
        }
    };
}

both!(
    overlapping_range_is_409_naming_the_other_pool,
    repeated_identical_create_is_200_with_the_instance,
    repeated_vm_put_is_an_upsert,
    host_loss_amid_creates_and_deletes_always_answers,
);
