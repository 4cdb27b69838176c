//! Pool mode IPv6 with real packets: dual-stack guests configured from their own seeds (both
//! leases, both default routes) reach each other and the IPv6 gateway; a guest's IPv6 lease is
//! the only global IPv6 source its tap lets through. A foreign source, another guest's lease
//! and the gateway's address are seen missing at the receiver, neighbour discovery passes only
//! from the lease and the link-local address, and router advertisements never leave a guest —
//! with nftables alone, with both layers, and with the tap guard alone (flushed ruleset).

mod pool_support;

use std::net::{IpAddr, Ipv6Addr};
use std::time::Duration;

use pool_support::{Case, GATEWAY6, Guest, Lab, ping_ok};
use vmnet_model::nic::MacAddr;
use vmnet_testkit::netns as tk;
use vmnet_testkit::probe::{ALL_NODES_MAC, Capture, icmp6_frame, send_frame, udp6_frame};

/// Three dual-stack guests: `a` sends, `c` receives, `b` is the guest `a` impersonates.
async fn three_guests(lab: &mut Lab) -> (usize, usize, usize) {
    let a = lab.add_dual("inst-a", "10.0.0.2", "2001:db8:10::2").await;
    let b = lab.add_dual("inst-b", "10.0.0.3", "2001:db8:10::3").await;
    let c = lab.add_dual("inst-c", "10.0.0.4", "2001:db8:10::4").await;
    (a, b, c)
}

/// An ICMPv6 neighbour message (135 solicitation, 136 advertisement) from `src_ip` for
/// `target`, with a link-layer address option (source for 135, target for 136) `lladdr`.
fn nd(
    to: &Guest,
    from: &Guest,
    src_ip: Ipv6Addr,
    icmp_type: u8,
    target: Ipv6Addr,
    lladdr: MacAddr,
    m: &[u8],
) -> Vec<u8> {
    let mut body = target.octets().to_vec();
    body.extend([if icmp_type == 135 { 1 } else { 2 }, 1]);
    body.extend(lladdr.octets());
    body.extend(m);
    icmp6_frame(to.mac, from.mac, src_ip, to.ip6, icmp_type, &body)
}

/// Frames from `a` to `c` (or all-nodes), each spoof next to the same frame sent honestly.
/// Every check here is in both layers (the IPv6 source, `::` only for DAD and MLD, the RA and
/// redirect drops).
fn ipv6_cases(a: &Guest, b: &Guest, c: &Guest) -> Vec<Case> {
    let ports = (4000, 4001);
    let foreign: Ipv6Addr = "2001:db8:10::99".parse().unwrap();
    let foreign_ll: Ipv6Addr = "fe80::bad:1".parse().unwrap();
    let all_nodes: Ipv6Addr = "ff02::1".parse().unwrap();
    let mut out = Vec::new();
    let mut case = |name, arrives, build: &dyn Fn(&[u8]) -> Vec<u8>| {
        out.push(Case::new(name, arrives, build));
    };
    case("IPv6 from its own lease (control)", true, &|m| {
        udp6_frame(c.mac, a.mac, a.ip6, c.ip6, ports, m)
    });
    case("IPv6 from a foreign source in the range", false, &|m| {
        udp6_frame(c.mac, a.mac, foreign, c.ip6, ports, m)
    });
    case("IPv6 from another guest's lease", false, &|m| {
        udp6_frame(c.mac, a.mac, b.ip6, c.ip6, ports, m)
    });
    case("IPv6 from the gateway's address", false, &|m| {
        udp6_frame(c.mac, a.mac, GATEWAY6, c.ip6, ports, m)
    });
    case("NS from its own lease (control)", true, &|m| {
        nd(c, a, a.ip6, 135, c.ip6, a.mac, m)
    });
    case("NS from its link-local address (control)", true, &|m| {
        nd(c, a, a.ll6, 135, c.ip6, a.mac, m)
    });
    case("NS from another guest's lease", false, &|m| {
        nd(c, a, b.ip6, 135, c.ip6, a.mac, m)
    });
    case("NS from a foreign link-local address", false, &|m| {
        nd(c, a, foreign_ll, 135, c.ip6, a.mac, m)
    });
    case("NA from another guest's lease", false, &|m| {
        nd(c, a, b.ip6, 136, b.ip6, a.mac, m)
    });
    case(
        "ICMPv6 echo to all-nodes from its lease (control)",
        true,
        &|m| icmp6_frame(ALL_NODES_MAC, a.mac, a.ip6, all_nodes, 128, m),
    );
    case(
        "router advertisement from its link-local address",
        false,
        &|m| icmp6_frame(ALL_NODES_MAC, a.mac, a.ll6, all_nodes, 134, m),
    );
    case("router advertisement from its lease", false, &|m| {
        icmp6_frame(ALL_NODES_MAC, a.mac, a.ip6, all_nodes, 134, m)
    });
    out
}

/// Neighbour advertisements from `a`'s own lease: the target must be its own address with its
/// own MAC (the tap guard's check; nft 1.0.6 cannot match the target against a typed set).
fn na_target_cases(a: &Guest, b: &Guest, c: &Guest) -> Vec<Case> {
    vec![
        Case::new("NA for its own lease (control)", true, &|m| {
            nd(c, a, a.ip6, 136, a.ip6, a.mac, m)
        }),
        Case::new("NA claiming another guest's lease", false, &|m| {
            nd(c, a, a.ip6, 136, b.ip6, a.mac, m)
        }),
        Case::new("NA for its lease with a foreign MAC", false, &|m| {
            nd(c, a, a.ip6, 136, a.ip6, b.mac, m)
        }),
    ]
}

/// Sends every case from guest `a`, then waits once and asserts what `cap` saw: each spoof
/// missing, each honest frame there (so the capture is proven to work). One wait for the batch
/// keeps a pass under a second.
fn check_spoofs(a: &Guest, cases: &[Case], cap: &Capture, layer: &str) {
    for c in cases {
        send_frame(&a.ns, "eth0", &c.frame).unwrap();
    }
    for c in cases.iter().filter(|c| c.arrives) {
        assert!(
            cap.saw(&c.marker, Duration::from_secs(2)),
            "{layer}: {} must arrive",
            c.name
        );
    }
    std::thread::sleep(Duration::from_millis(300));
    for c in cases.iter().filter(|c| !c.arrives) {
        assert!(
            !cap.saw(&c.marker, Duration::ZERO),
            "{layer}: {} must drop",
            c.name
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn dual_stack_guests_and_ipv6_spoofs_with_nftables_alone() {
    let mut lab = Lab::nft_only("pv").await;
    let (a, b, c) = three_guests(&mut lab).await;
    let (ga, gb, gc) = (&lab.guests[a], &lab.guests[b], &lab.guests[c]);
    // Configured from their seeds: both families reach the peer, both gateways answer.
    assert!(ping_ok(&ga.ns, IpAddr::V6(gc.ip6)), "a → c over IPv6");
    assert!(ping_ok(&ga.ns, IpAddr::V4(gc.ip4)), "a → c over IPv4");
    assert!(ping_ok(&gc.ns, IpAddr::V6(GATEWAY6)), "c → IPv6 gateway");
    let cap = Capture::start(&gc.ns, "eth0").unwrap();
    check_spoofs(ga, &ipv6_cases(ga, gb, gc), &cap, "nftables alone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn ipv6_spoofs_with_both_layers_and_with_the_guard_alone() {
    let mut lab = Lab::new("py").await;
    let (a, b, c) = three_guests(&mut lab).await;
    let (ga, gb, gc) = (&lab.guests[a], &lab.guests[b], &lab.guests[c]);
    assert!(
        ping_ok(&ga.ns, IpAddr::V6(gc.ip6)),
        "a → c over IPv6, both layers"
    );
    let mut cases = ipv6_cases(ga, gb, gc);
    cases.extend(na_target_cases(ga, gb, gc));
    let cap = Capture::start(&gc.ns, "eth0").unwrap();
    check_spoofs(ga, &cases, &cap, "nft + guard");
    drop(cap);

    // The drift gap: the ruleset is flushed, the guard alone filters what the tap sends; what
    // passed it shows on br0 (promiscuous).
    let out = tk::exec(
        &lab.host,
        "nft",
        &["flush", "ruleset"],
        Duration::from_secs(10),
    )
    .unwrap();
    assert!(out.status.success(), "nft flush ruleset");
    let guard = lab.pool.taps.guard.as_ref().unwrap();
    let before = guard.drops().unwrap();
    tk::ip(&lab.host, &["link", "set", "br0", "promisc", "on"]).unwrap();
    let cap = Capture::start(&lab.host, "br0").unwrap();
    let mut cases = ipv6_cases(ga, gb, gc);
    cases.extend(na_target_cases(ga, gb, gc));
    check_spoofs(ga, &cases, &cap, "guard alone (flushed ruleset)");
    let after = guard.drops().unwrap();
    for reason in ["ipv6_source", "server_message"] {
        assert!(
            after[reason] > before[reason],
            "the guard counted {reason} drops: {before:?} → {after:?}"
        );
    }
}
