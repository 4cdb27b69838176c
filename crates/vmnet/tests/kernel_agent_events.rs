//! The event stream on a real kernel (root required; a throwaway sandbox): `vmnet events
//! --follow --output json`, run as an operator runs it, shows a VM's PUT, the repairs of its tap
//! deleted by hand in its netns and of its host route (found by the kernel's notifications;
//! the route's link named), and its DELETE; the text
//! output ends quietly when its reader goes away (`| head -1`).

mod agent_support;

use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use agent_support::{VMNET, links, options, start, vm};
use serde_json::Value;
use vmnet_agent::api::types::VmView;
use vmnet_testkit::{Sandbox, netns, require_root};

/// How long an event may take to show.
const WAIT: Duration = Duration::from_secs(10);

/// The next event from `rx` that `pick` accepts, skipping others; panics after [`WAIT`].
fn next(rx: &mpsc::Receiver<Value>, what: &str, pick: impl Fn(&Value) -> bool) -> Value {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(e) if pick(&e) => return e,
            Ok(_) => {}
            Err(e) => panic!("no {what} event within {WAIT:?}: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn the_stream_shows_a_put_a_drift_repair_and_a_delete() {
    require_root();
    let sb = Sandbox::new("ev").expect("sandbox");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_owned();
    // Passes once a minute: the repair below is the notification's.
    let agent = start(&options(&sb, &dir, 60)).await;
    let client = agent.client().clone();
    let sock = dir.join("vmnet.sock");

    let mut follow = Command::new(VMNET)
        .arg("--socket")
        .arg(&sock)
        .args(["events", "--follow", "--since", "0", "--output", "json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = follow.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            let v: Value = serde_json::from_str(&l).unwrap_or_else(|e| panic!("{l}: {e}"));
            if tx.send(v).is_err() {
                return;
            }
        }
    });

    let cfg = vm("ev", 7);
    let id = cfg["id"].as_str().unwrap().to_owned();
    let view: VmView = client.put(&format!("/v1/vms/{id}"), &cfg).await.unwrap();
    let is = |kind: &'static str| {
        let id = id.clone();
        move |e: &Value| e["kind"] == kind && e["vm"] == id.as_str()
    };
    let put = next(&rx, "vm_applied", is("vm_applied"));
    assert_eq!(
        (put["change"].as_str(), put["user_id"].as_u64()),
        (Some("created"), Some(7))
    );

    // The tap deleted by hand in the VM's netns comes back, and the stream says so.
    let (ns, tap) = (view.status.netns.clone(), view.status.tap.clone());
    netns::ip(&ns, &["link", "del", &tap]).expect("delete the tap");
    let drift = next(&rx, "drift_repaired", |e| {
        is("drift_repaired")(e) && e["detail"].as_str().is_some_and(|d| d.contains(&tap))
    });
    assert_eq!(drift["objects"], serde_json::json!(["link"]), "{drift}");
    assert_eq!(drift["netns"].as_str(), Some(ns.as_str()), "{drift}");
    assert_eq!(drift["trigger"], "notification", "{drift}");
    assert!(links(&ns).contains(&tap), "the tap is back");

    // The host's route to the VM's mesh address deleted by hand: its repair names the link
    // the route goes through, not its ifindex.
    let veth = view.status.veth_host.clone().unwrap();
    netns::ip(&sb.host(), &["-6", "route", "del", "fdaa:7::7/128"]).expect("delete the route");
    let route = next(&rx, "drift_repaired of the host route", |e| {
        is("drift_repaired")(e)
            && e["objects"] == serde_json::json!(["route"])
            && e["netns"] == "host"
    });
    let detail = route["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("fdaa:7::7/128") && detail.contains(&format!(" dev {veth}")),
        "{route}"
    );
    assert!(
        !detail.contains('#'),
        "a link name, not an ifindex: {route}"
    );

    let _: VmView = client.delete(&format!("/v1/vms/{id}")).await.unwrap();
    let del = next(&rx, "vm_deleted", is("vm_deleted"));
    assert!(
        del["seq"].as_u64() > drift["seq"].as_u64() && drift["seq"].as_u64() > put["seq"].as_u64()
    );
    follow.kill().unwrap();
    let _ = follow.wait();

    // `vmnet events --follow | head -1`: after its first line the reader is gone; the next
    // event's line ends the command by SIGPIPE, quietly (nothing on stderr).
    let mut piped = Command::new(VMNET)
        .arg("--socket")
        .arg(&sock)
        .args(["events", "--follow", "--since", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(piped.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert!(
        first.contains("vm_applied") && first.contains(&id),
        "{first}"
    );
    // (The reader above is dropped: the pipe has no reader left.)
    let again = vm("ev", 8);
    let _: VmView = client.put("/v1/vms/ev8", &again).await.unwrap();
    let status = tokio::task::spawn_blocking(move || {
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            if let Some(s) = piped.try_wait().unwrap() {
                let mut err = String::new();
                std::io::Read::read_to_string(&mut piped.stderr.take().unwrap(), &mut err).unwrap();
                return (s, err);
            }
            assert!(
                std::time::Instant::now() < deadline,
                "vmnet events kept running"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    })
    .await
    .unwrap();
    assert_eq!(status.0.signal(), Some(libc::SIGPIPE), "{:?}", status.0);
    assert!(status.1.is_empty(), "stderr: {}", status.1);
    drop(agent);
}
