//! Gateway VMs and public IPv6 blocks across hosts (root required): three fleet hosts with real
//! agents sharing one throwaway PostgreSQL registration store, VMs made by `PUT /v1/vms` with
//! simulated guests. Checked with real packets:
//! - a VM on host A whose route `2000::/3 via <gateway>` names a gateway VM on host B reaches an
//!   address the gateway's guest owns (TCP and UDP), seen there with the VM's mesh address, and
//!   gets the answers back (forwarded by the gateway from a source outside the mesh);
//! - a VM of another tenant routing through the same gateway is dropped on A, and counted;
//! - a VM on host A reaches an address inside a public IPv6 block owned by a VM on host C,
//!   through the mesh, also from another tenant (a block is public), and gets its answers,
//!   while the two VMs' mesh addresses stay apart (tenants).

mod mesh_support;

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use mesh_support::vms::{PORT, Vm};
use mesh_support::{Mesh, Node, answers};
use serde_json::{Value, json};
use vmnet_agent::status::VmView;
use vmnet_kernel::mesh::MeshPlane;
use vmnet_testkit::echo::EchoService;
use vmnet_testkit::guest::{GuestConfig, GuestRoute6, SimGuest};
use vmnet_testkit::mesh_lab::BpffsMount;
use vmnet_testkit::postgres::PgCluster;
use vmnet_testkit::{netns, traffic};

const T: Duration = Duration::from_secs(2);
const LINK_LOCAL_GW: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);
/// An address the gateway's guest owns (on `lo`), inside `2000::/3`.
const PROBE: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 9, 0, 0, 0, 0, 1);
/// The public block of host C's VM and the address its guest configures in it.
const BLOCK: &str = "2001:db8:c00::/64";
const IN_BLOCK: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xc00, 0, 0, 0, 0, 5);

fn mesh_addr(host: u16, n: u16) -> Ipv6Addr {
    Ipv6Addr::new(0xfdaa, 0x100 + host, 0, 0, 0, 0, 0, n)
}

async fn put(n: &Node, body: Value) -> VmView {
    let id = body["id"].as_str().expect("id").to_owned();
    n.client()
        .put(&format!("/v1/vms/{id}"), &body)
        .await
        .unwrap_or_else(|e| panic!("put {id}: {e}\n{}", n.logs()))
}

/// A guest behind `v`'s tap routing the mesh and `extra` via the host, serving the echo on its
/// mesh address and on `serve` (added to `dev` first).
fn guest(n: &Node, v: &VmView, name: &str, extra: &[&str], serve: Option<(Ipv6Addr, &str)>) -> Vm {
    let mesh = v.config.mesh_ipv6.expect("a mesh address");
    let ns = format!("{}x-g{name}", n.host.prefix);
    netns::create(&ns).expect("guest netns");
    let mut routes_v6 = vec![GuestRoute6 {
        destination: "fdaa::/16".into(),
        via: Some(LINK_LOCAL_GW),
    }];
    routes_v6.extend(extra.iter().map(|d| GuestRoute6 {
        destination: (*d).into(),
        via: Some(LINK_LOCAL_GW),
    }));
    let cfg = GuestConfig {
        mesh_ipv6: Some(mesh),
        routes_v6,
        ..GuestConfig::default()
    };
    let guest = SimGuest::attach_in(&ns, &v.status.netns, &v.status.tap, &cfg).expect("guest");
    let mut listen = vec![SocketAddr::new(IpAddr::V6(mesh), PORT)];
    if let Some((a, dev)) = serve {
        netns::ip(
            &ns,
            &[
                "-6",
                "addr",
                "add",
                &format!("{a}/128"),
                "dev",
                dev,
                "nodad",
            ],
        )
        .expect("guest address");
        listen.push(SocketAddr::new(IpAddr::V6(a), PORT));
    }
    let echo = EchoService::start(&ns, &listen).expect("echo");
    Vm::new(mesh, guest, echo)
}

fn tcp_peer(from: &Vm, to: Ipv6Addr) -> Option<IpAddr> {
    traffic::tcp_echo(from.guest.netns(), SocketAddr::new(IpAddr::V6(to), PORT), T)
        .ok()
        .map(|r| r.peer.ip())
}

fn udp_peer(from: &Vm, to: Ipv6Addr) -> Option<IpAddr> {
    traffic::udp_echo(from.guest.netns(), SocketAddr::new(IpAddr::V6(to), PORT), T)
        .ok()
        .map(|r| r.peer.ip())
}

async fn drops(n: &Node, reason: &str) -> u64 {
    n.view().await.data_plane.expect("data_plane").drops[reason]
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs root: builds network namespaces, mounts a bpffs, runs wireguard-go and PostgreSQL"]
async fn gateway_vms_and_public_blocks_are_reached_across_hosts() {
    vmnet_testkit::require_root();
    let pg = PgCluster::shared();
    let registry = pg.url(&pg.fresh_database().expect("database"));
    let bpffs = BpffsMount::new(&format!("gw{}", std::process::id())).expect("bpffs");
    let m = Mesh::start_with(3, |h| {
        let dir = bpffs.dir(&h.prefix).expect("pin dir");
        vec![
            "--mesh-bpf-root".to_owned(),
            dir.to_str().unwrap().to_owned(),
            "--mesh-registry".to_owned(),
            registry.clone(),
        ]
    })
    .await;
    m.sync_all().await;
    for i in 0..3 {
        let j = (i + 1) % 3;
        assert!(
            answers(&m.nodes[i], m.nodes[j].mesh, Duration::from_secs(10)),
            "tunnel {i} -> {j}"
        );
    }
    let (a, b, c) = (&m.nodes[0], &m.nodes[1], &m.nodes[2]);
    let via_host = json!({"destination": "::/0", "via": "host"});

    // The gateway VM on B (tenant 1) and the block owner on C (tenant 1).
    let gw_mesh = mesh_addr(1, 1);
    let g_view = put(
        b,
        json!({"id": "g", "user_id": 1, "tenant": 1,
        "mesh_ipv6": gw_mesh.to_string(), "network": {"routes": [via_host]}}),
    )
    .await;
    let g = guest(b, &g_view, "g", &[], Some((PROBE, "lo")));
    let x_view = put(
        c,
        json!({"id": "x", "user_id": 1, "tenant": 1,
        "mesh_ipv6": mesh_addr(2, 1).to_string(), "public_ipv6": BLOCK,
        "network": {"routes": [via_host]}}),
    )
    .await;
    let x = guest(c, &x_view, "x", &[], Some((IN_BLOCK, "eth0")));
    // On A: v routes 2000::/3 via the gateway; w (tenant 2) too; u (tenant 2) routes ::/0 via
    // its host and reaches the block.
    let via_gw = json!([{"destination": "2000::/3", "via": gw_mesh.to_string()}]);
    let v_view = put(
        a,
        json!({"id": "v", "user_id": 1, "tenant": 1,
        "mesh_ipv6": mesh_addr(0, 1).to_string(), "network": {"routes": via_gw}}),
    )
    .await;
    let v = guest(a, &v_view, "v", &["2000::/3"], None);
    let w_view = put(
        a,
        json!({"id": "w", "user_id": 2, "tenant": 2,
        "mesh_ipv6": mesh_addr(0, 2).to_string(), "network": {"routes": via_gw}}),
    )
    .await;
    let w = guest(a, &w_view, "w", &["2000::/3"], None);
    let u_view = put(
        a,
        json!({"id": "u", "user_id": 3, "tenant": 2,
        "mesh_ipv6": mesh_addr(0, 3).to_string(), "network": {"routes": [via_host]}}),
    )
    .await;
    let u = guest(a, &u_view, "u", &["::/0"], None);

    // Every host knows the five VMs, C's block and B's gateway.
    let plane_a =
        MeshPlane::load(Some(&a.host.ns), &bpffs.path().join(&a.host.prefix)).expect("plane A");
    let known = mesh_support::eventually(Duration::from_secs(3), || async {
        plane_a.locations().is_ok_and(|l| l.len() == 5)
            && plane_a
                .blocks()
                .is_ok_and(|b| b.keys().any(|n| n.to_string() == BLOCK))
            && plane_a
                .gateways()
                .is_ok_and(|g| g.contains(&(b.mesh, 1)) && g.contains(&(c.mesh, 1)))
    })
    .await;
    assert!(
        known,
        "A's maps: locations {:?} blocks {:?} gateways {:?}",
        plane_a.locations(),
        plane_a.blocks(),
        plane_a.gateways()
    );
    // Only v and w (a route via the gateway's mesh address) have their packets to outside the
    // mesh looked up in A's routing; u's go to the host's routes without that cost.
    assert_eq!(
        plane_a.via_user_ids().expect("via map"),
        [1, 2].into_iter().collect(),
        "A's VMs with a route via a mesh address"
    );

    // The gateway on B carries 2000::/3 for v on A: the probe answers, and sees v's address.
    let from_v = Some(IpAddr::V6(v.mesh));
    assert_eq!(
        tcp_peer(&v, PROBE),
        from_v,
        "tcp v -> {PROBE} via the gateway on B\n{}",
        b.logs()
    );
    assert_eq!(udp_peer(&v, PROBE), from_v, "udp v -> {PROBE} via B");
    assert!(
        g.echo()
            .seen()
            .iter()
            .any(|s| s.local.ip() == IpAddr::V6(PROBE) && s.peer.ip() == IpAddr::V6(v.mesh)),
        "the gateway's guest saw v's packets at the probe"
    );

    // Another tenant through the same gateway: dropped on A, counted.
    let before = drops(a, "tenant").await;
    assert_eq!(
        tcp_peer(&w, PROBE),
        None,
        "w (tenant 2) through g (tenant 1)"
    );
    let after = drops(a, "tenant").await;
    assert!(
        after > before,
        "tenant drop counted on A: {before} -> {after}"
    );

    // The block on C, reached from A through the mesh, from either tenant (a block is public).
    for (who, vm) in [("v", &v), ("u", &u)] {
        assert_eq!(
            tcp_peer(vm, IN_BLOCK),
            Some(IpAddr::V6(vm.mesh)),
            "tcp {who} -> {IN_BLOCK} in C's block\n{}",
            c.logs()
        );
        assert_eq!(
            udp_peer(vm, IN_BLOCK),
            Some(IpAddr::V6(vm.mesh)),
            "udp {who} -> {IN_BLOCK}"
        );
    }
    // Mesh isolation still holds between u (tenant 2) and x (tenant 1) at their mesh addresses.
    assert_eq!(tcp_peer(&u, x.mesh), None, "u -> x's mesh address: tenants");
    drop((g, x, v, w, u));
}
