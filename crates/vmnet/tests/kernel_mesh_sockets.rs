//! `wireguard-go`'s UDP sockets under the agent (`vmnet serve --mesh`): the agent sizes their
//! buffers (`--wg-socket-buffer-bytes`, default 7 MiB), so TCP over the tunnel at full speed
//! loses nothing at the receiving socket (no `UdpRcvbufErrors`/`Udp6RcvbufErrors` in the
//! receiving host's namespace), and sockets the device opens again after its link flapped get
//! the same size within the agent's watch period. Sizes are read with `ss -m` in the host's
//! namespace (the kernel's own report), not only with `GET /v1/mesh`.

mod mesh_support;

use std::process::{Command, Stdio};
use std::time::Duration;

use mesh_support::{Mesh, answers, eventually};
use vmnet_kernel::wg::sockbuf::DEFAULT_BYTES;
use vmnet_testkit::{netns, udpstat};

const T: Duration = Duration::from_secs(10);

/// The receive buffers (`rb`, as `ss -uamn` shows them) of the UDP sockets bound to `port` in
/// `ns`.
fn ss_rcvbufs(ns: &str, port: u16) -> Vec<u64> {
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            ns,
            "ss",
            "-uamnH",
            "sport",
            "=",
            &format!(":{port}"),
        ])
        .output()
        .expect("ss");
    let text = String::from_utf8_lossy(&out.stdout);
    text.split("skmem:(")
        .skip(1)
        .filter_map(|m| {
            m.split(',')
                .find_map(|f| f.strip_prefix("rb"))
                .and_then(|v| v.parse().ok())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs root: builds network namespaces, runs wireguard-go and iperf3 (scripts/test.sh runs it)"]
async fn tunnel_traffic_is_not_dropped_at_the_receiving_socket_and_a_flap_keeps_the_size() {
    let m = Mesh::start(2).await;
    m.sync_all().await;
    let (a, b) = (&m.nodes[0], &m.nodes[1]);
    assert!(answers(a, b.mesh, T), "{}", b.logs());
    let want = u64::from(DEFAULT_BYTES) * 2;
    for n in [a, b] {
        let rb = ss_rcvbufs(&n.host.ns, mesh_support::PORT);
        assert!(
            !rb.is_empty() && rb.iter().all(|r| *r >= want),
            "{}: ss rb {rb:?}",
            n.host.ns
        );
        let v = n.view().await;
        assert!(
            !v.socket_buffers.is_empty()
                && v.socket_buffers
                    .iter()
                    .all(|s| s.receive_bytes >= want && s.send_bytes >= want),
            "{v:?}"
        );
    }

    // TCP at full speed from a to b's mesh address, through both wireguard-go.
    let server = Command::new("ip")
        .args(["netns", "exec", &b.host.ns, "iperf3", "-s", "-1", "-B"])
        .arg(b.mesh.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("iperf3 -s");
    let mut server = Guard(server);
    let before = udpstat::read(&b.host.ns).expect("counters");
    let mut sent = None;
    for _ in 0..20 {
        let out = netns::exec(
            &a.host.ns,
            "iperf3",
            &["-c", &b.mesh.to_string(), "-t", "3", "-J"],
            Duration::from_secs(30),
        )
        .expect("iperf3 -c");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        if let Some(bytes) = v["end"]["sum_received"]["bytes"].as_u64() {
            sent = Some((bytes, v["end"]["sum_sent"]["retransmits"].as_u64()));
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let _ = server.0.wait();
    let (bytes, retransmits) = sent.expect("iperf3 ran");
    let lost = udpstat::read(&b.host.ns).expect("counters").since(&before);
    assert!(bytes > 10 << 20, "only {bytes} bytes crossed the tunnel");
    assert_eq!(
        lost.rcvbuf(),
        0,
        "UDP datagrams dropped at the receiving socket: {lost:?} ({bytes} bytes, {retransmits:?} retransmissions)"
    );

    // A flap makes wireguard-go close its sockets and open new ones at the default size; the
    // agent's watch sizes them again.
    for state in ["down", "up"] {
        netns::ip(&b.host.ns, &["link", "set", &b.ifname, state]).expect("flap");
    }
    let sized = eventually(Duration::from_secs(5), || async {
        let rb = ss_rcvbufs(&b.host.ns, mesh_support::PORT);
        !rb.is_empty() && rb.iter().all(|r| *r >= want)
    })
    .await;
    assert!(
        sized,
        "after a flap: ss rb {:?}\n{}",
        ss_rcvbufs(&b.host.ns, mesh_support::PORT),
        b.logs()
    );
}

/// Kills the iperf3 server on drop when it is still there (a failed client run).
struct Guard(std::process::Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
