//! Pool mode with real packets, nftables alone (no tap guard): two guests on the sandbox
//! host's bridge, relayed from their persistent taps; legitimate traffic passes, each spoof is
//! seen missing at the receiver while the same frame sent honestly arrives.

mod pool_support;

use std::net::IpAddr;
use std::time::Duration;

use pool_support::{
    GATEWAY, Lab, check_spoofs, gateway_cases, marker, ping_ok, spoof_cases, unleased_cases,
};
use vmnet_model::nic::{MacAddr, NetworkPolicy};
use vmnet_testkit::probe::{Capture, send_frame, udp4_frame};
use vmnet_testkit::sandbox::{ECHO_V4, HOST_UPLINK_V4};

const SHORT: Duration = Duration::from_millis(600);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn guests_pass_and_spoofs_are_dropped() {
    let mut lab = Lab::nft_only("pa").await;
    let (a, b) = lab.add_public_pair().await;
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
    check_spoofs(ga, &spoof_cases(ga, gb), &cap, "nftables alone");
    drop(cap);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn unleased_nics_and_the_gateway_address() {
    let mut lab = Lab::nft_only("pk").await;
    let (a, b) = lab.add_public_pair().await;
    let u = lab.add_unleased("inst-u").await;
    let (ga, gb, gu) = (&lab.guests[a], &lab.guests[b], &lab.guests[u]);
    let cap = Capture::start(&gb.ns, "eth0").unwrap();
    check_spoofs(gu, &unleased_cases(gu, ga, gb), &cap, "nftables alone");
    drop(cap);
    let br0_mac = lab.bridge_mac();
    let cap = Capture::start(&lab.host, "br0").unwrap();
    check_spoofs(ga, &gateway_cases(ga, br0_mac), &cap, "nftables alone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn policies_none_and_private() {
    let mut lab = Lab::nft_only("pb").await;
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
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn sandbox_ssh_only_from_the_host() {
    let mut lab = Lab::nft_only("pc").await;
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
