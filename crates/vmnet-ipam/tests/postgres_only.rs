//! PostgreSQL-specific proofs: the spec's operator queries run verbatim against the tables, and
//! 16 placers on separate connections racing for one pool all succeed with the lowest addresses.
#![allow(missing_docs)]

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;

use common::*;
use tokio::sync::Barrier;
use vmnet_ipam::{Db, Store};
use vmnet_testkit::postgres::PgCluster;

const POOL_QUERY: &str =
    "SELECT cidr, host(gateway) AS gateway, host(first_host) AS first, host(last_host) AS last
  FROM ip_pools WHERE pool_id = $1;";
const LEASE_QUERY: &str = "SELECT host(address) AS address, instance_id
  FROM ip_leases WHERE pool_id = $1 ORDER BY address;";

/// Runs a query with one `$1` parameter verbatim through psql (PREPARE/EXECUTE).
fn operator(db: &str, query: &str, pool: &str) -> String {
    let name = if query.contains("ip_pools") {
        "pool_q"
    } else {
        "lease_q"
    };
    let sql = format!("PREPARE {name}(text) AS {query}\nEXECUTE {name}('{pool}');");
    let out = PgCluster::shared().psql(db, &sql).unwrap();
    out.strip_prefix("PREPARE\n").unwrap_or(&out).to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_queries_run_exactly_as_written() {
    let c = PgCluster::shared();
    let name = c.fresh_database().unwrap();
    let db = Db::connect(&c.url(&name)).await.unwrap();
    with_pool(&db, "pool_01jz", "10.0.0.0/24", "10.0.0.1").await;
    for i in 0..12 {
        lease(&db, "pool_01jz", &format!("vm{i:02}")).await.unwrap();
    }
    assert_eq!(
        operator(&name, POOL_QUERY, "pool_01jz"),
        "10.0.0.0/24|10.0.0.1|10.0.0.2|10.0.0.254\n"
    );
    let rows = operator(&name, LEASE_QUERY, "pool_01jz");
    // As written, `ORDER BY address` names the output column `host(address) AS address`, so
    // PostgreSQL sorts the text (.10 before .2); the rows are exactly the leases.
    let mut expected: Vec<String> = (0..12)
        .map(|i| format!("10.0.0.{}|vm{i:02}", i + 2))
        .collect();
    expected.sort();
    assert_eq!(rows, expected.join("\n") + "\n");
    // vmnet's own listing orders by the inet column.
    let mut tx = db.begin().await.unwrap();
    let listed = vmnet_ipam::list_leases(&mut tx, "pool_01jz").await.unwrap();
    tx.commit().await.unwrap();
    let addrs: Vec<_> = listed.iter().map(|l| l.address).collect();
    let numeric: Vec<_> = (2..14)
        .map(|i| std::net::IpAddr::V4(ip(&format!("10.0.0.{i}"))))
        .collect();
    assert_eq!(addrs, numeric, "vmnet lists leases in address order");
    // The column types are the documented ones.
    let types = c
        .psql(
            &name,
            "SELECT table_name || '.' || column_name || ':' || data_type FROM information_schema.columns \
             WHERE table_name IN ('ip_pools', 'ip_leases') AND column_name IN ('cidr', 'gateway', 'first_host', 'last_host', 'address') \
             ORDER BY 1",
        )
        .unwrap();
    assert_eq!(
        types,
        "ip_leases.address:inet\nip_pools.cidr:cidr\nip_pools.first_host:inet\nip_pools.gateway:inet\nip_pools.last_host:inet\n"
    );
    db.close().await;
}

async fn race(db: &Db, ids: Vec<String>, create: bool) -> Vec<std::net::Ipv4Addr> {
    let barrier = Arc::new(Barrier::new(ids.len()));
    let mut tasks = Vec::new();
    for id in ids {
        let db = db.clone();
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            let mut tx = db.begin().await.unwrap();
            barrier.wait().await; // all 16 transactions are open on their own connections
            let addr = if create {
                vmnet_ipam::create_instance(&mut tx, &inst(&id, "p1"))
                    .await
                    .map(|i| i.address)
            } else {
                vmnet_ipam::lease(&mut tx, "p1", &id).await
            };
            let addr = addr
                .unwrap_or_else(|e| panic!("placement {id} failed: {e}"))
                .unwrap();
            tx.commit().await.unwrap();
            addr
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_concurrent_placers_get_distinct_lowest_addresses() {
    let t = postgres_with(Some(20)).await;
    let db = &t.db;
    with_pool(db, "p1", "10.0.0.0/24", "10.0.0.1").await;
    // Round 1: bare leases.
    let got = race(db, (0..16).map(|i| format!("l{i}")).collect(), false).await;
    let set: BTreeSet<_> = got.iter().copied().collect();
    assert_eq!(set.len(), 16, "distinct: {got:?}");
    let lowest: BTreeSet<_> = (2..18).map(|i| ip(&format!("10.0.0.{i}"))).collect();
    assert_eq!(set, lowest, "the 16 lowest addresses");
    // Round 2: punch holes, then 16 full placements (host claim + lease) race: they fill the
    // holes first, lowest first, then continue above.
    let mut expect = BTreeSet::new();
    for i in (0..16).step_by(2) {
        let released = release(db, &format!("l{i}")).await.unwrap().unwrap();
        let std::net::IpAddr::V4(a) = released.address else {
            panic!("an IPv4 lease: {released:?}");
        };
        expect.insert(a);
    }
    add_host(db, "h1", 8, 65536).await;
    add_host(db, "h2", 8, 65536).await;
    let got = race(db, (0..16).map(|i| format!("c{i}")).collect(), true).await;
    let set: BTreeSet<_> = got.iter().copied().collect();
    assert_eq!(set.len(), 16, "distinct: {got:?}");
    expect.extend((18..26).map(|i| ip(&format!("10.0.0.{i}"))));
    assert_eq!(set, expect);
    let mut tx = db.begin().await.unwrap();
    for h in ["h1", "h2"] {
        assert_eq!(
            vmnet_ipam::get_host(&mut tx, h).await.unwrap().used_vcpus,
            8
        );
    }
    tx.commit().await.unwrap();
    db.close().await;
}
