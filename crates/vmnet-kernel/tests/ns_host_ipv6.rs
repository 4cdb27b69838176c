//! Namespace mode (root required): what a VM adds to the host's IPv6 state stays minimal, since
//! the kernel walks every host IPv6 route on each link event and every same-prefix route on each
//! insert. The host veth end carries only its planned link-local (no automatic one, so no
//! duplicate address detection work) as a /128 (no subnet-router anycast `fe80::` joined) and no
//! `fe80::/64` route of its own; IPv6 through it still
//! works (the mesh route's link-local gateway is named with the device). A pair made again in
//! place (repair) is made the same way, and the read-back still matches the plan.

mod ns_support;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use ns_support::{Env, T, vm_json};
use vmnet_testkit::sandbox::{ECHO_PORT, ECHO_V6};
use vmnet_testkit::traffic;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn the_host_veth_carries_only_its_planned_link_local() {
    let env = Env::new();
    let _echo = env.sb.start_echo().expect("echo");
    let plan = env.plan(&vm_json("h6", 7, Some("fdaa:1::7"), &[("::/0", "host")]));
    env.driver.apply(&plan).await.expect("apply");
    let host = plan.veth.as_ref().unwrap().host_name.clone();
    check_host_ipv6(&env, &host).await;
    assert!(env.driver.drift(&plan).await.unwrap().is_empty(), "in sync");

    // The pair made again in place (its host end deleted by hand) is made the same way, and
    // the read-back matches the plan again.
    env.host_ip(&["link", "del", &host]);
    assert!(
        !env.driver.drift(&plan).await.unwrap().is_empty(),
        "drift seen"
    );
    env.driver.apply(&plan).await.expect("repair");
    check_host_ipv6(&env, &host).await;
    assert!(
        env.driver.drift(&plan).await.unwrap().is_empty(),
        "in sync after the repair"
    );

    let guest = env.guest("h6", &plan, &["::/0"], 1500);
    traffic::tcp_echo(
        guest.netns(),
        SocketAddr::new(IpAddr::V6(ECHO_V6), ECHO_PORT),
        T,
    )
    .expect("tcp v6 through the host veth");
}

/// The host end `host` of VM 7 carries one IPv6 address, its planned link-local `/128` without a
/// prefix route, and the host has no `fe80::/64` route and no `fe80::` anycast through it.
async fn check_host_ipv6(env: &Env, host: &str) {
    // The kernel handles the carrier event of the new pair within a second (link watch).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let addrs = env.host_ip(&["-6", "-o", "addr", "show", "dev", host]);
    let lines: Vec<&str> = addrs.lines().collect();
    assert_eq!(lines.len(), 1, "one IPv6 address: {addrs}");
    assert!(
        lines[0].contains("fe80::1:7/128") && lines[0].contains("noprefixroute"),
        "{addrs}"
    );
    let routes = env.host_ip(&["-6", "route", "show", "table", "all", "dev", host]);
    assert!(
        !routes.contains("fe80::/64") && !routes.contains("anycast fe80::"),
        "no fe80::/64 route and no subnet-router anycast per VM: {routes}"
    );
    assert!(routes.contains("fdaa:1::7 via fe80::2"), "{routes}");
}
