//! In-process tests of the reconcile loop over a temporary SQLite file and the fake driver: a
//! restart converges from the store and collects orphans, periodic failures are recorded and
//! retried, passes are serialized, change passes apply only what is not known good, and a stored
//! VM that no longer plans never gets its objects collected; a pass yields to a burst of API
//! changes.

mod common;

use axum::http::Method;
use common::{FakeDriver, Harness, settings, vm};
use serde_json::{Value, json};

#[tokio::test]
async fn restart_converges_from_the_store_and_collects_orphans() {
    let tmp = tempfile::tempdir().unwrap();
    {
        let h = Harness::open(tmp.path(), FakeDriver::default(), settings()).await;
        h.put_vm(&vm("vm-1", 1)).await;
        h.put_vm(&vm("vm-2", 2)).await;
        h.agent.db().close().await;
    }
    // A new agent over the same file, with a kernel that lost VM 2 and holds an orphan (uid 99).
    let kernel = FakeDriver::default();
    let h = Harness::open(tmp.path(), kernel.clone(), settings()).await;
    {
        let orphan = vmnet_plan::ns::plan_vm(
            &vmnet_model::vm::parse_vm_config(vm("gone", 99).to_string().as_bytes()).unwrap(),
            &settings(),
        )
        .unwrap();
        kernel.kernel().vms.insert(99, orphan);
    }
    let out = h.agent.reconcile().await.unwrap();
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    assert_eq!(out.applied, 2);
    assert_eq!(out.collected, [99]);
    {
        let k = kernel.kernel();
        assert_eq!(k.observes, 1, "the pass observes the kernel");
        let applied: Vec<u32> = k.applies.iter().map(|(u, _)| *u).collect();
        assert_eq!(applied, [1, 2]);
        assert_eq!(k.gcs, [vec![1, 2]], "gc gets exactly the desired set");
        assert_eq!(k.vms.keys().copied().collect::<Vec<_>>(), [1, 2]);
    }
    let (_, st) = h.call(Method::GET, "/v1/status", None).await;
    assert_eq!(st["vms"], json!({"desired": 2, "applied": 2, "failed": 0}));
    assert_eq!(st["reconcile"]["passes"], 1);
    assert_eq!(st["reconcile"]["last_ok"], true);
    assert_eq!(st["reconcile"]["orphans_removed_total"], 1);
    // Both VMs were applied before the restart and the kernel lost them: that is drift.
    assert_eq!(st["reconcile"]["drift_repairs_total"], 2);
    assert_eq!(out.repaired.len(), 2, "{:?}", out.repaired);
    // A second pass finds nothing to repair.
    let again = h.agent.reconcile().await.unwrap();
    assert!(again.repaired.is_empty(), "{:?}", again.repaired);
    assert_eq!(st["name_prefix"], "tst");
}

#[tokio::test]
async fn a_periodic_failure_is_recorded_and_retried() {
    let h = Harness::new().await;
    h.put_vm(&vm("vm-1", 1)).await;
    h.driver.fail(1, true);
    let out = h.agent.reconcile().await.unwrap();
    assert_eq!(out.errors.len(), 1);
    assert!(out.errors[0].contains("vm vm-1"));
    let (_, st) = h.call(Method::GET, "/v1/status", None).await;
    assert_eq!(st["reconcile"]["last_ok"], false);
    assert_eq!(st["vms"]["failed"], 1);
    h.driver.fail(1, false);
    let out = h.agent.reconcile().await.unwrap();
    assert!(out.errors.is_empty());
    let (_, st) = h.call(Method::GET, "/v1/status", None).await;
    assert_eq!(st["vms"], json!({"desired": 1, "applied": 1, "failed": 0}));
}

#[tokio::test]
async fn reconcile_passes_are_serialized() {
    let h = Harness::new().await;
    for i in 0..5 {
        h.put_vm(&vm(&format!("vm-{i}"), i)).await;
    }
    let a = std::sync::Arc::clone(&h.agent);
    let b = std::sync::Arc::clone(&h.agent);
    let (x, y) = tokio::join!(a.reconcile(), b.reconcile());
    assert!(x.unwrap().errors.is_empty() && y.unwrap().errors.is_empty());
    // Two full passes, each an observe + 5 applies + a gc, never interleaved.
    let k = h.driver.kernel();
    assert_eq!(k.gcs.len(), 2);
    let tail: Vec<u32> = k.applies.iter().rev().take(10).map(|(u, _)| *u).collect();
    assert_eq!(tail, [4, 3, 2, 1, 0, 4, 3, 2, 1, 0]);
}

#[tokio::test]
async fn a_change_pass_applies_only_what_is_not_known_good() {
    let h = Harness::new().await;
    for i in 1..=3 {
        h.put_vm(&vm(&format!("vm-{i}"), i)).await;
    }
    let before = h.driver.kernel().applies.len();
    // VM 2 vanished from the kernel (e.g. its netns was deleted by hand).
    h.driver.kernel().vms.remove(&2);
    let out = h.agent.reconcile_changes().await.unwrap();
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    assert_eq!(out.applied, 3);
    {
        let k = h.driver.kernel();
        let applied: Vec<u32> = k.applies[before..].iter().map(|(u, _)| *u).collect();
        assert_eq!(applied, [2], "only the missing VM is applied");
        assert_eq!(k.gcs.last().unwrap(), &vec![1, 2, 3]);
        assert!(k.vms.contains_key(&2));
    }
    // A full pass applies (audits) every VM.
    h.agent.reconcile().await.unwrap();
    assert_eq!(h.driver.kernel().applies.len(), before + 1 + 3);
}

#[tokio::test]
async fn a_stored_vm_that_no_longer_plans_is_shown_failed() {
    let tmp = tempfile::tempdir().unwrap();
    {
        let h = Harness::open(tmp.path(), FakeDriver::default(), settings()).await;
        h.put_vm(&vm("big", 500)).await;
        h.put_vm(&vm("small", 5)).await;
        h.agent.db().close().await;
    }
    // Restarted with a transit range that only supports user ids up to 63.
    let s = vmnet_plan::ns::NsSettings {
        transit_ipv4: "10.9.0.0/24".parse().unwrap(),
        ..settings()
    };
    let h = Harness::open(tmp.path(), FakeDriver::default(), s).await;
    let (st, list) = h.call(Method::GET, "/v1/vms", None).await;
    assert_eq!(st, 200, "{list}");
    let big = &list[0];
    assert_eq!(big["status"]["state"], "failed");
    assert_eq!(big["status"]["netns"], "tstn01f4");
    assert_eq!(big["status"]["transit"], Value::Null);
    assert!(
        big["status"]["last_error"]
            .as_str()
            .unwrap()
            .contains("user_id 500"),
        "{big}"
    );
    let out = h.agent.reconcile().await.unwrap();
    assert_eq!(out.applied, 1, "the other VM is still applied");
    assert!(
        out.errors.iter().any(|e| e.contains("user_id 500")),
        "{:?}",
        out.errors
    );
    assert!(
        out.errors
            .iter()
            .any(|e| e.contains("garbage collection skipped")),
        "{:?}",
        out.errors
    );
    assert!(
        h.driver.kernel().gcs.is_empty(),
        "nothing is collected while a stored VM does not plan"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_yields_to_a_burst_of_api_changes() {
    let h = Harness::new().await;
    for i in 1..=20 {
        h.put_vm(&vm(&format!("vm-{i}"), i)).await;
    }
    let before = h.driver.kernel().applies.len();
    let burst_until = std::time::Instant::now() + std::time::Duration::from_millis(400);
    // PUTs one right after the other (VM 100, unchanged after the first) for 400 ms, and a full
    // pass started at the same time.
    let burst = async {
        let mut puts = 0;
        while std::time::Instant::now() < burst_until {
            assert_eq!(h.put_vm(&vm("vm-100", 100)).await.0, 200);
            puts += 1;
        }
        let k = h.driver.kernel();
        let by_pass = k.applies[before..]
            .iter()
            .filter(|(u, _)| *u != 100)
            .count();
        (puts, by_pass)
    };
    let (pass, (puts, by_pass)) = tokio::join!(h.agent.reconcile(), burst);
    let pass = pass.unwrap();
    assert!(pass.errors.is_empty(), "{:?}", pass.errors);
    // Without yielding, the pass would interleave one VM per PUT and finish within the burst.
    // At most one step per API_YIELD_MAX (100 ms) while the API is busy.
    assert!(puts > 20, "a real burst: {puts} PUTs");
    assert!(
        by_pass <= 6,
        "the pass applied {by_pass} of 20 VMs during a burst of {puts} PUTs"
    );
    assert!(
        pass.applied >= 20,
        "the pass still applies every VM: {pass:?}"
    );
}
