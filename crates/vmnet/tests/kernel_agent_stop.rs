//! The agent's stop on SIGTERM (root required: the agent runs in a sandbox host namespace): it
//! exits 0, "vmnet agent stopped" is the last line of its log, and by then everything of it has
//! stopped: its SQLite store is closed (the write-ahead log checkpointed and removed, which an
//! exit with the store still open leaves behind), and the process exits right after the line.

mod agent_support;

use std::time::{Duration, SystemTime};

use agent_support::{options, start, vm};
use vmnet_agent::api::types::VmView;
use vmnet_testkit::{Sandbox, require_root};

/// The time of a log line (`2026-12-06T20:27:58.068916Z  INFO …`), as seconds since the epoch.
fn logged_at(line: &str) -> Option<f64> {
    let ts = line.split_whitespace().next()?;
    let t = humantime::parse_rfc3339(ts).ok()?;
    Some(t.duration_since(SystemTime::UNIX_EPOCH).ok()?.as_secs_f64())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn sigterm_logs_stopped_once_the_store_is_closed_and_then_exits() {
    require_root();
    let sb = Sandbox::new("as").expect("sandbox");
    let tmp = tempfile::tempdir().unwrap();
    let mut agent = start(&options(&sb, tmp.path(), 60)).await;
    // Writes, so the store has a write-ahead log to close.
    for uid in 1..=3 {
        let _: VmView = agent
            .client()
            .put(&format!("/v1/vms/s{uid}"), &vm("s", uid))
            .await
            .expect("put");
    }
    let wal = tmp.path().join("vmnet.db-wal");
    assert!(wal.exists(), "the store runs in WAL mode");
    let status = tokio::task::spawn_blocking(move || {
        let s = agent.sigterm().expect("SIGTERM");
        (s, agent)
    })
    .await
    .unwrap();
    let (status, agent) = status;
    let exited = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let log = agent.log_text();
    assert!(status.success(), "{status:?}\n{log}");
    let last = log.lines().last().unwrap_or_default();
    assert!(
        last.ends_with("vmnet agent stopped"),
        "last line: {last}\n{log}"
    );
    assert!(
        std::fs::metadata(&wal).map_or(true, |m| m.len() == 0),
        "the store was still open when the agent said it stopped: {} bytes of WAL left\n{log}",
        std::fs::metadata(&wal).map(|m| m.len()).unwrap_or(0)
    );
    let after = exited - logged_at(last).expect("a timestamp");
    assert!(
        after < Duration::from_secs(1).as_secs_f64(),
        "the process exited {after:.3} s after logging that it stopped"
    );
}
