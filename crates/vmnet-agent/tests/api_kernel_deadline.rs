//! One hung kernel call does not stall the API (no root; the fake driver's apply of one user id
//! hangs until released): the PUT that hangs answers UNAVAILABLE at the kernel deadline saying
//! its apply did not finish, a second change answers UNAVAILABLE naming the lock's holder, GETs
//! keep answering, `GET /v1/status` shows the holder and the timeouts, and once the call
//! returns the first change finishes in the background and the next change goes through.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::Method;
use common::{Harness, assert_error};
use serde_json::json;

fn vm(id: &str, uid: u32) -> serde_json::Value {
    json!({"id": id, "user_id": uid, "tenant": 1})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_kernel_call_answers_unavailable_and_shows_in_the_status() {
    let h = Arc::new(Harness::new().await);
    h.agent.set_kernel_deadline(Duration::from_millis(400));
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    h.driver.kernel().hold.insert(7, Arc::clone(&gate));

    // The hung apply: UNAVAILABLE at the deadline (not never).
    let first = {
        let h = Arc::clone(&h);
        tokio::spawn(async move {
            let t = Instant::now();
            (h.put_vm(&vm("hung", 7)).await, t.elapsed())
        })
    };
    // A second change while the first holds the kernel lock.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let t = Instant::now();
    let second = tokio::time::timeout(Duration::from_secs(5), h.put_vm(&vm("next", 8)))
        .await
        .expect("the second PUT answers within the deadline, not never");
    let waited = t.elapsed();
    assert_error(
        &second,
        503,
        "UNAVAILABLE",
        &[
            "PUT vm next: waited 0.4 s (the kernel deadline) for the kernel lock, held by PUT vm hung for",
            "nothing was changed",
        ],
    );
    assert!(waited < Duration::from_secs(2), "{waited:?}");
    let (got, took) = tokio::time::timeout(Duration::from_secs(5), first)
        .await
        .expect("the hung PUT answers within the deadline, not never")
        .unwrap();
    assert_error(
        &got,
        503,
        "UNAVAILABLE",
        &[
            "PUT vm hung: the kernel did not finish it within 0.4 s",
            "GET /v1/vms/hung",
        ],
    );
    assert!(took < Duration::from_secs(2), "{took:?}");

    // Reads keep answering; the status names the holder and counts both timeouts.
    let (st, status) = h.call(Method::GET, "/v1/status", None).await;
    assert!(st.is_success(), "{status}");
    let k = &status["kernel"];
    assert_eq!(k["deadline_ms"], 400, "{k}");
    assert_eq!(k["holder"], "PUT vm hung", "{k}");
    assert!(k["held_for_ms"].as_u64().unwrap() >= 400, "{k}");
    assert_eq!(k["timeouts_total"], 2, "{k}");
    assert!(
        k["last_timeout"]
            .as_str()
            .unwrap()
            .starts_with("PUT vm next: waited 0.4 s (the kernel deadline) for the kernel lock"),
        "{k}"
    );
    assert!(
        h.driver.applied(8).is_none(),
        "the refused change changed nothing"
    );

    // The call returns: the first change finishes in the background, the lock is free.
    gate.add_permits(1);
    let t = Instant::now();
    loop {
        let (st, v) = h.call(Method::GET, "/v1/vms/hung", None).await;
        if st.is_success() && v["status"]["state"] == "applied" {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(5), "{st} {v}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (st, v) = h.put_vm(&vm("next", 8)).await;
    assert!(st.is_success(), "{st} {v}");
    let (_, status) = h.call(Method::GET, "/v1/status", None).await;
    assert_eq!(status["kernel"]["holder"], serde_json::Value::Null);
}
