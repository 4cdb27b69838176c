//! The metadata service on a real kernel (root required), with real packets from simulated
//! guests behind each VM's tap: a guest reads its own document, plain (a VM set to version 1)
//! and with a version-2 token; VM A's guest never gets VM B's document whatever it sends; a
//! flood from one guest leaves another's p99 within a bound; the address survives drift and the
//! listeners an agent restart; a PUT that changes the mesh address is in the document at once
//! and `vmnet-guest --apply netlink` in the guest applies it within 500 ms, after which a mesh
//! peer reaches the guest at its new address.

mod agent_support;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use agent_support::{VMNET, options, start, vm};
use serde_json::{Value, json};
use vmnet_agent::api::types::{VmState, VmView};
use vmnet_testkit::echo::EchoService;
use vmnet_testkit::guest::{GuestConfig, GuestRoute6, SimGuest};
use vmnet_testkit::mmds::{self, get_request, get_with_token, request};
use vmnet_testkit::{Sandbox, netns, require_root, traffic};

const T: Duration = Duration::from_secs(3);
const ID_PATH: &str = "/latest/meta-data/instance-id";
const MESH_PATH: &str = "/latest/meta-data/mesh-ipv6";

fn guest(sb: &Sandbox, name: &str, v: &VmView) -> SimGuest {
    let cfg = GuestConfig {
        mesh_ipv6: v.config.mesh_ipv6,
        routes_v6: vec![GuestRoute6 {
            destination: "fdaa::/16".into(),
            via: Some(vmnet_plan::ns::HOST_LINK_LOCAL),
        }],
        ..GuestConfig::default()
    };
    SimGuest::attach(sb, name, &v.status.netns, &v.status.tap, &cfg).expect("guest")
}

fn p99(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[(v.len() * 99 / 100).min(v.len() - 1)]
}

/// `vmnet-guest` next to the `vmnet` binary (`cargo test --workspace` builds both).
fn guest_agent_exe() -> PathBuf {
    let p = PathBuf::from(VMNET).with_file_name("vmnet-guest");
    assert!(
        p.exists(),
        "{} is missing: build it first (cargo build -p vmnet-guest, or cargo test --workspace)",
        p.display()
    );
    p
}

/// A child process killed (by its pid) on drop.
struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn v6_addrs(ns: &str) -> String {
    netns::ip(ns, &["-6", "-o", "addr", "show", "dev", "eth0"]).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn guests_read_only_their_own_metadata() {
    require_root();
    let sb = Sandbox::new("md").expect("sandbox");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_owned();
    let opts = options(&sb, &dir, 1);
    let mut agent = start(&opts).await;
    let client = agent.client().clone();

    // A speaks version 1 (its own setting), B the host default (version 2) and has a public
    // address, C has no routes at all.
    let mut a = vm("a", 1);
    a["metadata"] = json!({"version": "v1"});
    let mut b = vm("b", 2);
    b["public_ipv4"] = json!("203.0.113.9");
    let c = json!({"id": "c3", "user_id": 3, "tenant": 1, "mesh_ipv6": "fdaa:7::3"});
    let va: VmView = client.put("/v1/vms/a1", &a).await.expect("put a1");
    let vb: VmView = client.put("/v1/vms/b2", &b).await.expect("put b2");
    let vc: VmView = client.put("/v1/vms/c3", &c).await.expect("put c3");
    for v in [&va, &vb, &vc] {
        assert_eq!(v.status.state, VmState::Applied);
    }
    let ga = guest(&sb, "a", &va);
    let gb = guest(&sb, "b", &vb);
    let gc = guest(&sb, "c", &vc);

    // Own document: plain (v1), with a token (both), folders and JSON.
    let r = request(ga.netns(), None, &get_request(ID_PATH, &[]), T).expect("a plain");
    assert_eq!((r.status, r.body.as_str()), (200, "a1"));
    let r = get_with_token(ga.netns(), MESH_PATH, T).expect("a token");
    assert_eq!((r.status, r.body.as_str()), (200, "fdaa:7::1"));
    let r = request(gb.netns(), None, &get_request(ID_PATH, &[]), T).expect("b plain");
    assert_eq!(r.status, 401, "B is version 2: {}", r.body);
    let r = get_with_token(gb.netns(), ID_PATH, T).expect("b token");
    assert_eq!((r.status, r.body.as_str()), (200, "b2"));
    let r = get_with_token(gb.netns(), "/latest/meta-data/", T).expect("b folder");
    assert_eq!(
        r.body, "host-routes\ninstance-id\nmesh-ipv6\npublic-ipv4",
        "{r:?}"
    );
    let r = get_with_token(gb.netns(), "/latest/meta-data/public-ipv4", T).unwrap();
    assert_eq!(r.body, "203.0.113.9");
    let r = get_with_token(gb.netns(), "/latest/meta-data/host-routes", T).unwrap();
    assert_eq!(r.body, "0.0.0.0/0\n::/0");
    let r = get_with_token(gc.netns(), "/latest/meta-data/host-routes", T).expect("c: no routes");
    assert_eq!((r.status, r.body.as_str()), (200, ""));

    // A never gets B's document, whatever it sends.
    let tb = request(gb.netns(), None, &mmds::token_request(60), T)
        .unwrap()
        .body;
    let forged: Vec<Vec<String>> = vec![
        vec![
            "Host: 169.254.169.254".into(),
            "X-Forwarded-For: 203.0.113.9".into(),
        ],
        vec!["X-Forwarded-For: 172.16.0.2, 10.200.0.10".into()],
        vec![format!("Host: {}", vb.status.netns)],
        vec![
            "X-Real-IP: 203.0.113.9".into(),
            "Forwarded: for=203.0.113.9".into(),
        ],
        vec![format!("X-metadata-token: {}", tb.trim())],
    ];
    for hdrs in &forged {
        let h: Vec<&str> = hdrs.iter().map(String::as_str).collect();
        let r = request(ga.netns(), None, &get_request(ID_PATH, &h), T).expect("forged");
        assert_ne!(r.body, "b2", "{hdrs:?}");
        assert!(
            r.status == 200 && r.body == "a1" || r.status == 401,
            "{hdrs:?}: {r:?}"
        );
    }
    // B's token is not valid in A (each VM has its own tokens): 401, not B's document.
    let h = format!("X-metadata-token: {}", tb.trim());
    let r = request(ga.netns(), None, &get_request(ID_PATH, &[&h]), T).unwrap();
    assert_eq!(r.status, 401);
    // An absolute-form URI naming B's namespace, and B's public address as the source.
    let raw = format!(
        "GET http://{}/latest/meta-data/instance-id HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        vb.status.netns
    );
    let r = request(ga.netns(), None, &raw, T).unwrap();
    assert_eq!(r.body, "a1");
    netns::ip(
        ga.netns(),
        &["addr", "add", "203.0.113.9/32", "dev", "eth0"],
    )
    .unwrap();
    if let Ok(r) = request(
        ga.netns(),
        Some(Ipv4Addr::new(203, 0, 113, 9)),
        &get_request(ID_PATH, &[]),
        Duration::from_secs(1),
    ) {
        assert_eq!(r.body, "a1", "{r:?}");
    }
    netns::ip(
        ga.netns(),
        &["addr", "del", "203.0.113.9/32", "dev", "eth0"],
    )
    .unwrap();

    // A flood from A leaves B's p99 within a bound.
    let sample = |ns: String| {
        let mut lat = Vec::new();
        let t = request(&ns, None, &mmds::token_request(600), T)
            .unwrap()
            .body;
        let h = format!("X-metadata-token: {}", t.trim());
        for _ in 0..100 {
            let r = request(&ns, None, &get_request(ID_PATH, &[&h]), T).expect("sample");
            assert_eq!(r.status, 200);
            lat.push(r.elapsed);
            std::thread::sleep(Duration::from_millis(8));
        }
        lat
    };
    let bns = gb.netns().to_owned();
    let quiet = p99(tokio::task::spawn_blocking({
        let b = bns.clone();
        move || sample(b)
    })
    .await
    .unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let limited = Arc::new(AtomicU64::new(0));
    let mut flooders = Vec::new();
    for _ in 0..4 {
        let (ns, stop, limited) = (
            ga.netns().to_owned(),
            Arc::clone(&stop),
            Arc::clone(&limited),
        );
        flooders.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if let Ok(r) = request(&ns, None, &get_request(ID_PATH, &[]), T)
                    && r.status == 429
                {
                    limited.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    std::thread::sleep(Duration::from_millis(300));
    let flooded = p99(tokio::task::spawn_blocking(move || sample(bns))
        .await
        .unwrap());
    stop.store(true, Ordering::Relaxed);
    for f in flooders {
        f.join().unwrap();
    }
    eprintln!(
        "B's p99: {quiet:?} quiet, {flooded:?} while A floods ({} of A's requests answered 429)",
        limited.load(Ordering::Relaxed)
    );
    assert!(
        limited.load(Ordering::Relaxed) > 0,
        "A's flood was rate-limited"
    );
    assert!(
        flooded <= quiet * 3 + Duration::from_millis(5),
        "B's p99 went from {quiet:?} to {flooded:?} under A's flood"
    );

    // Drift: the address removed from A's tap is put back by the next pass (every second).
    netns::ip(
        &va.status.netns,
        &["addr", "del", "169.254.169.254/32", "dev", &va.status.tap],
    )
    .unwrap();
    let t0 = Instant::now();
    loop {
        let r = request(
            ga.netns(),
            None,
            &get_request(ID_PATH, &[]),
            Duration::from_millis(300),
        );
        if matches!(&r, Ok(r) if r.body == "a1") {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "not repaired: {r:?}\n{}",
            agent.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // An agent restart re-creates every listener.
    drop(agent);
    agent = start(&opts).await;
    let client = agent.client().clone();
    let t0 = Instant::now();
    loop {
        let r = get_with_token(gb.netns(), ID_PATH, Duration::from_millis(300));
        if matches!(&r, Ok(r) if r.body == "b2") {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "no listener after the restart: {r:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // vmnet-guest in A's guest, then a PUT that moves A's mesh address (a warm-snapshot
    // resume): in the document at once, on the guest's interface within 500 ms, reachable
    // from B's guest (a mesh peer on the same host) at the new address.
    let exe = guest_agent_exe();
    let _ga_agent = Kill(
        Command::new("ip")
            .args(["netns", "exec", ga.netns()])
            .arg(&exe)
            .args(["--apply", "netlink", "--interface", "eth0"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("vmnet-guest"),
    );
    std::thread::sleep(Duration::from_millis(600));
    let new: Ipv6Addr = "fdaa:7::101".parse().unwrap();
    let mut moved: Value = a.clone();
    moved["mesh_ipv6"] = json!(new.to_string());
    let v: VmView = client.put("/v1/vms/a1", &moved).await.expect("put moved");
    let put_done = Instant::now();
    let r = request(ga.netns(), None, &get_request(MESH_PATH, &[]), T).unwrap();
    assert_eq!(r.body, new.to_string(), "the document changed at once");
    let applied_after = loop {
        if v6_addrs(ga.netns()).contains(&format!("{new}/128")) {
            break put_done.elapsed();
        }
        assert!(
            put_done.elapsed() < Duration::from_secs(3),
            "never applied: {}",
            v6_addrs(ga.netns())
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    eprintln!("vmnet-guest applied the new mesh address {applied_after:?} after the PUT");
    assert!(
        applied_after < Duration::from_millis(500),
        "{applied_after:?}"
    );
    assert!(
        !v6_addrs(ga.netns()).contains("fdaa:7::1/128"),
        "the old address went"
    );
    assert_eq!(v.status.state, VmState::Applied);
    let echo_at = SocketAddr::new(IpAddr::V6(new), 7007);
    let _echo = EchoService::start(ga.netns(), &[echo_at]).expect("echo on the new address");
    let reply = traffic::tcp_echo(gb.netns(), echo_at, T).expect("B reaches A at its new address");
    assert_eq!(reply.peer.ip(), IpAddr::V6(vb.config.mesh_ipv6.unwrap()));

    // Deleting a VM closes its listener (its netns goes too); the others keep serving.
    let _: VmView = client.delete("/v1/vms/c3").await.expect("delete c3");
    let r = get_with_token(gb.netns(), ID_PATH, T).unwrap();
    assert_eq!(r.body, "b2");
    drop((ga, gb, gc));
}
