//! The agent's mesh data plane with real packets (root required): two fleet hosts, each with
//! `vmnet serve --mesh --mesh-bpf-root DIR` (a bpffs the test mounts). The agent loads the
//! programs, attaches the decapsulating one to wg0 and writes its mesh address and the
//! whitelist of each `POST /v1/sync`. The test adds a VM per host through the same pinned maps
//! (the agent does not register VMs yet): a tenant-0 VM reaches a tenant-1 VM on the other host
//! only while a sync whitelists it, and a sync without it stops it before it answers.
//! `GET /v1/mesh` shows the data plane's counters.

mod mesh_support;

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use mesh_support::{Mesh, answers, body_for};
use serde_json::json;
use vmnet_kernel::mesh::{Location, MeshPlane};
use vmnet_testkit::echo::EchoService;
use vmnet_testkit::mesh_lab::{BpffsMount, LabVm, VM_MTU, VmSpec, add_vm};
use vmnet_testkit::traffic;

const T: Duration = Duration::from_secs(2);
const PORT: u16 = 7000;

fn tcp(from: &LabVm, to: &LabVm) -> bool {
    traffic::tcp_echo(&from.ns, SocketAddr::new(IpAddr::V6(to.mesh), PORT), T).is_ok()
}

/// Syncs every node with the others and `whitelist`.
async fn sync_whitelist(m: &Mesh, whitelist: &[&str]) {
    for (i, n) in m.nodes.iter().enumerate() {
        let mut body = body_for(&m.nodes, i);
        body["whitelist"] = json!(whitelist);
        n.sync(&body).await.expect("sync");
    }
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs root: builds network namespaces, mounts a bpffs and runs wireguard-go"]
async fn a_sync_whitelist_opens_and_closes_tenant_zero_across_hosts() {
    vmnet_testkit::require_root();
    let bpffs = BpffsMount::new(&format!("agent{}", std::process::id())).expect("bpffs");
    let root = |prefix: &str| bpffs.path().join(prefix);
    let m = Mesh::start_with(2, |h| {
        let dir = bpffs.dir(&h.prefix).expect("pin dir");
        vec![
            "--mesh-bpf-root".to_owned(),
            dir.to_str().unwrap().to_owned(),
        ]
    })
    .await;
    m.sync_all().await;
    let (n0, n1) = (&m.nodes[0], &m.nodes[1]);
    assert!(answers(n0, n1.mesh, Duration::from_secs(10)), "tunnel");
    let planes: Vec<MeshPlane> = m
        .nodes
        .iter()
        .map(|n| MeshPlane::load(Some(&n.host.ns), &root(&n.host.prefix)).expect("plane"))
        .collect();
    let z = add_vm(
        &planes[0],
        &n0.host,
        n0.mesh,
        &VmSpec {
            host: 0,
            user_id: 3,
            tenant: 0,
            mesh: Ipv6Addr::new(0xfdaa, 1, 0, 0, 0, 0, 0, 3),
            mtu: VM_MTU,
        },
    )
    .expect("z");
    let c = add_vm(
        &planes[1],
        &n1.host,
        n1.mesh,
        &VmSpec {
            host: 1,
            user_id: 1,
            tenant: 1,
            mesh: Ipv6Addr::new(0xfdaa, 2, 0, 0, 0, 0, 0, 1),
            mtu: VM_MTU,
        },
    )
    .expect("c");
    for (vm, host) in [(&z, n0.mesh), (&c, n1.mesh)] {
        let loc = Location {
            host,
            user_id: vm.user_id,
            tenant: vm.tenant,
        };
        for p in &planes {
            p.put_location(vm.mesh, &loc).expect("location");
        }
    }
    let _echo: Vec<EchoService> = [&z, &c]
        .iter()
        .map(|vm| {
            EchoService::start(&vm.ns, &[SocketAddr::new(IpAddr::V6(vm.mesh), PORT)]).expect("echo")
        })
        .collect();

    assert!(!tcp(&z, &c), "tenant 0 crosses without a whitelist");
    sync_whitelist(&m, &["fdaa:1::/120"]).await;
    let counters = || {
        planes
            .iter()
            .map(|p| {
                format!(
                    "{:?} {:?} {:?}",
                    p.drops().unwrap(),
                    p.passes().unwrap(),
                    p.whitelist().unwrap()
                )
            })
            .collect::<Vec<_>>()
    };
    assert!(tcp(&z, &c), "whitelisted z -> c: {:?}", counters());
    assert!(tcp(&c, &z), "c -> whitelisted z");
    sync_whitelist(&m, &[]).await;
    assert!(!tcp(&z, &c), "z -> c after a sync removed it");
    assert!(!tcp(&c, &z), "c -> z after a sync removed it");

    for n in &m.nodes {
        let v = n.view().await;
        let d = v.data_plane.expect("data_plane in GET /v1/mesh");
        assert_eq!(d.locations, 2, "{d:?}");
        assert!(d.passes["encapsulated"] >= 2, "{d:?}");
        assert!(d.passes["decapsulated"] >= 2, "{d:?}");
        assert!(d.drops["tenant"] >= 2, "{d:?}");
    }
}
