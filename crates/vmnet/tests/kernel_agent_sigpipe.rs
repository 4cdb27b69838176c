//! The agent survives the peers that vanish under it (root required; a throwaway sandbox):
//! an API client that hangs up in the middle of pipelined requests, the pool root helper killed
//! before its reply, and `wireguard-go` killed while the agent writes a UAPI request to it. In
//! each case the write hits a peer that is gone (`EPIPE`): the agent stays up, logs the failed
//! peer, and converges (serves the next client, starts a new helper and realises the instance,
//! restarts `wireguard-go` and applies the recorded peers).

mod agent_support;
mod mesh_support;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use agent_support::{options, start, vm};
use base64::Engine;
use mesh_support::{WgGuard, eventually, mesh_of};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};
use vmnet_agent::api::types::{AgentStatus, VmView};
use vmnet_agent::mesh::view::MeshView;
use vmnet_testkit::agent::AgentOptions;
use vmnet_testkit::{Sandbox, netns, require_root};

/// The pids of `parent`'s children whose command line contains `needle`.
fn children(parent: u32, needle: &str) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
            let ppid = status
                .lines()
                .find_map(|l| l.strip_prefix("PPid:"))
                .map(str::trim)
                .and_then(|p| p.parse::<u32>().ok());
            ppid == Some(parent)
                && std::fs::read(format!("/proc/{pid}/cmdline"))
                    .map(|c| String::from_utf8_lossy(&c).contains(needle))
                    .unwrap_or(false)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn a_client_hanging_up_mid_pipeline_leaves_the_agent_up() {
    require_root();
    let sb = Sandbox::new("sp").expect("sandbox");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_owned();
    let mut agent = start(&options(&sb, &dir, 60)).await;
    let sock = dir.join("vmnet.sock");
    // Many requests in one write, then the client goes away before reading an answer: the
    // agent's answers are written to a socket nobody reads any more.
    let burst = b"GET /v1/status HTTP/1.1\r\nHost: x\r\n\r\n".repeat(50);
    for _ in 0..20 {
        let mut s = UnixStream::connect(&sock).expect("connect");
        s.write_all(&burst).expect("write");
        drop(s);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        agent.running(),
        "the agent died; log:\n{}",
        agent.log_text()
    );
    let log = agent.log_text();
    assert!(
        log.contains("API connection from uid 0") && log.contains("ended with an error"),
        "the failed peer is logged:\n{log}"
    );
    // It converges: the next client is served, a VM change goes through.
    let client = agent.client().clone();
    let v: VmView = client.put("/v1/vms/sp1", &vm("sp", 1)).await.expect("put");
    assert_eq!(v.config.user_id, 1);
    let st: AgentStatus = client.get("/v1/status").await.expect("status");
    assert_eq!(st.vms.applied, 1);
    drop(agent);
    drop(sb);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn the_pool_helper_dying_before_its_reply_leaves_the_agent_up() {
    require_root();
    let sb = Sandbox::new("sh").expect("sandbox");
    let host = sb.host();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_owned();
    let opts =
        options(&sb, &dir, 2).args(["--host-id", "h1", "--bridge", "br0", "--create-bridge"]);
    let mut agent = start(&opts).await;
    let client = agent.client().clone();
    let _: Value = client
        .put(
            "/v1/pools/p1/range",
            &json!({"cidr": "10.0.0.0/29", "gateway": "10.0.0.1"}),
        )
        .await
        .unwrap();
    let _: Value = client
        .put("/v1/hosts/h1", &json!({"vcpus": 8, "memory_mib": 8192}))
        .await
        .unwrap();
    let helpers = children(agent.pid(), "pool-helper");
    assert_eq!(helpers.len(), 1, "one root helper runs");
    let old = helpers[0];
    kill(Pid::from_raw(i32::try_from(old).unwrap()), Signal::SIGKILL).unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    // The instance's rules go to the helper that is gone: its socket's other end is closed.
    let created: Result<Value, _> = client
        .post(
            "/v1/instances",
            Some(&json!({"instance_id": "i-a", "pool_id": "p1", "host_id": "h1", "vcpus": 1, "memory_mib": 256})),
        )
        .await;
    assert!(created.is_ok(), "{created:?}");
    assert!(
        agent.running(),
        "the agent died; log:\n{}",
        agent.log_text()
    );
    let log = agent.log_text();
    assert!(
        log.contains("pool root helper failed") && log.contains(&format!("pid={old}")),
        "the failed helper is logged with its pid:\n{log}"
    );
    // A new helper runs, and the next pass realises the instance: its tap is on the bridge and
    // its elements are in the tables.
    let tap = vmnet_model::nic::tap_name("i-a", 0).unwrap().to_string();
    let t = Instant::now();
    loop {
        let elems = netns::exec(
            &host,
            "nft",
            &["list", "set", "bridge", "bcd_instances", "taps"],
            Duration::from_secs(5),
        )
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
        let tap_ok = agent_support::links(&host).contains(&tap);
        if tap_ok && elems.contains(&tap) {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "not converged: tap {tap_ok}, elements {elems}; log:\n{}",
            agent.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let now = children(agent.pid(), "pool-helper");
    assert!(
        now.len() == 1 && now[0] != old,
        "a new helper runs: {now:?}"
    );
    assert!(agent.running());
    drop(agent);
    drop(sb);
}

/// A sync body of `n` peers with endpoints on `host_v6` from port `port` up (the endpoints are
/// this host itself, so no packet leaves its namespace).
fn many_peers(n: usize, host_v6: std::net::Ipv6Addr, port: usize) -> Value {
    let peers: Vec<Value> = (0..n)
        .map(|i| {
            let mut k = [7u8; 32];
            k[..8].copy_from_slice(&(i as u64).to_be_bytes());
            json!({"public_key": base64::engine::general_purpose::STANDARD.encode(k),
                   "endpoint": format!("[{host_v6}]:{}", port + i),
                   "mesh_address": format!("fdaa:99::{:x}", i + 1)})
        })
        .collect();
    json!({"peers": peers, "whitelist": []})
}

const PEERS: usize = 2000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces and runs wireguard-go (scripts/test.sh runs it)"]
async fn wireguard_go_exiting_during_a_uapi_request_leaves_the_agent_up() {
    require_root();
    let fleet = vmnet_testkit::Fleet::new(1).expect("fleet");
    let host = fleet.hosts()[0].clone();
    let tmp = tempfile::tempdir().unwrap();
    let ifname = format!("{}wg", host.prefix);
    let _wg = WgGuard(vec![ifname.clone()]);
    // No reconcile pass during the test (a pass reads the device too): the sync is the only
    // UAPI request in flight when wireguard-go dies.
    let agent = AgentOptions::new(&host.ns, &host.prefix, tmp.path())
        .exe(agent_support::VMNET)
        .args([
            "--reconcile-interval-secs",
            "3600",
            "--mesh",
            "--wg-interface",
            &ifname,
            "--mesh-address",
            &mesh_of(host.index).to_string(),
        ])
        .start(Duration::from_secs(30))
        .await
        .expect("agent");
    let client = agent.client().clone();
    let v6 = host.private_v6;
    // The peers on the device; the next sync moves every endpoint, a UAPI request of ~400 KiB
    // that the agent writes without reading the device first.
    let _: Value = client
        .post("/v1/sync", Some(&many_peers(PEERS, v6, 20000)))
        .await
        .expect("first sync");
    let view = |c: vmnet_agent::client::Client| async move {
        c.get::<MeshView>("/v1/mesh").await.expect("GET /v1/mesh")
    };
    let wg = view(client.clone())
        .await
        .daemon_pid
        .expect("wireguard-go runs");
    let wg_pid = Pid::from_raw(i32::try_from(wg).unwrap());
    // wireguard-go stops reading: the request fills its socket and waits; then wireguard-go
    // dies with the request half written.
    kill(wg_pid, Signal::SIGSTOP).unwrap();
    let body = many_peers(PEERS, v6, 40000);
    let c = client.clone();
    let sync = tokio::spawn(async move { c.post::<Value>("/v1/sync", Some(&body)).await });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    kill(wg_pid, Signal::SIGKILL).unwrap();
    let answered = tokio::time::timeout(Duration::from_secs(20), sync)
        .await
        .expect("the sync answers")
        .unwrap();
    let log = agent.log_text();
    let e = answered.expect_err(&format!("the sync failed with its device; log:\n{log}"));
    assert!(
        kill(Pid::from_raw(i32::try_from(agent.pid()).unwrap()), None).is_ok(),
        "the agent is alive; log:\n{log}"
    );
    assert!(e.message.contains("wireguard"), "{e}");
    assert!(
        log.contains(&format!(
            "wireguard-go (pid {wg}) failed during a UAPI request"
        )),
        "the failed wireguard-go is logged:\n{log}"
    );
    // It converges: wireguard-go started again, every recorded peer on it at its new endpoint.
    let ok = eventually(Duration::from_secs(30), || {
        let c = client.clone();
        async move {
            let v = view(c).await;
            v.daemon_pid.is_some_and(|p| p != wg)
                && v.peers.len() == PEERS
                && v.peers.iter().all(|p| p.present)
        }
    })
    .await;
    assert!(ok, "not converged; log:\n{}", agent.log_text());
    let dump = mesh_support::wg_dump(&ifname);
    let moved = dump
        .lines()
        .filter(|l| l.contains(&format!("[{v6}]:4")))
        .count();
    assert_eq!(moved, PEERS, "every peer at its new endpoint on the device");
    drop(agent);
    drop(fleet);
}
