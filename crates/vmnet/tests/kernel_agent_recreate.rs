//! The agent on a real kernel (root required): a DELETE is answered before the kernel has
//! finished destroying the VM's devices, so a VM deleted and put again at once, 50 times in a
//! row, must come back complete and carrying real traffic (TCP over IPv4 through NAT and over
//! IPv6) each time, next to a VM that stays untouched; after deleting every VM nothing of them
//! stays on the host (netns, veth, route, rule), checked after a short wait.

mod agent_support;

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use agent_support::{links, options, start, vm};
use vmnet_agent::api::types::{VmState, VmView};
use vmnet_testkit::guest::{GuestConfig, GuestRoute6, SimGuest};
use vmnet_testkit::sandbox::{ECHO_PORT, ECHO_V4, ECHO_V6, HOST_UPLINK_V4};
use vmnet_testkit::{Sandbox, netns, require_root, traffic};

const T: Duration = Duration::from_secs(3);

/// A guest on the VM's tap with its mesh address and `::/0` via the host.
fn guest(sb: &Sandbox, name: &str, v: &VmView) -> SimGuest {
    let cfg = GuestConfig {
        mesh_ipv6: v.config.mesh_ipv6,
        routes_v6: vec![GuestRoute6 {
            destination: "::/0".into(),
            via: Some(vmnet_plan::ns::HOST_LINK_LOCAL),
        }],
        ..GuestConfig::default()
    };
    SimGuest::attach(sb, name, &v.status.netns, &v.status.tap, &cfg).expect("guest")
}

/// TCP to the echo service over IPv4 (NATed to the uplink) and IPv6.
fn reaches(g: &SimGuest, what: &str) {
    let v4 = SocketAddr::new(IpAddr::V4(ECHO_V4), ECHO_PORT);
    let r = traffic::tcp_echo(g.netns(), v4, T).unwrap_or_else(|e| panic!("{what}: v4: {e}"));
    assert_eq!(r.peer.ip(), IpAddr::V4(HOST_UPLINK_V4), "{what}: NAT");
    let v6 = SocketAddr::new(IpAddr::V6(ECHO_V6), ECHO_PORT);
    traffic::tcp_echo(g.netns(), v6, T).unwrap_or_else(|e| panic!("{what}: v6: {e}"));
}

/// What the host still shows of VMs with prefix `p`: netns, host links, rules, routes.
fn leftovers(sb: &Sandbox, p: &str) -> Vec<String> {
    let mut left: Vec<String> = netns::list(&format!("{p}n"));
    let veth = format!("{p}h");
    left.extend(
        links(&sb.host())
            .into_iter()
            .filter(|l| l.starts_with(&veth)),
    );
    for args in [
        &["-4", "route", "show", "table", "all"][..],
        &["-6", "route", "show", "table", "all"],
        &["-6", "rule", "show"],
        &["-4", "rule", "show"],
    ] {
        let out = netns::ip(&sb.host(), args).unwrap_or_default();
        left.extend(
            out.lines()
                // VM host tables start at 0x0100_0000 = 16777216.
                .filter(|l| l.contains(&veth) || l.contains("table 16777"))
                .map(str::to_owned),
        );
    }
    left
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn delete_then_put_again_50_times_leaves_nothing() {
    require_root();
    let sb = Sandbox::new("ar").expect("sandbox");
    let p = sb.agent_prefix();
    let _echo = sb.start_echo().expect("echo");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_owned();
    // Reconcile passes every second: collection runs between the deletes and puts too.
    let mut agent = start(&options(&sb, &dir, 1)).await;
    let client = agent.client().clone();

    let stays: VmView = client.put("/v1/vms/s2", &vm("s", 2)).await.expect("put s2");
    let body = vm("r", 1);
    let mut v: VmView = client.put("/v1/vms/r1", &body).await.expect("put r1");
    for i in 0..50 {
        let g = guest(&sb, &format!("g{i}"), &v);
        reaches(&g, &format!("round {i}"));
        drop(g);
        let _: VmView = client.delete("/v1/vms/r1").await.expect("delete");
        v = client
            .put("/v1/vms/r1", &body)
            .await
            .unwrap_or_else(|e| panic!("round {i}: put again: {e}\n{}", agent.log_text()));
        assert_eq!(v.status.state, VmState::Applied, "round {i}");
        let inside = links(&v.status.netns);
        assert!(
            inside.contains(&v.status.tap) && inside.contains(v.status.veth_ns.as_ref().unwrap()),
            "round {i}: {inside:?}"
        );
        let host = v.status.veth_host.clone().unwrap();
        assert!(links(&sb.host()).contains(&host), "round {i}: {host}");
    }
    let g = guest(&sb, "last", &v);
    reaches(&g, "after 50 rounds");
    drop(g);
    let stale = agent
        .log_text()
        .matches("deleted a stale host veth end")
        .count();
    eprintln!("{stale} of 50 re-creates found the previous host veth end still there");

    // The VM that stayed was never touched.
    let now: VmView = client.get("/v1/vms/s2").await.unwrap();
    assert_eq!(now.status.state, VmState::Applied);
    let g = guest(&sb, "s2", &stays);
    reaches(&g, "the VM that stayed");
    drop(g);

    for id in ["r1", "s2"] {
        let _: VmView = client.delete(&format!("/v1/vms/{id}")).await.expect(id);
    }
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let left = leftovers(&sb, &p);
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "left after deleting every VM: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(agent.sigterm().expect("SIGTERM the agent").success());
}
