//! The systemd notifications with a fake service manager (no root; the fake driver): a unix
//! datagram socket this test binds in a temporary directory as `NOTIFY_SOCKET`, with a
//! 400 ms watchdog (`WATCHDOG_USEC`, `WATCHDOG_PID` this process). `READY=1` comes only after
//! the first reconcile pass has finished (it is held in a kernel call until the test releases
//! it); `WATCHDOG=1` comes while the loops progress, stops while the reconcile loop is stuck
//! in a kernel call past its deadline (with a `STATUS=` naming it), and comes again once it
//! returns; `STOPPING=1` when the agent stops.
//!
//! One test in this binary: it sets the environment before any thread of its own starts.

mod common;

use std::os::unix::net::UnixDatagram;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::Harness;
use serde_json::json;

/// The datagrams received within `for_`, each as text.
fn receive(sock: &UnixDatagram, for_: Duration) -> Vec<String> {
    let end = Instant::now() + for_;
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    while let Some(left) = end.checked_duration_since(Instant::now()) {
        sock.set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .unwrap();
        match sock.recv(&mut buf) {
            Ok(n) => out.push(String::from_utf8_lossy(&buf[..n]).into_owned()),
            Err(_) => break,
        }
    }
    out
}

fn has(msgs: &[String], line: &str) -> bool {
    msgs.iter().any(|m| m.lines().any(|l| l == line))
}

#[test]
fn ready_after_the_first_pass_and_the_watchdog_only_while_the_loops_progress() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notify.sock");
    let sock = UnixDatagram::bind(&path).unwrap();
    // SAFETY: set before this test starts any thread (the runtime is built below), and this
    // binary runs no other test that could read the environment at the same time.
    unsafe {
        std::env::set_var("NOTIFY_SOCKET", &path);
        std::env::set_var("WATCHDOG_USEC", "400000");
        std::env::set_var("WATCHDOG_PID", std::process::id().to_string());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let h = Arc::new(Harness::new().await);
        let (s, _) = h
            .put_vm(&json!({"id": "a1", "user_id": 1, "tenant": 1}))
            .await;
        assert_eq!(s.as_u16(), 200);
        h.agent.set_loop_deadline(Duration::from_millis(800));
        // The first pass hangs applying a1 until released.
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        h.driver.kernel().hold.insert(1, Arc::clone(&gate));
        let looped = tokio::spawn(Arc::clone(&h.agent).run_loop());
        let notifier = tokio::spawn(vmnet_agent::notify::run(Arc::clone(&h.agent)));

        let wait = |d| {
            let s = sock.try_clone().unwrap();
            tokio::task::spawn_blocking(move || receive(&s, d))
        };
        // Converging, within the deadline: pings, no READY.
        let first = wait(Duration::from_millis(600)).await.unwrap();
        assert!(has(&first, "WATCHDOG=1"), "{first:?}");
        assert!(
            !has(&first, "READY=1"),
            "READY before the first pass finished: {first:?}"
        );
        assert!(
            first.iter().any(|m| m.contains("STATUS=converging")),
            "{first:?}"
        );
        // Stuck past the deadline: the pings stop, the status names the loop. (What was sent
        // before the deadline passed is read and dropped first.)
        tokio::time::sleep(Duration::from_millis(500)).await;
        let _ = wait(Duration::from_millis(1)).await.unwrap();
        let stuck = wait(Duration::from_millis(800)).await.unwrap();
        assert!(
            !has(&stuck, "WATCHDOG=1"),
            "pinged while stalled: {stuck:?}"
        );
        assert!(!has(&stuck, "READY=1"), "{stuck:?}");
        assert!(
            stuck
                .iter()
                .any(|m| m.contains("STATUS=not alive: reconcile loop: no progress")),
            "{stuck:?}"
        );
        // The kernel call returns: the pass finishes, READY=1 once, pings again.
        gate.add_permits(1);
        h.driver.kernel().hold.clear();
        let after = wait(Duration::from_millis(1200)).await.unwrap();
        assert!(has(&after, "READY=1"), "{after:?}");
        assert!(has(&after, "WATCHDOG=1"), "{after:?}");
        assert!(
            after
                .iter()
                .any(|m| m.contains("STATUS=1 VMs: 1 applied, 0 failed")),
            "{after:?}"
        );
        let later = wait(Duration::from_millis(600)).await.unwrap();
        assert!(!has(&later, "READY=1"), "READY=1 is sent once: {later:?}");
        assert!(has(&later, "WATCHDOG=1"), "{later:?}");

        notifier.abort();
        h.agent.stop_loop(looped).await;
        vmnet_agent::notify::stopping();
        let stopping = wait(Duration::from_millis(300)).await.unwrap();
        assert!(has(&stopping, "STOPPING=1"), "{stopping:?}");
    });
}
