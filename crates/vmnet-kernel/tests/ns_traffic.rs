//! Namespace mode with real packets (root required): NAT to the fake internet over TCP and UDP,
//! MSS clamping both ways, veth MTU, no IPv4 route → no reach and no NAT, guest ↔ guest over the
//! mesh, a gateway-VM route delivering to the gateway's guest, and VMs created back to back in
//! namespaces made ahead forwarding as one made at create, with no automatic IPv6 link-local.
//! Each guest is a namespace joined to the VM's tap by the testkit's frame relay (the real tap
//! path).

mod ns_support;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use ns_support::{Env, T, link_info, nft_ruleset, v6, vm_json};
use vmnet_kernel::ns::Change;
use vmnet_testkit::echo::EchoService;
use vmnet_testkit::sandbox::{ECHO_PORT, ECHO_V4, ECHO_V6, HOST_UPLINK_V4};
use vmnet_testkit::{netns, traffic};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn guest_reaches_internet_through_nat_with_clamped_mss() {
    let env = Env::new();
    let plan = env.plan(&vm_json(
        "web",
        1,
        Some("fdaa:1::1"),
        &[("0.0.0.0/0", "host"), ("::/0", "host")],
    ));
    let changes = env.driver.apply(&plan).await.expect("apply");
    assert!(!changes.is_empty());
    let _echo = env.sb.start_echo().expect("echo");
    // The guest's eth0 has MTU 1500, so its SYNs carry MSS 1460 (IPv4) / 1440 (IPv6): anything
    // smaller at the far end is the namespace's clamp.
    let guest = env.guest("web", &plan, &["::/0"], 1500);

    let tcp = traffic::tcp_echo(
        guest.netns(),
        SocketAddr::new(IpAddr::V4(ECHO_V4), ECHO_PORT),
        T,
    )
    .expect("tcp v4");
    assert_eq!(
        tcp.peer.ip(),
        IpAddr::V4(HOST_UPLINK_V4),
        "far end sees the sandbox uplink address"
    );
    assert_eq!(tcp.syn_mss, Some(1340), "IPv4 MSS clamped to 1380 - 40");
    let udp = traffic::udp_echo(
        guest.netns(),
        SocketAddr::new(IpAddr::V4(ECHO_V4), ECHO_PORT),
        T,
    )
    .expect("udp v4");
    assert_eq!(udp.peer.ip(), IpAddr::V4(HOST_UPLINK_V4));

    let tcp6 = traffic::tcp_echo(
        guest.netns(),
        SocketAddr::new(IpAddr::V6(ECHO_V6), ECHO_PORT),
        T,
    )
    .expect("tcp v6");
    assert_eq!(
        tcp6.peer.ip(),
        IpAddr::V6(v6("fdaa:1::1")),
        "IPv6 leaves with the mesh address, no NAT"
    );
    assert_eq!(tcp6.syn_mss, Some(1320), "IPv6 MSS clamped to 1380 - 60");

    // The other direction: the fake internet connects to the guest's mesh address; the SYN
    // from the internet (MSS 1440) arrives clamped.
    let svc = EchoService::start(
        guest.netns(),
        &[SocketAddr::new(IpAddr::V6(v6("fdaa:1::1")), 7)],
    )
    .expect("guest echo");
    let back = traffic::tcp_echo(
        &env.sb.inet(),
        SocketAddr::new(IpAddr::V6(v6("fdaa:1::1")), 7),
        T,
    )
    .expect("inet → guest");
    assert_eq!(back.syn_mss, Some(1320));
    drop(svc);

    let v = plan.veth.as_ref().unwrap();
    assert_eq!(
        link_info(&env.sb.host(), &v.host_name).map(|l| l.0),
        Some(1380),
        "host veth MTU"
    );
    assert_eq!(
        link_info(&plan.netns, &v.peer_name).map(|l| l.0),
        Some(1380),
        "peer veth MTU"
    );
    assert_eq!(
        link_info(&plan.netns, &plan.tap.name).map(|l| l.0),
        Some(1380),
        "tap MTU"
    );
    assert!(
        nft_ruleset(&plan.netns).contains("snat ip to 10.200.0.6"),
        "{}",
        nft_ruleset(&plan.netns)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn without_an_ipv4_route_via_host_there_is_no_ipv4_reach_and_no_nat() {
    let env = Env::new();
    let plan = env.plan(&vm_json("quiet", 2, Some("fdaa:1::2"), &[]));
    env.driver.apply(&plan).await.expect("apply");
    let _echo = env.sb.start_echo().expect("echo");
    let guest = env.guest("quiet", &plan, &["fdaa::/16"], 1380);
    let to = |ip| SocketAddr::new(ip, ECHO_PORT);
    assert!(
        traffic::try_tcp_echo(guest.netns(), to(IpAddr::V4(ECHO_V4)), T)
            .unwrap()
            .is_none(),
        "IPv4 must not leave"
    );
    assert!(
        traffic::try_udp_echo(guest.netns(), to(IpAddr::V4(ECHO_V4)), T)
            .unwrap()
            .is_none(),
        "IPv4 must not leave"
    );
    // IPv6 to the internet needs a route too: the namespace only routes the mesh.
    assert!(
        traffic::try_tcp_echo(guest.netns(), to(IpAddr::V6(ECHO_V6)), T)
            .unwrap()
            .is_none(),
        "no IPv6 route either"
    );
    let rules = nft_ruleset(&plan.netns);
    assert!(
        !rules.contains("nat"),
        "no NAT chain without an IPv4 route via host:\n{rules}"
    );
    assert!(
        rules.contains("maxseg size set 1340"),
        "MSS clamp still there:\n{rules}"
    );
    // The guest itself is up: its gateway on the tap answers.
    let p = traffic::ping(
        guest.netns(),
        IpAddr::V4(Ipv4Addr::new(172, 16, 0, 1)),
        1,
        T,
    )
    .expect("ping gw");
    assert_eq!(p.received, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn an_ipv4_route_reaches_only_its_destination() {
    let env = Env::new();
    let plan = env.plan(&vm_json(
        "narrow",
        3,
        Some("fdaa:1::3"),
        &[("198.51.100.0/24", "host")],
    ));
    env.driver.apply(&plan).await.expect("apply");
    let _echo = env.sb.start_echo().expect("echo");
    let guest = env.guest("narrow", &plan, &[], 1380);
    let r = traffic::tcp_echo(
        guest.netns(),
        SocketAddr::new(IpAddr::V4(ECHO_V4), ECHO_PORT),
        T,
    )
    .expect("in the route");
    assert_eq!(r.peer.ip(), IpAddr::V4(HOST_UPLINK_V4));
    // The fake internet's own uplink address answers ping, but is outside the VM's route.
    let out = traffic::ping(
        guest.netns(),
        IpAddr::V4(Ipv4Addr::new(203, 0, 113, 1)),
        1,
        T,
    )
    .expect("ping");
    assert_eq!(out.received, 0, "203.0.113.1 is not routed for this VM");
    let p = traffic::ping(
        &env.sb.host(),
        IpAddr::V4(Ipv4Addr::new(203, 0, 113, 1)),
        1,
        T,
    )
    .expect("ping");
    assert_eq!(p.received, 1, "while the host itself reaches it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn mesh_between_guests_and_gateway_vm_route() {
    let env = Env::new();
    // gw routes everything IPv6 via host; client sends 2000::/3 to gw's mesh address; lonely has no routes.
    let gw = env.plan(&vm_json(
        "gw",
        0x10,
        Some("fdaa:0:1::10"),
        &[("::/0", "host")],
    ));
    // The client also routes the echo service's /48 via host: longest prefix wins over 2000::/3.
    let client = env.plan(&vm_json(
        "client",
        0x11,
        Some("fdaa:0:1::11"),
        &[("2000::/3", "fdaa:0:1::10"), ("2001:db8:100::/48", "host")],
    ));
    let lonely = env.plan(&vm_json("lonely", 0x12, Some("fdaa:0:1::12"), &[]));
    for p in [&gw, &client, &lonely] {
        env.driver.apply(p).await.expect("apply");
    }
    let g_gw = env.guest("gw", &gw, &["::/0"], 1380);
    let g_client = env.guest("client", &client, &["fdaa::/16", "2000::/3"], 1380);
    let g_lonely = env.guest("lonely", &lonely, &["fdaa::/16", "2000::/3"], 1380);

    // Guest ↔ guest over the mesh.
    let svc_gw = EchoService::start(
        g_gw.netns(),
        &[SocketAddr::new(IpAddr::V6(v6("fdaa:0:1::10")), 7)],
    )
    .unwrap();
    let svc_lonely = EchoService::start(
        g_lonely.netns(),
        &[SocketAddr::new(IpAddr::V6(v6("fdaa:0:1::12")), 7)],
    )
    .unwrap();
    let r = traffic::tcp_echo(
        g_client.netns(),
        SocketAddr::new(IpAddr::V6(v6("fdaa:0:1::10")), 7),
        T,
    )
    .expect("client → gw mesh");
    assert_eq!(r.peer.ip(), IpAddr::V6(v6("fdaa:0:1::11")));
    let r = traffic::udp_echo(
        g_gw.netns(),
        SocketAddr::new(IpAddr::V6(v6("fdaa:0:1::12")), 7),
        T,
    )
    .expect("gw → lonely mesh");
    assert_eq!(r.peer.ip(), IpAddr::V6(v6("fdaa:0:1::10")));
    drop((svc_gw, svc_lonely));

    // The gateway VM route: the gateway's guest owns 2001:db8:77::1 (standing in for what it
    // forwards); the client's packets to 2000::/3 are delivered there.
    netns::ip(
        g_gw.netns(),
        &["-6", "addr", "add", "2001:db8:77::1/128", "dev", "lo"],
    )
    .unwrap();
    let far = SocketAddr::new(IpAddr::V6(v6("2001:db8:77::1")), 7);
    let svc = EchoService::start(g_gw.netns(), &[far]).unwrap();
    let r = traffic::tcp_echo(g_client.netns(), far, T).expect("client → 2000::/3 via gateway VM");
    assert_eq!(
        r.peer.ip(),
        IpAddr::V6(v6("fdaa:0:1::11")),
        "delivered to the gateway's guest from the client"
    );
    // The more specific host route takes the echo service's /48 out through the uplink.
    let _echo = env.sb.start_echo().unwrap();
    let r = traffic::tcp_echo(
        g_client.netns(),
        SocketAddr::new(IpAddr::V6(ECHO_V6), ECHO_PORT),
        T,
    )
    .expect("client → internet via host (more specific than the gateway route)");
    assert_eq!(r.peer.ip(), IpAddr::V6(v6("fdaa:0:1::11")));
    // A VM without that route does not get there (its namespace has no route for 2000::/3).
    assert!(
        traffic::try_tcp_echo(g_lonely.netns(), far, T)
            .unwrap()
            .is_none()
    );
    drop(svc);

    // The client's route via the gateway deleted from its host table by hand: the drift report
    // names the gateway's host veth end it routes through (another VM's link), not its index.
    let table = (env.settings.host_table_base + 0x11).to_string();
    env.host_ip(&["-6", "route", "del", "2000::/3", "table", &table]);
    let drift = env.driver.drift(&client).await.unwrap();
    let gw_veth = &gw.veth.as_ref().unwrap().host_name;
    assert!(
        drift.iter().any(|c| matches!(c, Change::AddRoute(_, what)
            if what.starts_with("2000::/3 ") && what.ends_with(&format!("dev {gw_veth}")))),
        "{drift:?}"
    );
    env.driver.apply(&client).await.expect("repair");
    assert!(env.driver.drift(&client).await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn host_masquerade_flushed_behind_our_back_is_reported_and_repaired() {
    let env = Env::new();
    let plan = env.plan(&vm_json(
        "hn",
        0x61,
        Some("fdaa:6::61"),
        &[("0.0.0.0/0", "host")],
    ));
    env.driver.apply(&plan).await.expect("apply");
    let _echo = env.sb.start_echo().expect("echo");
    let guest = env.guest("hn", &plan, &["fdaa::/16"], 1380);
    let echo = SocketAddr::new(IpAddr::V4(ECHO_V4), ECHO_PORT);
    // Each echo binds a new source port: a new conntrack entry, so NAT is decided afresh.
    let masqueraded = |when: &str| {
        let r = traffic::udp_echo(guest.netns(), echo, T).expect(when);
        assert_eq!(r.peer.ip(), IpAddr::V4(HOST_UPLINK_V4), "{when}");
    };
    masqueraded("before");

    let host = env.sb.host();
    let table = format!("{}_host", env.settings.name_prefix);
    let flush = || {
        let out = netns::exec(&host, "nft", &["flush", "table", "ip", &table], T).unwrap();
        assert!(out.status.success(), "{out:?}");
        assert!(!nft_ruleset(&host).contains("masquerade"));
    };
    flush();
    let lost = traffic::try_udp_echo(guest.netns(), echo, Duration::from_millis(500)).unwrap();
    assert!(
        lost.as_ref()
            .is_none_or(|r| r.peer.ip() != IpAddr::V4(HOST_UPLINK_V4)),
        "no masquerade without the rule: {lost:?}"
    );

    // The table still exists, but its content differs: that is drift.
    let drift = env.driver.drift(&plan).await.unwrap();
    assert!(
        drift.iter().any(
            |c| matches!(c, Change::Repair { what } if what.contains(&table) && what.contains("postrouting"))
        ),
        "{drift:?}"
    );
    // The next apply repairs it.
    env.driver.apply(&plan).await.expect("apply after drift");
    assert!(nft_ruleset(&host).contains("masquerade"));
    assert!(env.driver.drift(&plan).await.unwrap().is_empty());
    masqueraded("after the apply");

    // Without a drift report, the reconcile pass's collection re-checks and repairs it too.
    flush();
    assert_eq!(env.driver.gc(&[0x61]).await.unwrap(), Vec::<u32>::new());
    assert!(nft_ruleset(&host).contains("masquerade"));
    masqueraded("after gc");
    assert!(env.driver.drift(&plan).await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn vms_created_back_to_back_in_namespaces_made_ahead_forward() {
    let env = Env::new();
    let _echo = env.sb.start_echo().expect("echo");
    // The first create makes its namespace; each one after it gets the one made ahead after
    // the create before (loopback up and forwarding on, written by the driver's spare thread).
    let plans: Vec<_> = (0x71..0x74)
        .map(|u| {
            let routes = [("0.0.0.0/0", "host"), ("::/0", "host")];
            let plan = env.plan(&vm_json(
                &format!("b{u:x}"),
                u,
                Some(&format!("fdaa:7::{u:x}")),
                &routes,
            ));
            (u, plan)
        })
        .collect();
    for (_, plan) in &plans {
        env.driver.apply(plan).await.expect("apply");
    }
    for (u, plan) in &plans {
        let lo = netns::ip(&plan.netns, &["-o", "link", "show", "lo"]).unwrap();
        assert!(lo.contains("UP"), "vm {u:#x}: lo not up: {lo}");
        for key in ["net/ipv4/ip_forward", "net/ipv6/conf/all/forwarding"] {
            assert_eq!(
                netns::sysctl_get(&plan.netns, key).unwrap(),
                "1",
                "vm {u:#x}: {key}"
            );
        }
        assert!(
            env.driver.drift(plan).await.unwrap().is_empty(),
            "vm {u:#x}"
        );
        // Forwarded through the VM's namespace both ways, IPv4 (NAT) and IPv6.
        let guest = env.guest(&format!("g{u:x}"), plan, &["::/0"], 1500);
        for to in [IpAddr::V4(ECHO_V4), IpAddr::V6(ECHO_V6)] {
            traffic::tcp_echo(guest.netns(), SocketAddr::new(to, ECHO_PORT), T)
                .unwrap_or_else(|e| panic!("vm {u:#x}: tcp to {to}: {e}"));
        }
    }
}
