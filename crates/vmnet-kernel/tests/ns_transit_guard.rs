//! The host's guard against its VMs over IPv4 (root required): a guest with an IPv4 route via
//! host reaches the fake internet, but neither another VM's guest through that VM's transit
//! address (the namespace of a VM with a public IPv4 maps its transit address to its guest)
//! nor the host itself (its end of a veth pair, its uplink address).

mod ns_support;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use ns_support::{Env, T, vm_json};
use vmnet_testkit::echo::EchoService;
use vmnet_testkit::sandbox::{ECHO_PORT, ECHO_V4, HOST_UPLINK_V4};
use vmnet_testkit::traffic;

/// Whether a UDP echo from `ns` to `to` is answered.
fn answered(ns: &str, to: SocketAddr) -> bool {
    traffic::try_udp_echo(ns, to, Duration::from_millis(700))
        .expect("udp echo")
        .is_some()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn a_guest_reaches_neither_another_vm_by_transit_address_nor_the_host() {
    let env = Env::new();
    let routes = [("0.0.0.0/0", "host")];
    let a = env.plan(&vm_json("a", 0x51, Some("fdaa:5::51"), &routes));
    // b has a public IPv4, so its namespace maps its transit address to its guest (DNAT).
    let b = env.plan(
        r#"{"id":"b","user_id":82,"tenant":2,"mesh_ipv6":"fdaa:5::52","public_ipv4":"198.51.100.82",
        "network":{"routes":[{"destination":"0.0.0.0/0","via":"host"}]}}"#,
    );
    env.driver.apply(&a).await.expect("apply a");
    env.driver.apply(&b).await.expect("apply b");
    let _echo = env.sb.start_echo().expect("echo");
    let ga = env.guest("a", &a, &[], 1380);
    let gb = env.guest("b", &b, &[], 1380);
    assert!(
        answered(ga.netns(), SocketAddr::new(IpAddr::V4(ECHO_V4), ECHO_PORT)),
        "a reaches the fake internet"
    );

    // b's guest listens on its own address; a sends to b's transit address.
    let port = 7;
    let _svc = EchoService::start(
        gb.netns(),
        &[SocketAddr::new(
            IpAddr::V4(Ipv4Addr::new(172, 16, 0, 2)),
            port,
        )],
    )
    .expect("b's echo");
    let b_transit = b.veth.as_ref().unwrap().peer_ipv4.addr();
    assert!(
        !answered(ga.netns(), SocketAddr::new(IpAddr::V4(b_transit), port)),
        "a reached b's guest through b's transit address {b_transit}"
    );

    // The host listens on its end of a's veth pair and on its uplink address.
    let a_host_end = a.veth.as_ref().unwrap().host_ipv4.addr();
    let host = [
        SocketAddr::new(IpAddr::V4(a_host_end), port),
        SocketAddr::new(IpAddr::V4(HOST_UPLINK_V4), port),
    ];
    let _host_svc = EchoService::start(&env.sb.host(), &host).expect("host echo");
    for to in host {
        assert!(!answered(ga.netns(), to), "a reached the host at {to}");
    }
    // The same listeners answer from the fake internet's side of the uplink: only VMs are kept out.
    assert!(
        traffic::try_udp_echo(&env.sb.inet(), host[1], T)
            .expect("udp echo")
            .is_some(),
        "the uplink address answers the fake internet"
    );
}
