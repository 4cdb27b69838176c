//! The agent on a real kernel (root required), driven over its unix socket: bad input of every
//! kind (the host's own uplink addresses as public addresses among them) is answered with the
//! documented status and code while the VM's previous good state stays
//! applied and reachable (real TCP and UDP through NAT from a simulated guest attached to the
//! VM's tap); a route change through the API keeps the veth (same ifindex) and removing the
//! IPv4 route via host removes IPv4 reach; DELETE leaves nothing behind (the veth pair gone
//! after a short wait: the kernel may finish its teardown after the answer).

mod agent_support;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use agent_support::{links, options, start, vm};
use hyper::Method;
use serde_json::json;
use vmnet_agent::api::types::{VmState, VmView};
use vmnet_testkit::guest::{GuestConfig, GuestRoute6, SimGuest};
use vmnet_testkit::sandbox::{ECHO_PORT, ECHO_V4, HOST_UPLINK_V4, HOST_UPLINK_V6, INET_UPLINK_V4};
use vmnet_testkit::{Sandbox, netns, require_root, traffic};

const T: Duration = Duration::from_secs(3);

/// One bad request: method, path, body, expected status and code.
type Case = (Method, &'static str, Option<Vec<u8>>, u16, &'static str);

fn ifindex(ns: &str, link: &str) -> u32 {
    let out = netns::ip(ns, &["-o", "link", "show", "dev", link]).unwrap();
    out.split(':').next().unwrap().trim().parse().unwrap()
}

/// Runs `vmnet serve` on `socket` in namespace `host` with `extra` flags, a state directory
/// `socket` with the extension `state` (unless `extra` names one) and a database it cannot reach,
/// and returns how it ended (it must refuse before it needs the store).
fn agent_that_fails(socket: &std::path::Path, host: &str, extra: &[&str]) -> std::process::Output {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_vmnet"));
    if !extra.contains(&"--state-dir") {
        cmd.arg("--state-dir").arg(socket.with_extension("state"));
    }
    cmd.arg("--socket")
        .arg(socket)
        .args([
            "--database-url",
            "postgres://nobody@localhost/none?host=/nonexistent-vmnet-test",
            "serve",
            "--netns",
            host,
        ])
        .args(extra)
        .output()
        .expect("start vmnet serve")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn bad_input_keeps_the_good_state_reachable() {
    require_root();
    let sb = Sandbox::new("ab").expect("sandbox");
    let _echo = sb.start_echo().expect("echo");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_owned();
    let mut agent = start(&options(&sb, &dir, 1)).await;
    let client = agent.client().clone();

    let good = vm("b", 1);
    let view: VmView = client.put("/v1/vms/b1", &good).await.expect("put good");
    assert_eq!(view.status.state, VmState::Applied);
    let s = view.status.clone();
    let cfg = GuestConfig {
        mesh_ipv6: Some("fdaa:7::1".parse().unwrap()),
        routes_v6: vec![GuestRoute6 {
            destination: "::/0".into(),
            via: Some(vmnet_plan::ns::HOST_LINK_LOCAL),
        }],
        ..GuestConfig::default()
    };
    let guest = SimGuest::attach(&sb, "b1", &s.netns, &s.tap, &cfg).expect("guest");
    let echo = SocketAddr::new(IpAddr::V4(ECHO_V4), ECHO_PORT);
    let reply = traffic::tcp_echo(guest.netns(), echo, T).expect("tcp before");
    assert_eq!(
        reply.peer.ip(),
        IpAddr::V4(HOST_UPLINK_V4),
        "NAT to the uplink address"
    );
    traffic::udp_echo(guest.netns(), echo, T).expect("udp before");
    let veth = s.veth_host.clone().unwrap();
    let index = ifindex(&sb.host(), &veth);

    // Bad input of every kind: the documented status and code, nothing applied.
    let body = |v: serde_json::Value| Some(serde_json::to_vec(&v).unwrap());
    let mut bad_route = good.clone();
    bad_route["network"]["routes"] = json!([{"destination": "10.0.0.1/8", "via": "host"}]);
    let mut future = good.clone();
    future["wireguard"] = json!({});
    let mut other = vm("b", 1);
    other["id"] = json!("b2");
    // The host's own uplink addresses as the VM's public addresses, and a block holding one:
    // the VM would take the host's inbound traffic.
    let with = |field: &str, value: String| {
        let mut v = good.clone();
        v[field] = json!(value);
        body(v)
    };
    let host_v4 = with("public_ipv4", HOST_UPLINK_V4.to_string());
    let host_v6 = with("public_ipv6", HOST_UPLINK_V6.to_string());
    let host_block = with("public_ipv6", "2001:db8::/48".to_owned());
    let cases: Vec<Case> = vec![
        (
            Method::PUT,
            "/v1/vms/b1",
            body(bad_route),
            400,
            "INVALID_INPUT",
        ),
        (
            Method::PUT,
            "/v1/vms/b1",
            body(future),
            400,
            "INVALID_INPUT",
        ),
        (Method::PUT, "/v1/vms/b1", host_v4, 400, "INVALID_INPUT"),
        (Method::PUT, "/v1/vms/b1", host_v6, 400, "INVALID_INPUT"),
        (Method::PUT, "/v1/vms/b1", host_block, 400, "INVALID_INPUT"),
        (
            Method::PUT,
            "/v1/vms/b1",
            Some(b"{\"id\": ".to_vec()),
            400,
            "INVALID_INPUT",
        ),
        (
            Method::PUT,
            "/v1/vms/b1",
            Some(vec![b' '; 100 * 1024]),
            400,
            "INVALID_INPUT",
        ),
        (Method::PUT, "/v1/vms/b2", body(other), 409, "CONFLICT"),
        (
            Method::PUT,
            "/v1/vms/other",
            body(good.clone()),
            400,
            "INVALID_INPUT",
        ),
        (Method::GET, "/v1/vms/nope", None, 404, "NOT_FOUND"),
        (Method::DELETE, "/v1/vms/nope", None, 404, "NOT_FOUND"),
        (Method::GET, "/v1/nothing", None, 404, "NOT_FOUND"),
    ];
    for (method, path, payload, status, code) in cases {
        let (st, bytes) = client
            .send_raw(method.clone(), path, payload)
            .await
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(
            (st.as_u16(), v["error"]["code"].as_str()),
            (status, Some(code)),
            "{method} {path}: {v}"
        );
    }
    let now: VmView = client.get("/v1/vms/b1").await.unwrap();
    assert_eq!(now.status.state, VmState::Applied);
    assert_eq!(now.config, view.config);
    assert_eq!(
        ifindex(&sb.host(), &veth),
        index,
        "the veth was not touched"
    );
    traffic::tcp_echo(guest.netns(), echo, T).expect("tcp still reachable");
    traffic::udp_echo(guest.netns(), echo, T).expect("udp still reachable");

    // A route change keeps the veth; without an IPv4 route via host there is no IPv4 reach.
    let mut v6_only = good.clone();
    v6_only["network"]["routes"] = json!([{"destination": "::/0", "via": "host"}]);
    let changed: VmView = client
        .put("/v1/vms/b1", &v6_only)
        .await
        .expect("route change");
    assert_eq!(changed.status.state, VmState::Applied);
    assert_eq!(
        ifindex(&sb.host(), &veth),
        index,
        "a route change keeps the veth"
    );
    assert!(
        traffic::tcp_echo(guest.netns(), echo, Duration::from_millis(700)).is_err(),
        "no IPv4 route via host"
    );

    // DELETE removes everything the VM had: the netns at once, the veth pair when the kernel
    // has destroyed the namespace (it may finish after the answer).
    drop(guest);
    let _: VmView = client.delete("/v1/vms/b1").await.expect("delete");
    assert!(!netns::exists(&s.netns), "netns removed");
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    while links(&sb.host()).contains(&veth) {
        assert!(
            std::time::Instant::now() < deadline,
            "host veth not removed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Public addresses the host uses: its own uplink address, and its default gateway (the
    // trial's bug: accepted, and every other VM's public traffic went to that VM). Both are
    // refused with INVALID_INPUT naming the VM, the field and the use; nothing is stored.
    for (addr, what) in [
        (HOST_UPLINK_V4, "is an address of this host"),
        (INET_UPLINK_V4, "is the gateway of the host's default route"),
    ] {
        let mut bad = vm("p", 2);
        bad["public_ipv4"] = json!(addr.to_string());
        let e = client
            .put::<VmView>("/v1/vms/p2", &bad)
            .await
            .expect_err("refused");
        assert_eq!(e.code, vmnet_model::ErrorCode::InvalidInput, "{e}");
        assert!(
            e.message
                .contains(&format!("vm p2: public_ipv4 {addr} {what}")),
            "{e}"
        );
    }
    assert!(
        client.get::<VmView>("/v1/vms/p2").await.is_err(),
        "nothing stored"
    );

    // A second agent on the same socket (another state directory and prefix) is refused
    // before it touches anything: given a database it cannot reach, it still answers with the
    // socket conflict (the trial saw a
    // refused agent replace the pinned activity program before it refused).
    let second = agent_that_fails(&dir.join("vmnet.sock"), &sb.host(), &[]);
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(!second.status.success(), "{err}");
    assert!(
        err.contains("another agent is listening on it"),
        "refused for the socket first: {err}"
    );
    // A second agent on the same state directory, or with the same name prefix in the same
    // namespace, is refused as CONFLICT (exit 4) naming it and the first agent's pid, before
    // it binds its socket.
    let other_sock = dir.join("other.sock");
    let state = dir.join("state");
    let prefix = sb.agent_prefix();
    for (extra, needle) in [
        (
            vec!["--state-dir", state.to_str().unwrap()],
            format!(
                "--state-dir {}: the agent with pid {}",
                state.display(),
                agent.pid()
            ),
        ),
        (
            vec!["--name-prefix", prefix.as_str()],
            format!(
                "--name-prefix {prefix}: the agent with pid {} uses this prefix in network namespace {}",
                agent.pid(),
                sb.host()
            ),
        ),
    ] {
        let out = agent_that_fails(&other_sock, &sb.host(), &extra);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(4), "{err}");
        assert!(
            err.contains("error: CONFLICT: ") && err.contains(&needle),
            "{err}"
        );
        assert!(!other_sock.exists(), "no socket bound");
    }
    // A mistyped uplink is refused at start, naming the flag, before the agent binds its
    // socket or opens its store.
    let typo = agent_that_fails(&other_sock, &sb.host(), &["--uplink", "nosuchif0"]);
    let err = String::from_utf8_lossy(&typo.stderr);
    assert!(!typo.status.success(), "{err}");
    assert!(
        err.contains("INVALID_INPUT") && err.contains("--uplink nosuchif0: no interface"),
        "{err}"
    );
    assert!(!other_sock.exists(), "no socket bound");
    let lo = agent_that_fails(&other_sock, &sb.host(), &["--uplink", "lo"]);
    let err = String::from_utf8_lossy(&lo.stderr);
    assert!(!lo.status.success(), "{err}");
    assert!(err.contains("--uplink lo: the loopback device"), "{err}");
    client
        .get::<Vec<VmView>>("/v1/vms")
        .await
        .expect("the first agent still answers");
    assert!(agent.sigterm().expect("SIGTERM the agent").success());
}
