//! The multi-host topology ([`vmnet_testkit::Fleet`]) with real packets: every host reaches the
//! fake internet from its uplink address and every other host's private IPv4 and IPv6 address
//! from its own; the fake internet reaches a routed public block through the host's uplink
//! address and resolves an on-link (proxy) block on the uplink itself; dropping the fleet
//! deletes every namespace it made.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use vmnet_testkit::echo::EchoService;
use vmnet_testkit::fleet::{self, PRIVATE_IF, PublicNeighbors};
use vmnet_testkit::sandbox::{ECHO_PORT, ECHO_V4, ECHO_V6};
use vmnet_testkit::{Fleet, netns, require_root, sandbox, traffic};

const T: Duration = Duration::from_secs(3);

#[test]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
fn hosts_reach_the_internet_and_each_other_and_drop_removes_every_namespace() {
    require_root();
    let fl = Fleet::new(3).expect("fleet");
    let prefix = fl.prefix().to_owned();
    let made = fleet::owned(&prefix);
    // Every namespace starts with the fleet prefix: the fake internet, the private network and
    // one per host.
    assert_eq!(made.len(), 5, "{made:?}");
    assert!(made.iter().all(|n| n.starts_with(&prefix)), "{made:?}");
    // Another fleet (or sandbox) with this prefix is refused and touches nothing.
    let again = Fleet::with_prefix(&prefix, &[PublicNeighbors::Routed]).unwrap_err();
    assert!(again.to_string().contains("exist already"), "{again}");
    assert_eq!(fleet::owned(&prefix), made);

    let _internet = fl.start_echo().expect("echo");
    let hosts = fl.hosts().to_vec();
    let services: Vec<EchoService> = hosts
        .iter()
        .map(|h| {
            EchoService::start(
                &h.ns,
                &[
                    SocketAddr::new(IpAddr::V4(h.private_v4), ECHO_PORT),
                    SocketAddr::new(IpAddr::V6(h.private_v6), ECHO_PORT),
                ],
            )
            .expect("private echo")
        })
        .collect();
    for h in &hosts {
        let v4 = SocketAddr::new(IpAddr::V4(ECHO_V4), ECHO_PORT);
        let r = traffic::tcp_echo(&h.ns, v4, T).expect("internet v4");
        assert_eq!(r.peer.ip(), IpAddr::V4(h.uplink_v4), "{}", h.ns);
        let v6 = SocketAddr::new(IpAddr::V6(ECHO_V6), ECHO_PORT);
        let r = traffic::tcp_echo(&h.ns, v6, T).expect("internet v6");
        assert_eq!(r.peer.ip(), IpAddr::V6(h.uplink_v6), "{}", h.ns);
        let link = netns::ip(&h.ns, &["link", "show", "dev", PRIVATE_IF]).expect("link");
        assert!(link.contains(" mtu 1500 "), "{link}");
        for k in hosts.iter().filter(|k| k.index != h.index) {
            for (dst, src) in [
                (IpAddr::V4(k.private_v4), IpAddr::V4(h.private_v4)),
                (IpAddr::V6(k.private_v6), IpAddr::V6(h.private_v6)),
            ] {
                let r = traffic::tcp_echo(&h.ns, SocketAddr::new(dst, ECHO_PORT), T)
                    .unwrap_or_else(|e| panic!("{} -> {dst}: {e}", h.ns));
                assert_eq!(r.peer.ip(), src, "{} -> {dst}", h.ns);
                let p = traffic::ping(&h.ns, dst, 2, T).expect("ping");
                assert_eq!((p.sent, p.received), (2, 2), "{} ping {dst}", h.ns);
            }
        }
    }
    // Every private echo service saw TCP from both other hosts, over both families.
    for s in &services {
        assert_eq!(
            s.seen().iter().filter(|x| x.tcp).count(),
            4,
            "{:?}",
            s.seen()
        );
    }
    drop(services);

    drop(fl);
    assert_eq!(fleet::leftovers(&prefix), Vec::<String>::new());
    assert_eq!(netns::list(&prefix), Vec::<String>::new());
}

#[test]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
fn public_blocks_are_routed_to_the_uplink_or_resolved_on_it() {
    require_root();
    let fl = Fleet::with_prefix(
        &sandbox::unique_prefix("f"),
        &[PublicNeighbors::Routed, PublicNeighbors::Proxy],
    )
    .expect("fleet");
    let (routed, proxy) = (&fl.hosts()[0], &fl.hosts()[1]);
    let inet = fl.inet();
    let first = |h: &fleet::HostNet| -> [IpAddr; 2] {
        [
            IpAddr::V4(h.public_v4.hosts().next().expect("a host address")),
            IpAddr::V6(h.public_v6.hosts().next().expect("a host address")),
        ]
    };
    let cidr = |a: IpAddr| format!("{a}/{}", if a.is_ipv4() { 32 } else { 128 });
    // Routed: an address of the block on the host's loopback answers through the uplink
    // address; the fake internet never resolves it as a neighbour.
    for a in first(routed) {
        netns::ip(&routed.ns, &["addr", "add", &cidr(a), "dev", "lo"]).expect("addr");
        let p = traffic::ping(&inet, a, 2, T).expect("ping");
        assert_eq!(p.received, 2, "routed {a}");
        let neigh = netns::ip(&inet, &["neigh", "show", &a.to_string()]).expect("neigh");
        assert!(neigh.trim().is_empty(), "routed {a} resolved: {neigh}");
    }
    // Proxy: the block is on-link on the uplink, so the fake internet resolves each address
    // there (ARP/NDP); it reaches one the host answers for on its uplink.
    for a in first(proxy) {
        netns::ip(&proxy.ns, &["addr", "add", &cidr(a), "dev", "uplink"]).expect("addr");
        let p = traffic::ping(&inet, a, 2, T).expect("ping");
        assert_eq!(p.received, 2, "proxy {a}");
        let neigh = netns::ip(&inet, &["neigh", "show", &a.to_string()]).expect("neigh");
        assert!(
            neigh.contains(&format!("dev {} lladdr", proxy.inet_if)),
            "proxy {a}: {neigh}"
        );
    }
    let prefix = fl.prefix().to_owned();
    drop(fl);
    assert_eq!(fleet::leftovers(&prefix), Vec::<String>::new());
}
