//! Migration 0002 (a pool's list of ranges, IPv6 leases) on a store that an earlier vmnet left:
//! every migration but 0002 applied, a pool with its range, leases and free intervals. Opening
//! it with this vmnet runs 0002; nothing is lost, the operator SQL reads IPv4 as before, the
//! next lease is the lowest free address, and IPv6 ranges can be added.
#![allow(missing_docs)]

mod common;

use sqlx::migrate::{Migrate, Migrator};
use vmnet_ipam::{Db, POSTGRES_MIGRATOR, SQLITE_MIGRATOR, Store};

use common::*;

/// What the earlier vmnet wrote: /29 with two leases (.2, .3) and .4-.6 free.
const OLD_SQLITE: &str = "INSERT INTO pools (pool_id) VALUES ('p1');
INSERT INTO ip_pools (pool_id, cidr, gateway, first_host, last_host, dns, first_host_num, last_host_num, gateway_num)
    VALUES ('p1', '10.0.0.0/29', '10.0.0.1', '10.0.0.2', '10.0.0.6', '[\"10.0.0.53\"]', 167772162, 167772166, 167772161);
INSERT INTO hosts (host_id, vcpus, memory_mib, used_vcpus, used_memory_mib) VALUES ('h1', 8, 8192, 2, 1024);
INSERT INTO instances (instance_id, pool_id, host_id, vcpus, memory_mib, state, allocation_id)
    VALUES ('vm0', 'p1', 'h1', 1, 512, 'running', 'vm0'), ('vm1', 'p1', 'h1', 1, 512, 'running', 'vm1');
INSERT INTO ip_leases (pool_id, address, address_num, instance_id)
    VALUES ('p1', '10.0.0.2', 167772162, 'vm0'), ('p1', '10.0.0.3', 167772163, 'vm1');
INSERT INTO ip_free (pool_id, first, last) VALUES ('p1', 167772164, 167772166);";

const OLD_POSTGRES: &str = "INSERT INTO pools (pool_id) VALUES ('p1');
INSERT INTO ip_pools (pool_id, cidr, gateway, first_host, last_host, dns)
    VALUES ('p1', '10.0.0.0/29', '10.0.0.1', '10.0.0.2', '10.0.0.6', '{10.0.0.53}');
INSERT INTO hosts (host_id, vcpus, memory_mib, used_vcpus, used_memory_mib) VALUES ('h1', 8, 8192, 2, 1024);
INSERT INTO instances (instance_id, pool_id, host_id, vcpus, memory_mib, state, allocation_id)
    VALUES ('vm0', 'p1', 'h1', 1, 512, 'running', 'vm0'), ('vm1', 'p1', 'h1', 1, 512, 'running', 'vm1');
INSERT INTO ip_leases (pool_id, address, instance_id) VALUES ('p1', '10.0.0.2', 'vm0'), ('p1', '10.0.0.3', 'vm1');
INSERT INTO ip_free (pool_id, first, last) VALUES ('p1', 167772164, 167772166);";

/// Applies every migration of `m` but 0002 through sqlx's own bookkeeping.
async fn older_store<C: Migrate + ?Sized>(c: &mut C, m: &Migrator) {
    c.ensure_migrations_table("_sqlx_migrations").await.unwrap();
    for mig in m.iter().filter(|mig| mig.version != 2) {
        c.apply("_sqlx_migrations", mig).await.unwrap();
    }
}

/// What the store holds after the upgrade, through vmnet.
async fn upgraded_store_works(db: &Db) {
    let mut tx = db.begin().await.unwrap();
    let vm0 = vmnet_ipam::get_instance(&mut tx, "vm0").await.unwrap();
    let pool = vmnet_ipam::get_pool(&mut tx, "p1").await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(vm0.addresses, ["10.0.0.2/29"]);
    assert_eq!(pool.leases, 2);
    assert_eq!(pool.ranges.len(), 1);
    assert_eq!(
        pool.range.unwrap().dns,
        [std::net::IpAddr::from([10, 0, 0, 53])]
    );
    let vm2 = create(db, &inst("vm2", "p1")).await.unwrap();
    assert_eq!(vm2.address, Some(ip("10.0.0.4")));
    add_range(db, add("p1", "2001:db8::/64", "2001:db8::1"))
        .await
        .unwrap();
    let vm3 = create(db, &inst("vm3", "p1")).await.unwrap();
    assert_eq!(vm3.addresses, ["10.0.0.5/29", "2001:db8::2/64"]);
    // Instances placed before the pool had IPv6 ranges keep IPv4 only until placed again.
    delete(db, "vm1").await.unwrap();
    let again = create(db, &inst("vm1", "p1")).await.unwrap();
    assert_eq!(again.addresses, ["10.0.0.3/29", "2001:db8::3/64"]);
}

#[tokio::test]
async fn migration_0002_keeps_an_older_sqlite_store() {
    use sqlx::Connection;
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("old.db");
    let url = format!("sqlite://{}?mode=rwc", path.display());
    let mut c = sqlx::SqliteConnection::connect(&url).await.unwrap();
    older_store(&mut c, &SQLITE_MIGRATOR).await;
    sqlx::raw_sql(OLD_SQLITE).execute(&mut c).await.unwrap();
    c.close().await.unwrap();
    let db = Db::connect(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    upgraded_store_works(&db).await;
}

#[tokio::test]
async fn migration_0002_keeps_an_older_postgres_store_and_the_operator_sql() {
    use sqlx::Connection;
    let pg = vmnet_testkit::postgres::PgCluster::shared();
    let url = pg.fresh_database_url().unwrap();
    let mut c = sqlx::PgConnection::connect(&url).await.unwrap();
    older_store(&mut c, &POSTGRES_MIGRATOR).await;
    sqlx::raw_sql(OLD_POSTGRES).execute(&mut c).await.unwrap();
    let db = Db::connect(&url).await.unwrap();
    upgraded_store_works(&db).await;
    // The spec's operator SQL, unchanged, reads the IPv4 plan and leases.
    let plan: (String, String, String, String) = sqlx::query_as(
        "SELECT cidr::text, host(gateway) AS gateway, host(first_host) AS first, host(last_host) AS last \
         FROM ip_pools WHERE pool_id = $1",
    )
    .bind("p1")
    .fetch_one(&mut c)
    .await
    .unwrap();
    assert_eq!(
        plan,
        (
            "10.0.0.0/29".into(),
            "10.0.0.1".into(),
            "10.0.0.2".into(),
            "10.0.0.6".into()
        )
    );
    let leases: Vec<(String, String)> = sqlx::query_as(
        "SELECT host(address) AS address, instance_id FROM ip_leases WHERE pool_id = $1 ORDER BY address",
    )
    .bind("p1")
    .fetch_all(&mut c)
    .await
    .unwrap();
    let leases: Vec<String> = leases.iter().map(|(a, i)| format!("{a} {i}")).collect();
    assert_eq!(
        leases,
        [
            "10.0.0.2 vm0",
            "10.0.0.3 vm1",
            "10.0.0.4 vm2",
            "10.0.0.5 vm3"
        ]
    );
    // And the documented IPv6 equivalents.
    let ranges: Vec<(String, String, String, String)> = sqlx::query_as(
        "SELECT cidr::text, host(gateway) AS gateway, host(first_host) AS first, host(last_host) AS last \
         FROM ip_ranges WHERE pool_id = $1 AND family = 6 ORDER BY seq",
    )
    .bind("p1")
    .fetch_all(&mut c)
    .await
    .unwrap();
    assert_eq!(ranges[0].0, "2001:db8::/64");
    let leases6: Vec<(String, String)> = sqlx::query_as(
        "SELECT host(address) AS address, instance_id FROM ip6_leases WHERE pool_id = $1 ORDER BY address",
    )
    .bind("p1")
    .fetch_all(&mut c)
    .await
    .unwrap();
    let leases6: Vec<String> = leases6.iter().map(|(a, i)| format!("{a} {i}")).collect();
    assert_eq!(leases6, ["2001:db8::2 vm3", "2001:db8::3 vm1"]);
}
