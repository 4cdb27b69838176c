//! The agent's mesh data plane with real packets (root required): two fleet hosts, each with
//! `vmnet serve --mesh --mesh-bpf-root DIR` (a bpffs the test mounts) and one shared PostgreSQL
//! registration store. The agent loads the
//! programs, attaches the decapsulating one to wg0 and writes its mesh address and the
//! whitelist of each `POST /v1/sync`. The test puts a VM on each host through its agent (which
//! registers it): a tenant-0 VM reaches a tenant-1 VM on the other host only while a sync
//! whitelists it, and a sync without it stops it before it answers.
//! `GET /v1/mesh` shows the data plane's counters.

mod mesh_support;

use std::net::Ipv6Addr;
use std::time::Duration;

use mesh_support::vms::{tcp, vm};
use mesh_support::{Mesh, answers, body_for};
use serde_json::json;
use vmnet_kernel::mesh::MeshPlane;
use vmnet_testkit::mesh_lab::BpffsMount;

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
    // The hosts share one registration store (with their own SQLite, every VM would be local).
    let registry = vmnet_testkit::postgres::PgCluster::shared()
        .fresh_database_url()
        .expect("database");
    let m = Mesh::start_with(2, |h| {
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
    let (n0, n1) = (&m.nodes[0], &m.nodes[1]);
    assert!(answers(n0, n1.mesh, Duration::from_secs(10)), "tunnel");
    let planes: Vec<MeshPlane> = m
        .nodes
        .iter()
        .map(|n| MeshPlane::load(Some(&n.host.ns), &root(&n.host.prefix)).expect("plane"))
        .collect();
    // The VMs are the agents' (PUT), which register them: no map is written by the test.
    let z = vm(n0, "z3", 3, 0, Ipv6Addr::new(0xfdaa, 1, 0, 0, 0, 0, 0, 3)).await;
    let c = vm(n1, "c1", 1, 1, Ipv6Addr::new(0xfdaa, 2, 0, 0, 0, 0, 0, 1)).await;
    for p in &planes {
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        while p.locations().expect("locations").len() < 2 {
            assert!(std::time::Instant::now() < deadline, "both VMs located");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
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
