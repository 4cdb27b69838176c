//! The mesh data plane with real packets (root required): two fleet hosts running
//! `wireguard-go` over the shared private network, VMs of tenants 0, 1 and 2 on each. Same
//! tenant across hosts: TCP, UDP and ICMPv6 both ways, encapsulated (the counters say so) and
//! never in clear on the private network; other tenants dropped on the sending host and, with a
//! stale location there, on the receiving host; same-host traffic under the same rule; tenant 0
//! only while whitelisted; 1380 bytes with DF cross, 1381 get a Packet Too Big for 1380;
//! unknown destinations dropped and counted.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use vmnet_kernel::mesh::Location;
use vmnet_testkit::echo::EchoService;
use vmnet_testkit::mesh_lab::{LabVm, MeshLab, SizedPing, VM_MTU, ping6_sized};
use vmnet_testkit::probe::Capture;
use vmnet_testkit::traffic;

const T: Duration = Duration::from_secs(2);
const PORT: u16 = 7000;

fn mesh(host: u16, vm: u16) -> Ipv6Addr {
    Ipv6Addr::new(0xfdaa, host, 0, 0, 0, 0, 0, vm)
}

fn echo(vm: &LabVm) -> EchoService {
    EchoService::start(&vm.ns, &[SocketAddr::new(IpAddr::V6(vm.mesh), PORT)]).expect("echo")
}

fn target(vm: &LabVm) -> SocketAddr {
    SocketAddr::new(IpAddr::V6(vm.mesh), PORT)
}

fn pings(from: &LabVm, to: &LabVm) -> bool {
    traffic::ping(&from.ns, IpAddr::V6(to.mesh), 1, T)
        .expect("ping")
        .received
        == 1
}

/// Whether `from` reaches `to` with TCP, UDP and ICMPv6 (all three, or none: a mix panics).
fn reaches(from: &LabVm, to: &LabVm) -> bool {
    let tcp = traffic::tcp_echo(&from.ns, target(to), T).is_ok();
    let udp = traffic::udp_echo(&from.ns, target(to), Duration::from_millis(500)).is_ok();
    let icmp = pings(from, to);
    assert!(
        tcp == udp && udp == icmp,
        "{} -> {}: tcp {tcp}, udp {udp}, icmp {icmp}",
        from.mesh,
        to.mesh
    );
    tcp
}

fn drops(lab: &MeshLab, host: usize) -> BTreeMap<&'static str, u64> {
    lab.hosts[host].plane.drops().expect("drops")
}

fn passes(lab: &MeshLab, host: usize) -> BTreeMap<&'static str, u64> {
    lab.hosts[host].plane.passes().expect("passes")
}

fn contains(frame: &[u8], addr: Ipv6Addr) -> bool {
    frame.windows(16).any(|w| w == addr.octets())
}

#[test]
#[ignore = "needs root: builds network namespaces and runs wireguard-go"]
fn the_mesh_carries_vm_traffic_between_hosts_with_tenant_isolation() {
    vmnet_testkit::require_root();
    let lab = MeshLab::new(2).expect("lab");
    let big = VM_MTU + 120;
    // Host 1: a (tenant 1), b (tenant 2), z (tenant 0), a2 (tenant 1), m (tenant 1, a VM whose
    // link MTU is too big). Host 2: c (tenant 1, the same user id as a), d (tenant 2).
    let a = lab.add_vm(0, 1, 1, mesh(1, 1), VM_MTU).expect("a");
    let b = lab.add_vm(0, 2, 2, mesh(1, 2), VM_MTU).expect("b");
    let z = lab.add_vm(0, 3, 0, mesh(1, 3), VM_MTU).expect("z");
    let a2 = lab.add_vm(0, 4, 1, mesh(1, 4), VM_MTU).expect("a2");
    let m = lab.add_vm(0, 5, 1, mesh(1, 5), big).expect("m");
    let c = lab.add_vm(1, 1, 1, mesh(2, 1), VM_MTU).expect("c");
    let d = lab.add_vm(1, 2, 2, mesh(2, 2), VM_MTU).expect("d");
    let all = [&a, &b, &z, &a2, &m, &c, &d];
    for vm in all {
        lab.publish(vm).expect("publish");
    }
    let _echoes: Vec<EchoService> = all.iter().map(|vm| echo(vm)).collect();
    lab.wait_tunnels().expect("tunnels");
    let ns_priv = lab.private_ns();
    let caps: Vec<Capture> = (0..2)
        .map(|i| Capture::start(&ns_priv, &lab.private_port(i)).expect("capture"))
        .collect();

    // Same tenant across hosts, both ways; encapsulated on the way out, decapsulated on the
    // way in.
    assert!(reaches(&a, &c), "a -> c");
    assert!(reaches(&c, &a), "c -> a");
    for h in 0..2 {
        let p = passes(&lab, h);
        assert!(
            p["encapsulated"] >= 3 && p["decapsulated"] >= 3,
            "host {h}: {p:?}"
        );
    }
    // Nothing of a VM's address is in clear on the private network; the tunnel's UDP is there.
    let frames: Vec<Vec<u8>> = caps.iter().flat_map(Capture::frames).collect();
    assert!(frames.len() >= 6, "captured {} frames", frames.len());
    for vm in all {
        assert!(
            !frames.iter().any(|f| contains(f, vm.mesh)),
            "{} in clear on the private network",
            vm.mesh
        );
    }

    // Different tenants across hosts: dropped on the sending host, both ways.
    let (t1, t2) = (drops(&lab, 0)["tenant"], drops(&lab, 1)["tenant"]);
    assert!(!reaches(&a, &d), "a -> d");
    assert!(!reaches(&d, &a), "d -> a");
    assert!(drops(&lab, 0)["tenant"] >= t1 + 3, "{:?}", drops(&lab, 0));
    assert!(drops(&lab, 1)["tenant"] >= t2 + 3, "{:?}", drops(&lab, 1));
    // A stale location on host 1 (d as tenant 1) gets past the sender: host 2 drops it.
    let stale = Location {
        tenant: 1,
        ..d.location(&lab.hosts)
    };
    lab.hosts[0]
        .plane
        .put_location(d.mesh, &stale)
        .expect("stale");
    let t2 = drops(&lab, 1)["tenant"];
    assert!(!pings(&a, &d), "a -> d with a stale location");
    assert!(drops(&lab, 1)["tenant"] > t2, "{:?}", drops(&lab, 1));
    lab.publish(&d).expect("fix d");

    // Same host: same tenant passes, another tenant is dropped.
    let local = passes(&lab, 0)["local"];
    assert!(reaches(&a, &a2), "a -> a2");
    assert!(passes(&lab, 0)["local"] >= local + 3);
    let t1 = drops(&lab, 0)["tenant"];
    assert!(!reaches(&a, &b), "a -> b");
    assert!(!reaches(&b, &a), "b -> a");
    assert!(drops(&lab, 0)["tenant"] >= t1 + 6);

    // Tenant 0: across tenants only while whitelisted (on both hosts), both directions.
    assert!(!reaches(&z, &c) && !reaches(&d, &z) && !reaches(&z, &a));
    // A prefix entry, as `POST /v1/sync` carries them.
    let wl = ["fdaa:1::/120".parse().unwrap()].into_iter().collect();
    for h in &lab.hosts {
        h.plane.set_whitelist(&wl).expect("whitelist");
    }
    assert!(reaches(&z, &c), "whitelisted z -> c");
    assert!(reaches(&d, &z), "d -> whitelisted z");
    assert!(reaches(&z, &a), "whitelisted z -> a (same host)");
    assert!(
        !reaches(&c, &d),
        "the whitelist opens nothing between other tenants"
    );
    for h in &lab.hosts {
        h.plane
            .set_whitelist(&Default::default())
            .expect("whitelist");
    }
    assert!(
        !reaches(&z, &c) && !reaches(&d, &z),
        "z after the whitelist dropped it"
    );

    // MTU: 1380 bytes with DF cross; one byte more gets a Packet Too Big for 1380 from host 1.
    let max = usize::try_from(VM_MTU).unwrap();
    assert_eq!(
        ping6_sized(&a.ns, c.mesh, max, T).unwrap(),
        SizedPing::Reply
    );
    assert_eq!(
        ping6_sized(&m.ns, c.mesh, max, T).unwrap(),
        SizedPing::Reply
    );
    let mtu = drops(&lab, 0)["mtu"];
    assert_eq!(
        ping6_sized(&m.ns, c.mesh, max + 1, T).unwrap(),
        SizedPing::TooBig(VM_MTU)
    );
    assert!(drops(&lab, 0)["mtu"] > mtu);

    // Unknown destinations: dropped and counted (on the sending host).
    let unknown = drops(&lab, 0)["unknown_destination"];
    let ghost = LabVm {
        mesh: mesh(9, 9),
        ..c.clone()
    };
    assert!(!pings(&a, &ghost));
    lab.hosts[0]
        .plane
        .remove_location(c.mesh)
        .expect("forget c");
    assert!(!reaches(&a, &c), "a -> c after c's location went");
    assert!(drops(&lab, 0)["unknown_destination"] >= unknown + 4);
    // On the receiving host: c's local entry gone, host 1 still sends to it.
    lab.publish(&c).expect("c again");
    lab.hosts[1]
        .plane
        .remove_local(c.user_id)
        .expect("forget local c");
    let unknown = drops(&lab, 1)["unknown_destination"];
    assert!(!pings(&a, &c));
    assert!(drops(&lab, 1)["unknown_destination"] > unknown);
}
