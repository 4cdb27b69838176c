//! Secrets never reach a log (root required: a fleet host and `wireguard-go`): the agent runs at
//! trace level (`RUST_LOG=trace`, the worker too) through a mesh sync and a provider poll (a fake
//! Hetzner Cloud API on the host's loopback, named `localhost`, the token read from the
//! credentials directory and sent by the worker); its whole output holds neither the host's
//! WireGuard private key (base64 or hex) nor the provider token, while the fake did receive the
//! token.

mod mesh_support;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use mesh_support::{WgGuard, eventually, mesh_of, options};
use serde_json::{Value, json};
use vmnet_agent::api::types::AgentStatus;
use vmnet_testkit::{Fleet, netns, require_root};

/// A fake Hetzner Cloud API in namespace `ns` on loopback: one server (id 1); records every
/// `Authorization` header it receives. Returns its base URL.
fn fake_hetzner(ns: &str, seen: Arc<Mutex<Vec<String>>>) -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    let ns = ns.to_owned();
    std::thread::spawn(move || {
        netns::enter(&ns).expect("enter the host");
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        tx.send(l.local_addr().unwrap().port()).unwrap();
        for s in l.incoming().flatten() {
            let mut r = BufReader::new(s.try_clone().unwrap());
            let mut auth = String::new();
            loop {
                let mut line = String::new();
                if r.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("authorization:") {
                    auth = line[line.len() - v.len()..].trim().to_owned();
                }
            }
            seen.lock().unwrap().push(auth);
            let body = json!({"servers": [{"id": 1, "public_net": {"ipv4": {"ip": "203.0.113.10"}, "ipv6": null}, "private_net": []}],
                              "meta": {"pagination": {"page": 1, "next_page": null, "last_page": 1}}})
                .to_string();
            let mut s = s;
            let _ = write!(
                s,
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    let port = rx.recv().unwrap();
    // A name, not an address: the worker resolves it (the C resolver reads /etc/hosts) under
    // its seccomp filter.
    format!("http://localhost:{port}/v1")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces and runs wireguard-go (scripts/test.sh runs it)"]
async fn no_secret_reaches_the_log_at_trace_level() {
    require_root();
    let fleet = Fleet::new(1).expect("fleet");
    let host = fleet.hosts()[0].clone();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("agent");
    let creds = tmp.path().join("creds");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::create_dir_all(&creds).unwrap();
    let token = format!("hz-SECRET-{}-token", std::process::id());
    let token_file = creds.join("hz.token");
    std::fs::write(&token_file, format!("{token}\n")).unwrap();
    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let url = fake_hetzner(&host.ns, Arc::clone(&seen));
    let ifname = format!("{}wg", host.prefix);
    let _wg = WgGuard(vec![ifname.clone()]);
    let agent = options(&host, &ifname, mesh_of(host.index), &dir)
        .rust_log("trace")
        .args([
            "--poll-providers".to_owned(),
            "--allow-plain-http-providers".to_owned(),
            "--credentials-dir".to_owned(),
            creds.display().to_string(),
        ])
        .start(Duration::from_secs(30))
        .await
        .expect("agent");
    let client = agent.client().clone();

    // A provider poll.
    let _: Value = client
        .put(
            "/v1/pools/hz/provider",
            &json!({"provider": "hetzner-cloud", "api_url": url,
                    "credentials": {"file": token_file.display().to_string()}, "poll_interval_secs": 5}),
        )
        .await
        .expect("provider pool");
    let _: Value = client
        .post(
            "/v1/instances",
            Some(&json!({"instance_id": "m1", "pool_id": "hz", "machine": {"server_id": 1}})),
        )
        .await
        .expect("instance");
    let polled = eventually(Duration::from_secs(20), || async {
        let st: AgentStatus = client.get("/v1/status").await.unwrap();
        st.provider_pools
            .unwrap_or_default()
            .first()
            .is_some_and(|p| p.state == vmnet_agent::provider::ProviderPoolState::Ok)
    })
    .await;
    assert!(
        polled,
        "the poll succeeded; log tail:\n{}",
        agent.log_tail()
    );
    assert!(
        seen.lock()
            .unwrap()
            .iter()
            .any(|a| *a == format!("Bearer {token}")),
        "the fake received the token"
    );
    // The pool's state and the instance's addresses are written apart: wait for the second.
    let want = json!(["203.0.113.10/32"]);
    let reported = eventually(Duration::from_secs(20), || async {
        let inst: Value = client.get("/v1/instances/m1").await.unwrap();
        inst["addresses"] == want
    })
    .await;
    let inst: Value = client.get("/v1/instances/m1").await.unwrap();
    assert!(reported, "{inst}");

    // A mesh sync (the device got the private key when the agent started).
    let mut k = [9u8; 32];
    k[0] = 1;
    let peer = json!({"public_key": base64::engine::general_purpose::STANDARD.encode(k),
                      "endpoint": format!("[{}]:51999", host.private_v6),
                      "mesh_address": "fdaa:77::1"});
    let _: Value = client
        .post("/v1/sync", Some(&json!({"peers": [peer], "whitelist": []})))
        .await
        .expect("sync");

    tokio::time::sleep(Duration::from_millis(300)).await;
    let log = agent.log_text();
    let key_b64 = std::fs::read_to_string(dir.join("state/wireguard.key")).unwrap();
    let key_b64 = key_b64.trim();
    let key_hex: String = base64::engine::general_purpose::STANDARD
        .decode(key_b64)
        .unwrap()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert!(
        log.lines().filter(|l| l.contains("TRACE")).count() > 100,
        "the agent logged at trace level"
    );
    assert!(
        log.contains("metadata worker serving"),
        "the worker logged too"
    );
    for (what, secret) in [
        ("the WireGuard private key (base64)", key_b64),
        ("the WireGuard private key (hex)", key_hex.as_str()),
        ("the provider token", token.as_str()),
    ] {
        assert!(!log.contains(secret), "{what} is in the log");
    }
    drop(agent);
    drop(fleet);
}
