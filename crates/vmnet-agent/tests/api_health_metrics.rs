//! `GET /healthz`, `GET /readyz` and `GET /metrics` in process (no root; the fake driver): not
//! ready before the first full pass and ready after it; a reconcile pass stuck in a kernel call
//! (the fake driver's apply held) makes `/healthz` answer 503 naming the reconcile loop once
//! the loop deadline passes, and 200 again when the call returns; the scrape counts the VMs by
//! state, the changes by kind and the passes, and passes `promtool check metrics`.

mod common;

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use common::{Harness, assert_error};
use http_body_util::BodyExt;
use serde_json::json;
use tower::ServiceExt;

fn vm(id: &str, uid: u32) -> serde_json::Value {
    json!({"id": id, "user_id": uid, "tenant": 1})
}

/// `GET /metrics` through `router`: the status, the content type and the text.
async fn scrape(router: &axum::Router) -> (StatusCode, String, String) {
    let req = Request::builder()
        .uri("/metrics")
        .body(Body::empty())
        .unwrap();
    let resp = router.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let ct = resp.headers()["content-type"].to_str().unwrap().to_owned();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, ct, String::from_utf8(body.to_vec()).unwrap())
}

/// The value of the sample `line` starts with (name and labels, exactly).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// Runs `promtool check metrics` on `text`: it must pass without a lint finding.
fn promtool(text: &str) {
    use std::io::Write as _;
    let mut child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool (Debian's prometheus package, scripts/install-deps.sh)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success() && out.stdout.is_empty() && out.stderr.is_empty(),
        "promtool check metrics: {}{}\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_after_the_first_pass_and_the_scrape_counts_what_happened() {
    let h = Harness::new().await;
    let (s, v) = h.get("/healthz").await;
    assert_eq!((s, v), (StatusCode::OK, json!({"status": "ok"})));
    let not_ready = h.get("/readyz").await;
    assert_error(
        &not_ready,
        503,
        "UNAVAILABLE",
        &["not ready: the first reconcile pass since the agent started has not finished"],
    );
    assert_eq!(h.put_vm(&vm("a1", 1)).await.0, StatusCode::OK);
    assert_eq!(h.put_vm(&vm("a1", 1)).await.0, StatusCode::OK);
    assert_eq!(h.put_vm(&vm("a2", 2)).await.0, StatusCode::OK);
    h.driver.fail(3, true);
    assert_eq!(
        h.put_vm(&vm("bad", 3)).await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(h.delete("/v1/vms/a2").await.0, StatusCode::OK);
    h.agent.reconcile().await.unwrap();
    assert_eq!(
        h.get("/readyz").await,
        (StatusCode::OK, json!({"status": "ok"}))
    );

    let (status, ct, text) = scrape(&h.router).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(ct, "text/plain; version=0.0.4; charset=utf-8");
    assert_eq!(
        sample(&text, r#"vmnet_vms{state="applied"}"#),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, r#"vmnet_vms{state="failed"}"#),
        Some(0.0),
        "{text}"
    );
    let count = |kind: &str| {
        sample(
            &text,
            &format!(r#"vmnet_vm_apply_duration_seconds_count{{kind="{kind}"}}"#),
        )
    };
    assert_eq!(count("create"), Some(2.0), "{text}");
    assert_eq!(count("change"), Some(1.0), "{text}");
    assert_eq!(count("delete"), Some(1.0), "{text}");
    assert_eq!(sample(&text, "vmnet_reconcile_passes_total"), Some(1.0));
    assert_eq!(
        sample(
            &text,
            r#"vmnet_reconcile_pass_duration_seconds_count{pass="full"}"#
        ),
        Some(1.0)
    );
    assert_eq!(sample(&text, "vmnet_store_errors_total"), Some(0.0));
    promtool(&text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconcile_loop_stuck_in_a_kernel_call_is_not_alive_until_it_returns() {
    let h = Arc::new(Harness::new().await);
    assert_eq!(h.put_vm(&vm("a1", 1)).await.0, StatusCode::OK);
    h.agent.set_loop_deadline(Duration::from_millis(500));
    // The loop's first pass hangs in the kernel call that applies VM a1.
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    h.driver.kernel().hold.insert(1, Arc::clone(&gate));
    let task = tokio::spawn(Arc::clone(&h.agent).run_loop());
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        h.get("/healthz").await.0,
        StatusCode::OK,
        "within the deadline"
    );
    tokio::time::sleep(Duration::from_millis(700)).await;
    let stalled = h.get("/healthz").await;
    assert_error(
        &stalled,
        503,
        "UNAVAILABLE",
        &[
            "not alive: reconcile loop: no progress for",
            "(deadline 0.5 s)",
        ],
    );
    assert_error(
        &h.get("/readyz").await,
        503,
        "UNAVAILABLE",
        &["not alive: reconcile loop"],
    );
    // The call returns: the pass finishes, the loop is alive and the agent ready.
    gate.add_permits(1);
    h.driver.kernel().hold.clear();
    tokio::time::timeout(Duration::from_secs(5), async {
        while h.get("/readyz").await.0 != StatusCode::OK {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("ready once the kernel call returned");
    assert_eq!(h.get("/healthz").await.0, StatusCode::OK);
    // Idle between passes, the loop still beats: alive long past the deadline.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        h.get("/healthz").await.0,
        StatusCode::OK,
        "an idle loop is alive"
    );
    h.agent.stop_loop(task).await;
}

#[tokio::test]
async fn the_metrics_router_serves_the_three_routes_only() {
    let h = Harness::new().await;
    let ops = vmnet_agent::api::ops::ops_router(Arc::clone(&h.agent));
    let (status, _, text) = scrape(&ops).await;
    assert_eq!(status, StatusCode::OK);
    assert!(text.contains("vmnet_build_info"), "{text}");
    for (method, path, want) in [
        (Method::GET, "/healthz", StatusCode::OK),
        (Method::GET, "/readyz", StatusCode::SERVICE_UNAVAILABLE),
        (Method::GET, "/v1/vms", StatusCode::NOT_FOUND),
        (Method::GET, "/v1/status", StatusCode::NOT_FOUND),
        (Method::PUT, "/v1/vms/a1", StatusCode::NOT_FOUND),
        (Method::POST, "/metrics", StatusCode::METHOD_NOT_ALLOWED),
    ] {
        let req = Request::builder()
            .method(method.clone())
            .uri(path)
            .body(Body::empty())
            .unwrap();
        let resp = ops.clone().oneshot(req).await.unwrap();
        assert_eq!(resp.status(), want, "{method} {path}");
    }
}
