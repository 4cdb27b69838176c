//! Namespace mode (root required): what a VM adds to the host's IPv6 state stays minimal, since
//! the kernel walks every host IPv6 route on each link event and every same-prefix route on each
//! insert. The host veth end carries no IPv6 address (no automatic one either) and no route but
//! the VM's mesh `/128` through it: no `fe80::/64`, no local route, no `ff00::/8` (also not after
//! the kernel's link-watch work has handled the new pair's carrier). Each side reaches the other's
//! link-local through a permanent neighbour entry with the planned MAC, and IPv6 through the pair
//! works both ways. A pair made again in place (repair) is made the same way, and the read-back
//! still matches the plan.

mod ns_support;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use ns_support::{Env, T, vm_json};
use vmnet_plan::ns::VmPlan;
use vmnet_testkit::echo::EchoService;
use vmnet_testkit::sandbox::{ECHO_PORT, ECHO_V6};
use vmnet_testkit::{netns, traffic};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn the_host_veth_carries_no_ipv6_address_and_one_route() {
    let env = Env::new();
    let _echo = env.sb.start_echo().expect("echo");
    let plan = env.plan(&vm_json("h6", 7, Some("fdaa:1::7"), &[("::/0", "host")]));
    env.driver.apply(&plan).await.expect("apply");
    let host = plan.veth.as_ref().unwrap().host_name.clone();
    check_host_ipv6(&env, &plan).await;
    assert!(env.driver.drift(&plan).await.unwrap().is_empty(), "in sync");

    // The pair made again in place (its host end deleted by hand) is made the same way, and
    // the read-back matches the plan again.
    env.host_ip(&["link", "del", &host]);
    assert!(
        !env.driver.drift(&plan).await.unwrap().is_empty(),
        "drift seen"
    );
    env.driver.apply(&plan).await.expect("repair");
    check_host_ipv6(&env, &plan).await;
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
    // And the other way: the fake internet reaches the guest's mesh address.
    let mesh = SocketAddr::new(IpAddr::V6("fdaa:1::7".parse().unwrap()), 7);
    let _svc = EchoService::start(guest.netns(), &[mesh]).expect("guest echo");
    traffic::tcp_echo(&env.sb.inet(), mesh, T).expect("tcp v6 into the guest");
}

/// The host end `host` of VM 7 carries no IPv6 address and one IPv6 route, the mesh `/128`;
/// the host's entry for the netns end and the netns's for the host end are permanent, with
/// the planned MACs.
async fn check_host_ipv6(env: &Env, plan: &VmPlan) {
    // The kernel handles the carrier event of the new pair within a second (link watch).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let v = plan.veth.as_ref().unwrap();
    let host = v.host_name.as_str();
    let addrs = env.host_ip(&["-6", "-o", "addr", "show", "dev", host]);
    assert_eq!(addrs, "", "no IPv6 address on the host end");
    // The `ff00::/8` route goes when the kernel has made it (within the request, or soon after).
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let routes = loop {
        let routes = env.host_ip(&["-6", "route", "show", "table", "all", "dev", host]);
        if routes.lines().count() == 1 || std::time::Instant::now() > deadline {
            break routes;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(routes.lines().count(), 1, "one IPv6 route: {routes:?}");
    assert!(routes.starts_with("fdaa:1::7 via fe80::2"), "{routes}");
    let link = env.host_ip(&["link", "show", "dev", host]);
    assert!(link.contains("link/ether 06:01:00:00:00:07"), "{link}");
    let entry = env.host_ip(&["-6", "neigh", "show", "dev", host]);
    assert_eq!(
        entry.trim(),
        "fe80::2 lladdr 06:02:00:00:00:07 PERMANENT",
        "the host's entry for the netns end"
    );
    let entry = netns::ip(&plan.netns, &["-6", "neigh", "show", "fe80::1:7"]).unwrap();
    assert_eq!(
        entry.trim(),
        format!(
            "fe80::1:7 dev {} lladdr 06:01:00:00:00:07 PERMANENT",
            v.peer_name
        ),
        "the netns's entry for the host end"
    );
}
