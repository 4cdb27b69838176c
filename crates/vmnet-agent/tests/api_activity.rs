//! In-process API tests of the packet-activity routes over a temporary SQLite file and a fake
//! namespace driver: validation and the answer without the program (no root), and the reports
//! with the real program loaded over a test-unique bpffs root (root), and the scrape's idle
//! series. Every response is checked against openapi.json.

mod common;

use std::sync::Arc;

use axum::http::Method;
use common::{Harness, assert_error, vm};
use vmnet_kernel::activity::ActivityRecorder;

/// The ids of an activity list's VMs, in order.
fn ids(list: &serde_json::Value) -> Vec<&str> {
    list["vms"]
        .as_array()
        .expect("vms")
        .iter()
        .map(|v| v["id"].as_str().expect("id"))
        .collect()
}

#[tokio::test]
async fn idle_secs_is_validated_naming_the_field() {
    let h = Harness::new().await;
    for q in [
        "idle_secs=-1",
        "idle_secs=abc",
        "idle_secs=1.5",
        "idle_secs=",
    ] {
        assert_error(
            &h.call(Method::GET, &format!("/v1/activity?{q}"), None)
                .await,
            400,
            "INVALID_INPUT",
            &["idle_secs"],
        );
    }
    assert_error(
        &h.call(Method::GET, "/v1/activity?idle=3", None).await,
        400,
        "INVALID_INPUT",
        &["\"idle\"", "unknown"],
    );
}

#[tokio::test]
async fn without_the_program_the_reports_are_unavailable() {
    let h = Harness::new().await;
    h.put_vm(&vm("vm-1", 7)).await;
    for path in ["/v1/activity", "/v1/vms/vm-1/activity"] {
        assert_error(
            &h.call(Method::GET, path, None).await,
            503,
            "UNAVAILABLE",
            &["--activity-root"],
        );
    }
}

/// Unpins, unmounts and removes a test bpffs root on drop.
struct Root(std::path::PathBuf);

impl Drop for Root {
    fn drop(&mut self) {
        let _ = vmnet_kernel::activity::remove_root(&self.0);
    }
}

#[tokio::test]
#[ignore = "needs root: loads the activity BPF program (scripts/test.sh runs it)"]
async fn reports_give_the_baseline_and_filter_by_idle_time() {
    vmnet_testkit::require_root();
    let h = Harness::new().await;
    let root = Root(h.dir.join("bpf"));
    let rec = Arc::new(ActivityRecorder::open(&root.0).expect("load"));
    h.agent.set_activity(rec).expect("set");
    h.put_vm(&vm("vm-2", 8)).await;
    h.put_vm(&vm("vm-1", 7)).await;
    assert_error(
        &h.call(Method::GET, "/v1/vms/nope/activity", None).await,
        404,
        "NOT_FOUND",
        &["vm nope"],
    );

    let (st, one) = h.call(Method::GET, "/v1/vms/vm-1/activity", None).await;
    assert_eq!(st, 200, "{one}");
    assert_eq!(one["id"], "vm-1");
    assert_eq!(one["user_id"], 7);
    assert_eq!(
        one["last_activity"],
        serde_json::Value::Null,
        "no packet yet"
    );
    let baseline = one["baseline"].as_str().expect("baseline");
    assert!(
        baseline.ends_with('Z') && baseline.len() == 24,
        "RFC 3339: {baseline}"
    );
    assert!(
        one["idle_secs"].as_u64().expect("idle") < 60,
        "never longer than the agent ran"
    );

    let (st, all) = h.call(Method::GET, "/v1/activity", None).await;
    assert_eq!(st, 200, "{all}");
    assert_eq!(ids(&all), ["vm-1", "vm-2"]);
    // The list's baseline is the agent's start; a VM this agent created has its creation.
    assert!(
        all["baseline_unix_ms"].as_i64() <= one["baseline_unix_ms"].as_i64(),
        "{all} against {one}"
    );
    let (_, idle0) = h.call(Method::GET, "/v1/activity?idle_secs=0", None).await;
    assert_eq!(idle0["vms"].as_array().expect("vms").len(), 2);
    let (_, idle_long) = h
        .call(Method::GET, "/v1/activity?idle_secs=86400", None)
        .await;
    assert_eq!(idle_long["idle_secs"], 86400);
    assert!(
        idle_long["vms"].as_array().expect("vms").is_empty(),
        "no VM is idle for longer than the agent has run: {idle_long}"
    );

    // A VM created well after the agent started is not idle for that long at once: its
    // baseline is its creation.
    tokio::time::sleep(std::time::Duration::from_millis(2100)).await;
    h.put_vm(&vm("vm-3", 9)).await;
    let (_, three) = h.call(Method::GET, "/v1/vms/vm-3/activity", None).await;
    assert_eq!(three["idle_secs"], 0, "{three}");
    assert!(
        three["baseline_unix_ms"].as_i64() > one["baseline_unix_ms"].as_i64(),
        "{three} against {one}"
    );
    let (_, idle2) = h.call(Method::GET, "/v1/activity?idle_secs=2", None).await;
    assert_eq!(
        ids(&idle2),
        ["vm-1", "vm-2"],
        "the new VM is not idle yet: {idle2}"
    );
    assert_eq!(
        idle2["baseline"], all["baseline"],
        "the list's baseline is the agent's start"
    );

    // A scrape reads the same times, one series per stored VM.
    let text = h.agent.metrics_text().await;
    let idle = |vm: &str| -> u64 {
        let series = format!("vmnet_vm_idle_seconds{{vm=\"{vm}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(series.as_str())?.parse().ok())
            .unwrap_or_else(|| panic!("no idle series of {vm}:\n{text}"))
    };
    assert!(idle("vm-1") >= 2 && idle("vm-2") >= 2, "{text}");
    assert!(idle("vm-3") < 2, "{text}");
    assert_eq!(text.matches("vmnet_vm_idle_seconds{").count(), 3, "{text}");
    assert!(
        text.contains("vmnet_activity_idle_vms{idle_for_seconds=\"60\"} 0\n"),
        "{text}"
    );
}
