//! The agent's metrics and probes for real (root required: the agent runs in a sandbox host
//! namespace): `vmnet serve --metrics-listen` serves `GET /metrics`, `/healthz` and `/readyz`
//! on TCP and nothing else; a VM with a throughput limit shows in the scrape, over the API
//! socket and over TCP, with its class counters; both scrapes pass `promtool check metrics`;
//! the listener closes connections beyond its bound at once and idle ones after the header
//! timeout, after which it serves again.

mod agent_support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use agent_support::{options, start, vm};
use hyper::Method;
use vmnet_agent::api::types::VmView;
use vmnet_testkit::{Sandbox, require_root};

const ADDR: &str = "127.0.0.1:9851";

/// One HTTP/1.0 GET to `ADDR` from inside `ns`: the status line's code and the body.
fn http_get(ns: &str, path: &str) -> (u16, String) {
    let path = path.to_owned();
    vmnet_kernel::netns::run_in(ns, move || {
        let mut s = TcpStream::connect(ADDR).expect("connect to --metrics-listen");
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        write!(s, "GET {path} HTTP/1.0\r\nHost: vmnet\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        let code = out
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = out
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        (code, body)
    })
    .unwrap()
}

fn promtool(text: &str) {
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
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn metrics_and_probes_over_the_socket_and_the_metrics_listener() {
    require_root();
    let sb = Sandbox::new("mx").expect("sandbox");
    let tmp = tempfile::tempdir().unwrap();
    let agent = start(&options(&sb, tmp.path(), 1).args(["--metrics-listen", ADDR])).await;
    let mut cfg = vm("m", 5);
    cfg["private_network_throughput_mibps"] = 50.into();
    let _: VmView = agent.client().put("/v1/vms/m5", &cfg).await.expect("put");
    let host = sb.host().to_owned();

    // Ready once a full pass finished; the class counters come from a pass's converge.
    let deadline = Instant::now() + Duration::from_secs(20);
    let text = loop {
        let (status, body) = agent
            .client()
            .send_raw(Method::GET, "/metrics", None)
            .await
            .expect("scrape over the socket");
        assert_eq!(status.as_u16(), 200);
        let text = String::from_utf8(body.to_vec()).unwrap();
        if text.contains(r#"vmnet_vm_bytes_total{vm="m5",direction="download",class="private"}"#) {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "no class counters after 20 s:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(text.contains("vmnet_vms{state=\"applied\"} 1\n"), "{text}");
    assert!(
        text.contains("vmnet_vm_apply_duration_seconds_count{kind=\"create\"} 1\n"),
        "{text}"
    );
    promtool(&text);
    let h = host.clone();
    let (code, tcp_text) = tokio::task::spawn_blocking(move || http_get(&h, "/metrics"))
        .await
        .unwrap();
    assert_eq!(code, 200, "{tcp_text}");
    assert!(
        tcp_text.contains("vmnet_vms{state=\"applied\"} 1\n"),
        "{tcp_text}"
    );
    promtool(&tcp_text);
    for (path, want) in [
        ("/healthz", 200),
        ("/readyz", 200),
        ("/v1/vms", 404),
        ("/v1/status", 404),
    ] {
        let h = host.clone();
        let (code, body) = tokio::task::spawn_blocking(move || http_get(&h, path))
            .await
            .unwrap();
        assert_eq!(code, want, "GET {path} on --metrics-listen: {body}");
    }

    // Bounded: 32 idle connections hold every slot; the next is closed at once; the idle ones
    // are closed at the header timeout (5 s), and the listener serves again.
    let h = host.clone();
    tokio::task::spawn_blocking(move || {
        vmnet_kernel::netns::run_in(&h, || {
            let idle: Vec<TcpStream> = (0..32)
                .map(|_| TcpStream::connect(ADDR).expect("connect"))
                .collect();
            std::thread::sleep(Duration::from_millis(200));
            let mut extra = TcpStream::connect(ADDR).expect("connect");
            extra
                .set_read_timeout(Some(Duration::from_secs(2)))
                .unwrap();
            let mut b = [0u8; 1];
            assert!(
                matches!(extra.read(&mut b), Ok(0) | Err(_)),
                "a connection over the bound is closed at once"
            );
            let t = Instant::now();
            for mut s in idle {
                s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                let _ = s.read(&mut b);
            }
            let took = t.elapsed();
            assert!(
                took < Duration::from_secs(8),
                "idle connections closed after {took:?}"
            );
        })
        .unwrap();
    })
    .await
    .unwrap();
    let (code, _) = tokio::task::spawn_blocking(move || http_get(&host, "/healthz"))
        .await
        .unwrap();
    assert_eq!(code, 200, "serves again once the idle connections are gone");
}
