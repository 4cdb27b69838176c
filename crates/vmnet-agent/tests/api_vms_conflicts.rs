//! In-process API tests of the VM routes over a temporary SQLite file and a fake namespace
//! driver (no root needed): what another VM holds (user id, mesh address) is 409, and a failed
//! apply keeps the previous good config or, for a new VM, leaves nothing. Every response is
//! checked against openapi.json.

mod common;

use axum::http::Method;
use common::{Harness, assert_error, vm};
use serde_json::{Value, json};

#[tokio::test]
async fn user_id_held_by_another_vm_is_409() {
    let h = Harness::new().await;
    assert_eq!(h.put_vm(&vm("vm-1", 5)).await.0, 200);
    assert_error(
        &h.put_vm(&vm("vm-2", 5)).await,
        409,
        "CONFLICT",
        &["user_id 5", "vm-1"],
    );
    let (st, _) = h.call(Method::GET, "/v1/vms/vm-2", None).await;
    assert_eq!(st, 404);
}

#[tokio::test]
async fn mesh_address_held_by_another_vm_is_409() {
    let h = Harness::new().await;
    let mut a1 = vm("a1", 1);
    a1["mesh_ipv6"] = json!("fdaa:1::100");
    assert_eq!(h.put_vm(&a1).await.0, 200);
    let mut a3 = vm("a3", 3);
    a3["mesh_ipv6"] = json!("fdaa:1:0::100/128");
    assert_error(
        &h.put_vm(&a3).await,
        409,
        "CONFLICT",
        &["vm a3: mesh_ipv6 fdaa:1::100 is already used by vm a1"],
    );
    assert_eq!(h.call(Method::GET, "/v1/vms/a3", None).await.0, 404);
    assert!(h.driver.applied(3).is_none(), "nothing of a3 was applied");
    // An existing VM cannot take it over either, and keeps its own address.
    let mut a2 = vm("a2", 2);
    assert_eq!(h.put_vm(&a2).await.0, 200);
    a2["mesh_ipv6"] = json!("fdaa:1::100");
    assert_error(
        &h.put_vm(&a2).await,
        409,
        "CONFLICT",
        &["vm a2: mesh_ipv6 fdaa:1::100 is already used by vm a1"],
    );
    let (_, v) = h.call(Method::GET, "/v1/vms/a2", None).await;
    assert_eq!(v["status"]["mesh_ipv6"], "fdaa:1::2");
    // Re-putting a1 with its own address is fine; once a1 moves away, the address is free.
    assert_eq!(h.put_vm(&a1).await.0, 200);
    a1["mesh_ipv6"] = json!("fdaa:1::101");
    assert_eq!(h.put_vm(&a1).await.0, 200);
    let (st, v) = h.put_vm(&a2).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["status"]["mesh_ipv6"], "fdaa:1::100");
    // A deleted VM frees its address.
    assert_eq!(h.call(Method::DELETE, "/v1/vms/a2", None).await.0, 200);
    let (st, v) = h.put_vm(&a3).await;
    assert_eq!(st, 200, "{v}");
}

#[tokio::test]
async fn a_failed_apply_keeps_the_previous_good_config() {
    let h = Harness::new().await;
    let good = vm("vm-1", 4);
    assert_eq!(h.put_vm(&good).await.0, 200);
    let good_plan = h.driver.applied(4).unwrap();

    let mut changed = good.clone();
    changed["network"]["routes"] = json!([{"destination": "::/0", "via": "host"}]);
    h.driver.fail_changes(4, true);
    let got = h.put_vm(&changed).await;
    assert_error(
        &got,
        503,
        "UNAVAILABLE",
        &[
            "vm vm-1: apply failed",
            "injected failure",
            "previous config stays applied",
        ],
    );
    // The previous plan is what the kernel holds, and it was re-applied after the failure.
    assert_eq!(h.driver.applied(4).unwrap(), good_plan);
    let (_, v) = h.call(Method::GET, "/v1/vms/vm-1", None).await;
    assert_eq!(
        v["config"], good,
        "the store keeps the last good config as desired"
    );
    assert_eq!(v["status"]["state"], "failed");
    assert!(
        v["status"]["last_error"]
            .as_str()
            .unwrap()
            .contains("injected failure")
    );
    assert_eq!(v["status"]["applied_routes"], good["network"]["routes"]);

    // A reconcile pass keeps the good config (it is the desired one) and clears the error.
    h.agent.reconcile().await.unwrap();
    let (_, v) = h.call(Method::GET, "/v1/vms/vm-1", None).await;
    assert_eq!(v["status"]["state"], "applied");
    assert_eq!(v["status"]["last_error"], Value::Null);

    // Once the kernel works again the change goes through.
    h.driver.fail_changes(4, false);
    let (st, v) = h.put_vm(&changed).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["status"]["applied_routes"], changed["network"]["routes"]);
}

#[tokio::test]
async fn a_failed_apply_of_a_new_vm_leaves_nothing() {
    let h = Harness::new().await;
    h.driver.fail(9, true);
    let got = h.put_vm(&vm("vm-9", 9)).await;
    assert_error(
        &got,
        503,
        "UNAVAILABLE",
        &["vm vm-9: apply failed", "nothing of the VM was kept"],
    );
    assert!(h.driver.applied(9).is_none());
    assert_eq!(h.driver.kernel().removes, [9]);
    assert_eq!(h.call(Method::GET, "/v1/vms/vm-9", None).await.0, 404);
}

#[tokio::test]
async fn changing_the_user_id_removes_the_old_objects() {
    let h = Harness::new().await;
    h.put_vm(&vm("vm-1", 1)).await;
    let (st, v) = h.put_vm(&vm("vm-1", 2)).await;
    assert_eq!(st, 200);
    assert_eq!(v["status"]["netns"], "tstn0002");
    assert!(h.driver.applied(1).is_none());
    assert!(h.driver.applied(2).is_some());
}
