//! `GET /v1/events` in process (no root): what VM changes publish, the filters and their
//! refusals, every line valid against `openapi.json`, and over a real unix socket a follower
//! that stops reading, which never delays a PUT and is cut.

mod common;

use std::io::Read as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::{Harness, assert_error, openapi, schema, vm};
use http_body_util::BodyExt;
use serde_json::Value;
use tower::ServiceExt;
use vmnet_agent::api::types::VmView;
use vmnet_agent::client::Client;
use vmnet_agent::events::{EventBody, KINDS, Subject};
use vmnet_agent::server;

/// `GET path` answered 200 with NDJSON; every line checked against `EventLine`.
async fn lines(h: &Harness, path: &str) -> Vec<Value> {
    let req = Request::builder().uri(path).body(Body::empty()).unwrap();
    let resp = h.router.clone().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK, "{path}");
    assert_eq!(
        resp.headers()["content-type"],
        "application/x-ndjson",
        "{path}"
    );
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let doc = openapi();
    let line_schema = serde_json::json!({"$ref": "#/components/schemas/EventLine"});
    String::from_utf8(bytes.to_vec())
        .unwrap()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            let errs = schema::validate(&doc, &line_schema, &v);
            assert!(errs.is_empty(), "{path}: {l}: {errs:#?}");
            v
        })
        .collect()
}

fn kinds(events: &[Value]) -> Vec<(&str, &str)> {
    events
        .iter()
        .map(|e| (e["kind"].as_str().unwrap(), e["vm"].as_str().unwrap_or("-")))
        .collect()
}

#[tokio::test]
async fn vm_changes_publish_applied_changed_failed_and_deleted() {
    let h = Harness::new().await;
    assert!(lines(&h, "/v1/events").await.is_empty());
    assert_eq!(h.put_vm(&vm("a", 1)).await.0, StatusCode::OK);
    // The same config again changes nothing and publishes nothing.
    assert_eq!(h.put_vm(&vm("a", 1)).await.0, StatusCode::OK);
    let mut changed = vm("a", 1);
    changed["network"]["routes"] = serde_json::json!([]);
    assert_eq!(h.put_vm(&changed).await.0, StatusCode::OK);
    h.driver.fail(2, true);
    assert_eq!(
        h.put_vm(&vm("b", 2)).await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(h.delete("/v1/vms/a").await.0, StatusCode::OK);

    let all = lines(&h, "/v1/events").await;
    assert_eq!(
        kinds(&all),
        [
            ("vm_applied", "a"),
            ("vm_applied", "a"),
            ("vm_failed", "b"),
            ("vm_deleted", "a"),
        ]
    );
    assert_eq!(all[0]["change"], "created");
    assert_eq!(all[0]["trigger"], "api");
    assert_eq!(all[0]["user_id"], 1);
    assert_eq!(all[1]["change"], "changed");
    assert_eq!(all[2]["code"], "UNAVAILABLE");
    assert!(
        all[2]["message"].as_str().unwrap().contains("vm b"),
        "{}",
        all[2]
    );
    let seqs: Vec<u64> = all.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, [1, 2, 3, 4]);
    // RFC 3339 in UTC.
    let t = all[0]["time"].as_str().unwrap();
    assert!(
        humantime::parse_rfc3339(t).is_ok() && t.ends_with('Z'),
        "{t}"
    );

    // Filters: by VM (repeated or a comma list), by kind, and since.
    assert_eq!(lines(&h, "/v1/events?vm=b").await.len(), 1);
    assert_eq!(lines(&h, "/v1/events?vm=a&vm=b").await.len(), 4);
    assert_eq!(
        lines(&h, "/v1/events?vm=a,b&kind=vm_deleted").await.len(),
        1
    );
    assert_eq!(
        kinds(&lines(&h, "/v1/events?kind=vm_failed,vm_deleted&since=3").await),
        [("vm_deleted", "a")]
    );
    assert!(lines(&h, "/v1/events?vm=zz").await.is_empty());
    assert_eq!(lines(&h, "/v1/events?follow=false").await.len(), 4);
}

#[tokio::test]
async fn a_pass_repairing_drift_publishes_what_and_where() {
    let h = Harness::new().await;
    assert_eq!(h.put_vm(&vm("a", 1)).await.0, StatusCode::OK);
    // The fake kernel loses the VM: the next pass makes it again, which is drift of an
    // applied VM.
    h.driver.kernel().vms.clear();
    h.agent.reconcile().await.unwrap();
    let drift = lines(&h, "/v1/events?kind=drift_repaired").await;
    assert!(!drift.is_empty(), "no drift event");
    let d = &drift[0];
    assert_eq!(
        (d["vm"].as_str(), d["trigger"].as_str()),
        (Some("a"), Some("pass"))
    );
    assert_eq!(d["objects"], serde_json::json!(["netns"]), "{d}");
    assert!(d["detail"].is_string(), "{d}");
}

#[tokio::test]
async fn bad_filters_are_refused_naming_the_parameter() {
    let h = Harness::new().await;
    for (q, needle) in [
        (
            "kind=vm_exploded",
            "query parameter kind: \"vm_exploded\" is not an event kind",
        ),
        ("vm=..", "query parameter vm"),
        ("follow=1", "query parameter follow"),
        ("since=x", "query parameter since"),
        ("run=abc", "query parameter run: \"abc\" is not a run id"),
        ("tenant=1", "query parameter \"tenant\" is unknown"),
    ] {
        let got = h.get(&format!("/v1/events?{q}")).await;
        assert_error(&got, 400, "INVALID_INPUT", &[needle]);
    }
}

/// A position from an earlier run of the agent (another bus: every start is a new run) is
/// refused with `CONFLICT` naming this run (the harness checks the answer against
/// openapi.json), whether the client gives the old run or only a sequence number this run has
/// not reached; the current run's position resumes.
#[tokio::test]
async fn a_position_from_an_earlier_run_is_refused_with_conflict() {
    let h = Harness::new().await;
    assert_eq!(h.put_vm(&vm("a", 1)).await.0, StatusCode::OK);
    assert_eq!(h.delete("/v1/vms/a").await.0, StatusCode::OK);
    let all = lines(&h, "/v1/events").await;
    let run = all[0]["run"].as_str().unwrap().to_owned();
    assert!(all.iter().all(|e| e["run"] == run.as_str()), "{all:?}");
    assert_eq!(
        lines(&h, &format!("/v1/events?since=1&run={run}"))
            .await
            .len(),
        1
    );
    let earlier = Harness::new().await;
    let old = earlier.agent.events().run().id.clone();
    assert_ne!(old, run);
    for q in [format!("since=1&run={old}"), "since=4711".to_owned()] {
        for follow in ["false", "true"] {
            let got = h.get(&format!("/v1/events?{q}&follow={follow}")).await;
            assert_error(
                &got,
                409,
                "CONFLICT",
                &["the agent restarted", &format!("since=0&run={run}")],
            );
        }
    }
}

#[test]
fn every_kind_is_in_the_openapi_document_and_nothing_else() {
    let doc = openapi();
    let documented: Vec<String> = doc["components"]["schemas"]["Event"]["oneOf"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let s = doc
                .pointer(r["$ref"].as_str().unwrap().trim_start_matches('#'))
                .unwrap();
            s["properties"]["kind"]["enum"][0]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(documented, KINDS);
    let param = doc["paths"]["/v1/events"]["get"]["parameters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "kind")
        .unwrap();
    assert_eq!(param["schema"]["items"]["enum"], serde_json::json!(KINDS));
}

/// Reads `s` until EOF or `limit`; returns what came and whether EOF was seen.
fn read_until_eof(s: &mut std::os::unix::net::UnixStream, limit: Duration) -> (Vec<u8>, bool) {
    let start = Instant::now();
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 65536];
    while start.elapsed() < limit {
        match s.read(&mut buf) {
            Ok(0) => return (got, true),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return (got, true),
            Err(e) => panic!("read: {e}"),
        }
    }
    (got, false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_that_stops_reading_never_delays_puts_and_is_cut() {
    let h = Harness::new().await;
    let sock = h.dir.join("vmnet.sock");
    let unix = server::bind_unix(&sock, server::Access::default())
        .await
        .unwrap();
    let router = vmnet_agent::api::router(Arc::clone(&h.agent));
    let task = tokio::spawn(async move {
        server::serve(router, unix, std::future::pending())
            .await
            .unwrap();
    });
    // A follower that reads the answer's head, then nothing more.
    let mut stalled = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    std::io::Write::write_all(
        &mut stalled,
        b"GET /v1/events?follow=true HTTP/1.1\r\nHost: x\r\n\r\n",
    )
    .unwrap();
    let mut head = [0u8; 64];
    stalled
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let n = stalled.read(&mut head).unwrap();
    assert!(head[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &head[..n]);
    assert!(h.agent.events().followed());

    // The agent goes on: PUTs, and far more events than the follower's socket and queue take
    // (publishing never waits; each PUT is answered at once).
    let client = Client::new(&sock);
    let mut slowest = Duration::ZERO;
    for i in 0..40u32 {
        if i == 20 {
            // In small batches, so the stream's forwarder keeps up with the bus and it is the
            // follower's full socket and queue that cut it.
            let mut k = 0u32;
            while h.agent.events().followed() && k < 400_000 {
                for _ in 0..20 {
                    let subject = Subject::vm(&format!("flood{k}"), k);
                    h.agent.events().publish(subject, EventBody::VmDeleted {});
                    k += 1;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            eprintln!("{k} events published until the follower was cut");
        }
        let t = Instant::now();
        let put = tokio::time::timeout(
            Duration::from_secs(10),
            client.put::<VmView>(&format!("/v1/vms/v{i}"), &vm(&format!("v{i}"), 100 + i)),
        )
        .await;
        put.expect("a PUT waited on the stalled follower").unwrap();
        slowest = slowest.max(t.elapsed());
    }
    eprintln!("slowest PUT with a stalled follower: {slowest:?}");

    // The stream was cut: the bus has no follower left, and the connection is closed after
    // the grace period even though the follower never read.
    assert!(
        !h.agent.events().followed(),
        "the stalled follower was not cut"
    );
    // Closed by the agent while the follower still has not read: its socket hangs up.
    let hung_up = |s: &std::os::unix::net::UnixStream| {
        let mut p = libc::pollfd {
            fd: std::os::fd::AsRawFd::as_raw_fd(s),
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one valid pollfd for a socket this test owns, no timeout.
        let n = unsafe { libc::poll(&raw mut p, 1, 0) };
        n == 1 && p.revents & libc::POLLHUP != 0
    };
    let start = Instant::now();
    assert!(
        !hung_up(&stalled),
        "closed before the grace period: the follower's socket was not full"
    );
    while !hung_up(&stalled) {
        assert!(
            start.elapsed() < vmnet_agent::events::stream::CUT_GRACE + Duration::from_secs(5),
            "the stalled follower's connection stayed open"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "connection closed {:?} after the stream was cut",
        start.elapsed()
    );
    assert!(start.elapsed() >= vmnet_agent::events::stream::CUT_GRACE - Duration::from_millis(200));
    let (got, eof) =
        tokio::task::spawn_blocking(move || read_until_eof(&mut stalled, Duration::from_secs(10)))
            .await
            .unwrap();
    assert!(eof, "the connection stayed open ({} bytes read)", got.len());
    // What it did get is whole events from the start of the stream.
    let text = String::from_utf8_lossy(&got);
    assert!(
        text.contains("\"kind\":\"vm_applied\""),
        "{}",
        &text[..text.len().min(500)]
    );

    // A follower that keeps up sees new events live.
    let c2 = client.clone();
    let live = tokio::spawn(async move {
        let mut seen = Vec::new();
        c2.events_lines("follow=true&kind=vm_deleted", |l| {
            seen.push(l.to_owned());
            false
        })
        .await
        .unwrap();
        seen
    });
    while !h.agent.events().followed() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _: VmView = client.delete("/v1/vms/v0").await.unwrap();
    let seen = tokio::time::timeout(Duration::from_secs(10), live)
        .await
        .unwrap()
        .unwrap();
    let e: Value = serde_json::from_str(&seen[0]).unwrap();
    assert_eq!(
        (e["kind"].as_str(), e["vm"].as_str()),
        (Some("vm_deleted"), Some("v0"))
    );
    task.abort();
}
