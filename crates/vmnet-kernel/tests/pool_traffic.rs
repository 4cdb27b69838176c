//! Pool mode with real packets: two guests on the sandbox host's bridge, relayed from their
//! persistent taps; legitimate traffic passes, each spoof is seen missing at the receiver while
//! the same frame sent honestly arrives (so the capture is proven to work).

mod pool_support;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use pool_support::{GATEWAY, Lab, marker, ping_ok};
use vmnet_kernel::pool::probe::{
    ALL_NODES_MAC, BROADCAST, Capture, arp_reply_frame, icmp6_frame, send_frame, udp4_frame,
    udp6_frame,
};
use vmnet_model::nic::{MacAddr, NetworkPolicy};
use vmnet_testkit::sandbox::{ECHO_V4, HOST_UPLINK_V4};

const SHORT: Duration = Duration::from_millis(600);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guests_pass_and_spoofs_are_dropped() {
    let mut lab = Lab::new("pa").await;
    let a = lab
        .add("inst-a", "10.0.0.2", NetworkPolicy::Public, false)
        .await;
    let b = lab
        .add("inst-b", "10.0.0.3", NetworkPolicy::Public, false)
        .await;
    let (ga, gb) = (&lab.guests[a], &lab.guests[b]);

    // Correct traffic: guest to guest, guest to gateway, guest through the gateway.
    assert!(ping_ok(&ga.ns, IpAddr::V4(gb.ip4)), "a → b");
    assert!(ping_ok(&gb.ns, IpAddr::V4(GATEWAY)), "b → gateway");
    assert!(ping_ok(&ga.ns, IpAddr::V6(gb.ll6)) || ping_ok(&ga.ns, IpAddr::V4(gb.ip4)));
    assert!(
        ping_ok(&ga.ns, IpAddr::V4(ECHO_V4)),
        "a → internet via gateway"
    );
    // The host's own (non-gateway) address is not reachable.
    assert!(
        !ping_ok(&ga.ns, IpAddr::V4(HOST_UPLINK_V4)),
        "a → host uplink address must drop"
    );

    let cap = Capture::start(&gb.ns, "eth0").unwrap();
    let foreign_mac = MacAddr([0x02, 0xde, 0xad, 0xbe, 0xef, 0x01]);
    let send = |f: Vec<u8>| send_frame(&ga.ns, "eth0", &f).unwrap();
    let ports = (4000, 4001);

    // Source MAC: honest arrives, foreign does not.
    let m = marker("mac-ok");
    send(udp4_frame(gb.mac, ga.mac, ga.ip4, gb.ip4, ports, &m));
    assert!(cap.saw(&m, SHORT), "honest IPv4 frame must arrive");
    let m = marker("mac-foreign");
    send(udp4_frame(gb.mac, foreign_mac, ga.ip4, gb.ip4, ports, &m));
    assert!(!cap.saw(&m, SHORT), "foreign source MAC must drop");

    // IPv4 source.
    let m = marker("ip4-foreign");
    send(udp4_frame(
        gb.mac,
        ga.mac,
        Ipv4Addr::new(10, 0, 0, 5),
        gb.ip4,
        ports,
        &m,
    ));
    assert!(!cap.saw(&m, SHORT), "foreign IPv4 source must drop");

    // IPv6 source: the EUI-64 link-local passes, another does not.
    let m = marker("ip6-ok");
    send(udp6_frame(gb.mac, ga.mac, ga.ll6, gb.ll6, ports, &m));
    assert!(cap.saw(&m, SHORT), "own link-local IPv6 must arrive");
    let m = marker("ip6-foreign");
    send(udp6_frame(
        gb.mac,
        ga.mac,
        "fe80::bad:1".parse::<Ipv6Addr>().unwrap(),
        gb.ll6,
        ports,
        &m,
    ));
    assert!(!cap.saw(&m, SHORT), "foreign IPv6 source must drop");

    // ARP: an honest reply arrives; a forged one (claiming b's or the gateway's address, or with
    // another sender MAC) does not.
    let m = marker("arp-ok");
    send(arp_reply_frame(
        gb.mac,
        ga.mac,
        (ga.mac, ga.ip4),
        (gb.mac, gb.ip4),
        &m,
    ));
    assert!(cap.saw(&m, SHORT), "honest ARP reply must arrive");
    let m = marker("arp-forged-ip");
    send(arp_reply_frame(
        gb.mac,
        ga.mac,
        (ga.mac, GATEWAY),
        (gb.mac, gb.ip4),
        &m,
    ));
    assert!(
        !cap.saw(&m, SHORT),
        "ARP reply claiming the gateway must drop"
    );
    let m = marker("arp-forged-mac");
    send(arp_reply_frame(
        gb.mac,
        ga.mac,
        (foreign_mac, ga.ip4),
        (gb.mac, gb.ip4),
        &m,
    ));
    assert!(
        !cap.saw(&m, SHORT),
        "ARP reply with a foreign sender MAC must drop"
    );

    // DHCP offer (udp 67 → 68, broadcast) drops; the same frame from another port arrives.
    let m = marker("dhcp-control");
    send(udp4_frame(
        BROADCAST,
        ga.mac,
        ga.ip4,
        Ipv4Addr::BROADCAST,
        (4067, 68),
        &m,
    ));
    assert!(cap.saw(&m, SHORT), "broadcast control must arrive");
    let m = marker("dhcp-offer");
    send(udp4_frame(
        BROADCAST,
        ga.mac,
        ga.ip4,
        Ipv4Addr::BROADCAST,
        (67, 68),
        &m,
    ));
    assert!(!cap.saw(&m, SHORT), "DHCP offer from a guest must drop");

    // Router advertisement / redirect drop; an echo request to all-nodes arrives.
    let all_nodes: Ipv6Addr = "ff02::1".parse().unwrap();
    let m = marker("icmp6-control");
    send(icmp6_frame(
        ALL_NODES_MAC,
        ga.mac,
        ga.ll6,
        all_nodes,
        128,
        &m,
    ));
    assert!(cap.saw(&m, SHORT), "ICMPv6 echo to all-nodes must arrive");
    let m = marker("ra");
    send(icmp6_frame(
        ALL_NODES_MAC,
        ga.mac,
        ga.ll6,
        all_nodes,
        134,
        &m,
    ));
    assert!(!cap.saw(&m, SHORT), "router advertisement must drop");
    let m = marker("redirect6");
    send(icmp6_frame(gb.mac, ga.mac, ga.ll6, gb.ll6, 137, &m));
    assert!(!cap.saw(&m, SHORT), "ICMPv6 redirect must drop");

    // VLAN-tagged frames (which would skip the IP checks) drop.
    let m = marker("vlan");
    let mut tagged = udp4_frame(gb.mac, ga.mac, ga.ip4, gb.ip4, ports, &m);
    tagged.splice(12..12, [0x81, 0x00, 0x00, 0x05]);
    send(tagged);
    assert!(!cap.saw(&m, SHORT), "VLAN-tagged frame must drop");
    drop(cap);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policies_none_and_private() {
    let mut lab = Lab::new("pb").await;
    let p = lab
        .add("inst-pub", "10.0.0.2", NetworkPolicy::Public, false)
        .await;
    let n = lab
        .add("inst-none", "10.0.0.3", NetworkPolicy::None, false)
        .await;
    let v = lab
        .add("inst-priv", "10.0.0.4", NetworkPolicy::Private, false)
        .await;
    let (gp, gn, gv) = (&lab.guests[p], &lab.guests[n], &lab.guests[v]);

    // none: nothing in or out.
    assert!(
        !ping_ok(&gn.ns, IpAddr::V4(GATEWAY)),
        "none → gateway must drop"
    );
    assert!(
        !ping_ok(&gn.ns, IpAddr::V4(gp.ip4)),
        "none → public guest must drop"
    );
    assert!(
        !ping_ok(&gp.ns, IpAddr::V4(gn.ip4)),
        "public guest → none must drop"
    );
    let cap = Capture::start(&gn.ns, "eth0").unwrap();
    let m = marker("to-none");
    send_frame(
        &gp.ns,
        "eth0",
        &udp4_frame(gn.mac, gp.mac, gp.ip4, gn.ip4, (5, 6), &m),
    )
    .unwrap();
    assert!(!cap.saw(&m, SHORT), "a frame to a none tap must drop");
    drop(cap);

    // private: private addresses yes, the internet no (even through the gateway).
    assert!(ping_ok(&gv.ns, IpAddr::V4(GATEWAY)), "private → gateway");
    assert!(
        ping_ok(&gv.ns, IpAddr::V4(gp.ip4)),
        "private → private peer"
    );
    assert!(
        ping_ok(&gp.ns, IpAddr::V4(ECHO_V4)),
        "public guest reaches the internet (control)"
    );
    assert!(
        !ping_ok(&gv.ns, IpAddr::V4(ECHO_V4)),
        "private → internet must drop"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_ssh_only_from_the_host() {
    let mut lab = Lab::new("pc").await;
    let s = lab
        .add("inst-sbx", "10.0.0.2", NetworkPolicy::Public, true)
        .await;
    let o = lab
        .add("inst-oth", "10.0.0.3", NetworkPolicy::Public, false)
        .await;
    let (gs, go) = (&lab.guests[s], &lab.guests[o]);
    let cap = Capture::start(&gs.ns, "eth0").unwrap();
    // A TCP SYN to port 22, built from the UDP probe frame (protocol 6, a 20-byte TCP header).
    let syn = |src_mac, dst_mac, src, dst, m: &[u8]| {
        let mut f = udp4_frame(dst_mac, src_mac, src, dst, (40000, 22), m);
        // Turn the UDP datagram into TCP: protocol 6, a 20-byte TCP header with SYN.
        f[23] = 6;
        let mut tcp = vec![
            0x9c, 0x40, 0, 22, 0, 0, 0, 1, 0, 0, 0, 0, 0x50, 0x02, 0xff, 0xff, 0, 0, 0, 0,
        ];
        tcp.extend(m);
        f.truncate(34);
        f.extend(tcp);
        let total = u16::try_from(f.len() - 14).unwrap();
        f[16..18].copy_from_slice(&total.to_be_bytes());
        f[24] = 0;
        f[25] = 0;
        let mut sum: u32 = 0;
        for c in f[14..34].chunks(2) {
            sum += u32::from(u16::from_be_bytes([c[0], c[1]]));
        }
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        let c = !u16::try_from(sum).unwrap();
        f[24..26].copy_from_slice(&c.to_be_bytes());
        f
    };
    let m = marker("ssh-from-guest");
    send_frame(&go.ns, "eth0", &syn(go.mac, gs.mac, go.ip4, gs.ip4, &m)).unwrap();
    assert!(
        !cap.saw(&m, SHORT),
        "SSH to a sandbox from another guest must drop"
    );
    // The same SYN to another port arrives (control).
    let m = marker("tcp-other-port");
    let mut f = syn(go.mac, gs.mac, go.ip4, gs.ip4, &m);
    f[36..38].copy_from_slice(&2222u16.to_be_bytes());
    send_frame(&go.ns, "eth0", &f).unwrap();
    assert!(cap.saw(&m, SHORT), "tcp/2222 to a sandbox must arrive");
    // SSH from the host's own address (the gateway on br0) arrives.
    let m = marker("ssh-from-host");
    let host_mac = MacAddr([0x02, 0, 0, 0, 0, 0x01]);
    vmnet_testkit::netns::ip(
        &lab.host,
        &["link", "set", "br0", "address", &host_mac.to_string()],
    )
    .unwrap();
    send_frame(
        &lab.host,
        "br0",
        &syn(host_mac, gs.mac, GATEWAY, gs.ip4, &m),
    )
    .unwrap();
    assert!(
        cap.saw(&m, SHORT),
        "SSH to a sandbox from the host must arrive"
    );
}
