//! Public addresses in namespace mode with real packets (root required): the fake internet
//! routes 198.51.100.64/26 and 2001:db8:7::/48 to the sandbox host (the "routed" upstream), the
//! driver maps each VM's public IPv4 (DNAT/SNAT), public /128 (to the mesh address) and routes a
//! public block into the VM.

mod ns_support;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use ns_support::{Env, T, v6};
use vmnet_plan::ns::VmPlan;
use vmnet_testkit::echo::EchoService;
use vmnet_testkit::guest::GUEST_IF;
use vmnet_testkit::guest::SimGuest;
use vmnet_testkit::sandbox::{
    ECHO_PORT, ECHO_V4, ECHO_V6, HOST_UPLINK_V4, HOST_UPLINK_V6, INET_UPLINK_V4, INET_UPLINK_V6,
};
use vmnet_testkit::{netns, traffic};

const PORT: u16 = 7;

fn v4(s: &str) -> Ipv4Addr {
    s.parse().expect("address")
}

/// The sandbox's fake internet routes the public ranges of these tests to the host.
fn route_public_ranges(env: &Env) {
    let inet = env.sb.inet();
    netns::ip(
        &inet,
        &[
            "route",
            "add",
            "198.51.100.64/26",
            "via",
            &HOST_UPLINK_V4.to_string(),
        ],
    )
    .expect("route v4");
    netns::ip(
        &inet,
        &[
            "-6",
            "route",
            "add",
            "2001:db8:7::/48",
            "via",
            &HOST_UPLINK_V6.to_string(),
        ],
    )
    .expect("route v6");
}

/// A VM with routes via host for both families and the given public fields (JSON fragment).
fn public_vm(env: &Env, id: &str, uid: u32, public: &str) -> VmPlan {
    env.plan(&format!(
        r#"{{"id":"{id}","user_id":{uid},"tenant":1,"mesh_ipv6":"fdaa:1::{uid:x}"{public},
        "network":{{"routes":[{{"destination":"0.0.0.0/0","via":"host"}},{{"destination":"::/0","via":"host"}}]}}}}"#
    ))
}

/// A guest with an echo service on its IPv4 and its mesh address (port 7).
fn guest_with_echo(env: &Env, name: &str, plan: &VmPlan) -> (SimGuest, EchoService) {
    let g = env.guest(name, plan, &["::/0"], 1380);
    let mesh = plan.guest.mesh_ipv6.expect("mesh");
    let svc = EchoService::start(
        g.netns(),
        &[
            SocketAddr::new(IpAddr::V4(v4("172.16.0.2")), PORT),
            SocketAddr::new(IpAddr::V6(mesh), PORT),
        ],
    )
    .expect("guest echo");
    (g, svc)
}

fn at(ip: IpAddr) -> SocketAddr {
    SocketAddr::new(ip, PORT)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn public_ipv4_and_ipv6_reach_the_guest_with_the_client_source_and_the_guest_leaves_from_them()
 {
    let env = Env::new();
    route_public_ranges(&env);
    let _echo = env.sb.start_echo().expect("echo");
    let plan = public_vm(
        &env,
        "web",
        1,
        r#","public_ipv4":"198.51.100.71","public_ipv6":"2001:db8:7::71""#,
    );
    env.driver.apply(&plan).await.expect("apply");
    let (guest, svc) = guest_with_echo(&env, "web", &plan);
    let inet = env.sb.inet();
    let pub4 = IpAddr::V4(v4("198.51.100.71"));
    let pub6 = IpAddr::V6(v6("2001:db8:7::71"));

    // Inbound, TCP and UDP: the guest sees the client's own address.
    let tcp = traffic::tcp_echo(&inet, at(pub4), T).expect("inet → public v4 tcp");
    assert_eq!(
        tcp.peer.ip(),
        IpAddr::V4(INET_UPLINK_V4),
        "client source kept"
    );
    let udp = traffic::udp_echo(&inet, at(pub4), T).expect("inet → public v4 udp");
    assert_eq!(udp.peer.ip(), IpAddr::V4(INET_UPLINK_V4));
    let tcp6 = traffic::tcp_echo(&inet, at(pub6), T).expect("inet → public /128 tcp");
    assert_eq!(tcp6.peer.ip(), IpAddr::V6(INET_UPLINK_V6));
    let udp6 = traffic::udp_echo(&inet, at(pub6), T).expect("inet → public /128 udp");
    assert_eq!(udp6.peer.ip(), IpAddr::V6(INET_UPLINK_V6));
    assert!(
        svc.seen()
            .iter()
            .any(|s| s.local.ip() == IpAddr::V6(plan.guest.mesh_ipv6.unwrap())),
        "the /128 arrives at the unconfigured guest's mesh address"
    );

    // Outbound: the far end sees the public addresses, not the uplink's masquerade.
    let out4 = traffic::tcp_echo(
        guest.netns(),
        SocketAddr::new(IpAddr::V4(ECHO_V4), ECHO_PORT),
        T,
    )
    .expect("guest → internet v4");
    assert_eq!(out4.peer.ip(), pub4, "SNAT to the public IPv4");
    let out4u = traffic::udp_echo(
        guest.netns(),
        SocketAddr::new(IpAddr::V4(ECHO_V4), ECHO_PORT),
        T,
    )
    .expect("guest → internet v4 udp");
    assert_eq!(out4u.peer.ip(), pub4);
    let out6 = traffic::tcp_echo(
        guest.netns(),
        SocketAddr::new(IpAddr::V6(ECHO_V6), ECHO_PORT),
        T,
    )
    .expect("guest → internet v6");
    assert_eq!(out6.peer.ip(), pub6, "SNAT to the public /128");

    // The VM reaches its own public addresses (through the host).
    let own4 = traffic::tcp_echo(guest.netns(), at(pub4), T).expect("guest → own public v4");
    assert_eq!(own4.peer.ip(), pub4);
    let own6 = traffic::tcp_echo(guest.netns(), at(pub6), T).expect("guest → own public v6");
    assert_eq!(own6.peer.ip(), pub6);

    // A second VM on this host reaches the first through its public addresses and is seen with
    // its own.
    let plan2 = public_vm(
        &env,
        "api",
        2,
        r#","public_ipv4":"198.51.100.72","public_ipv6":"2001:db8:7::72""#,
    );
    env.driver.apply(&plan2).await.expect("apply 2");
    let (guest2, _svc2) = guest_with_echo(&env, "api", &plan2);
    let vv4 = traffic::tcp_echo(guest2.netns(), at(pub4), T).expect("vm2 → vm1 public v4");
    assert_eq!(vv4.peer.ip(), IpAddr::V4(v4("198.51.100.72")));
    let vv6 = traffic::tcp_echo(guest2.netns(), at(pub6), T).expect("vm2 → vm1 public v6");
    assert_eq!(vv6.peer.ip(), IpAddr::V6(v6("2001:db8:7::72")));

    // A second apply changes nothing; the drift report is empty.
    assert_eq!(env.driver.apply(&plan).await.expect("re-apply"), vec![]);
    assert_eq!(env.driver.drift(&plan).await.expect("drift"), vec![]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn a_public_block_is_routed_to_the_guest_which_answers_from_its_own_address() {
    let env = Env::new();
    route_public_ranges(&env);
    let _echo = env.sb.start_echo().expect("echo");
    let plan = public_vm(&env, "blk", 3, r#","public_ipv6":"2001:db8:7:100::/56""#);
    env.driver.apply(&plan).await.expect("apply");
    let guest = env.guest("blk", &plan, &["::/0"], 1380);
    let mine = v6("2001:db8:7:100::5");
    netns::ip(
        guest.netns(),
        &[
            "-6",
            "addr",
            "add",
            "2001:db8:7:100::5/56",
            "dev",
            GUEST_IF,
            "nodad",
        ],
    )
    .expect("guest address in its block");
    let _svc = EchoService::start(guest.netns(), &[SocketAddr::new(IpAddr::V6(mine), PORT)])
        .expect("guest echo");
    let r = traffic::tcp_echo(&env.sb.inet(), at(IpAddr::V6(mine)), T).expect("inet → block");
    assert_eq!(r.peer.ip(), IpAddr::V6(INET_UPLINK_V6));
    // The guest's own connection from its block address leaves untranslated.
    netns::ip(
        guest.netns(),
        &[
            "-6",
            "route",
            "replace",
            "::/0",
            "via",
            "fe80::1",
            "dev",
            GUEST_IF,
            "src",
            "2001:db8:7:100::5",
        ],
    )
    .expect("guest source address");
    let out = traffic::tcp_echo(
        guest.netns(),
        SocketAddr::new(IpAddr::V6(ECHO_V6), ECHO_PORT),
        T,
    )
    .expect("guest → internet from its block");
    assert_eq!(
        out.peer.ip(),
        IpAddr::V6(mine),
        "answers from its block address, no SNAT"
    );
    // Removing the VM leaves no route for the block on the host.
    env.driver.remove(3).await.expect("remove");
    let routes = env.host_ip(&["-6", "route", "show", "2001:db8:7:100::/56"]);
    assert!(routes.trim().is_empty(), "{routes}");
}

/// The change the agent makes when only the public addresses change (`apply_public`): the
/// mapping moves with real packets, as one DNAT rule batch, and leaves the VM exactly as a full
/// apply of the new plan would (nothing left to change, no drift).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn a_public_address_change_alone_moves_the_mapping_in_place() {
    let env = Env::new();
    route_public_ranges(&env);
    let _echo = env.sb.start_echo().expect("echo");
    let addrs =
        |n: u8| format!(r#","public_ipv4":"198.51.100.{n}","public_ipv6":"2001:db8:7::{n}""#);
    let with = public_vm(&env, "web", 1, &addrs(71));
    env.driver.apply(&with).await.expect("apply");
    let (guest, _svc) = guest_with_echo(&env, "web", &with);
    let inet = env.sb.inet();
    let short = std::time::Duration::from_millis(700);
    let reach = |ip: &str| traffic::tcp_echo(&inet, at(ip.parse().unwrap()), short);
    reach("198.51.100.71").expect("mapped");

    // Removed: neither address answers any more; the VM is as a full apply would make it.
    let without = public_vm(&env, "web", 1, "");
    let changes = env.driver.apply_public(&without).await.expect("remove");
    assert!(
        changes
            .iter()
            .any(|c| format!("{c:?}").contains("one rule batch")),
        "the DNAT rule went in as a rule batch: {changes:?}"
    );
    assert!(reach("198.51.100.71").is_err(), "the old IPv4 is unmapped");
    assert!(reach("2001:db8:7::71").is_err(), "the old /128 is unmapped");
    assert_eq!(env.driver.drift(&without).await.expect("drift"), vec![]);

    // Another pair of addresses: reached with the client's own source, and the guest leaves
    // from the new IPv4.
    let moved = public_vm(&env, "web", 1, &addrs(75));
    env.driver.apply_public(&moved).await.expect("add");
    let tcp = reach("198.51.100.75").expect("the new IPv4 is mapped");
    assert_eq!(tcp.peer.ip(), IpAddr::V4(INET_UPLINK_V4));
    reach("2001:db8:7::75").expect("the new /128 is mapped");
    assert!(reach("198.51.100.71").is_err());
    let out = traffic::tcp_echo(
        guest.netns(),
        SocketAddr::new(IpAddr::V4(ECHO_V4), ECHO_PORT),
        T,
    )
    .expect("guest → internet");
    assert_eq!(out.peer.ip(), IpAddr::V4(v4("198.51.100.75")));
    assert_eq!(env.driver.drift(&moved).await.expect("drift"), vec![]);
    assert_eq!(env.driver.apply(&moved).await.expect("re-apply"), vec![]);

    // The VM's user id changes and it keeps its addresses and mesh address, as the agent does
    // it: the new user id applied while the old one's entries still hold the public keys, then
    // the old one released and removed. Both addresses reach the guest on the new user id's
    // tap, and nothing drifts.
    drop(guest);
    let renamed = env.plan(
        r#"{"id":"web","user_id":2,"tenant":1,"mesh_ipv6":"fdaa:1::1","public_ipv4":"198.51.100.75",
        "public_ipv6":"2001:db8:7::75",
        "network":{"routes":[{"destination":"0.0.0.0/0","via":"host"},{"destination":"::/0","via":"host"}]}}"#,
    );
    env.driver
        .apply(&renamed)
        .await
        .expect("the new user id takes the public keys over");
    env.driver.release_public(1).expect("release");
    env.driver.remove(1).await.expect("remove the old user id");
    let (_guest2, _svc2) = guest_with_echo(&env, "web2", &renamed);
    reach("198.51.100.75").expect("the IPv4 reaches the new user id's guest");
    reach("2001:db8:7::75").expect("the /128 reaches the new user id's guest");
    assert_eq!(env.driver.drift(&renamed).await.expect("drift"), vec![]);
}
