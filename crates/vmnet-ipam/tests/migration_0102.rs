//! Migration 0102 (instance network policy, sandbox, allocation id) on rows stored before it:
//! they read as policy `public`, sandbox off, allocation id = instance id, on both stores.
#![allow(missing_docs)]

mod common;

use common::{postgres_after, sqlite_after};

/// Instances stored before migration 0102.
const OLD_ROWS: &str = "INSERT INTO pools (pool_id) VALUES ('p1');
INSERT INTO instances (instance_id, pool_id, vcpus, memory_mib, state) VALUES
    ('vm1', 'p1', 1, 512, 'running'),
    ('vm2', 'p1', 2, 1024, 'lost');";
/// Booleans as text on both stores.
const READ: &str = "SELECT instance_id, network_policy, \
    CASE WHEN sandbox THEN 'true' ELSE 'false' END, allocation_id FROM instances ORDER BY instance_id";
const WANT: [&str; 2] = ["vm1|public|false|vm1", "vm2|public|false|vm2"];

#[tokio::test]
async fn migration_0102_defaults_old_instances_on_sqlite() {
    let (_tmp, mut c) = sqlite_after(&[
        include_str!("../migrations/sqlite/0001_ipam.sql"),
        OLD_ROWS,
        include_str!("../migrations/sqlite/0102_instance_policy.sql"),
    ])
    .await;
    let got: Vec<(String, String, String, String)> =
        sqlx::query_as(READ).fetch_all(&mut c).await.unwrap();
    let got: Vec<String> = got
        .iter()
        .map(|(a, b, c, d)| format!("{a}|{b}|{c}|{d}"))
        .collect();
    assert_eq!(got, WANT);
    let bad = sqlx::raw_sql("UPDATE instances SET network_policy = 'open'")
        .execute(&mut c)
        .await;
    assert!(bad.is_err(), "the CHECK refuses unknown policies");
}

#[tokio::test]
async fn migration_0102_defaults_old_instances_on_postgres() {
    let (pg, db) = postgres_after(&[
        include_str!("../migrations/postgres/0001_ipam.sql"),
        OLD_ROWS,
        include_str!("../migrations/postgres/0102_instance_policy.sql"),
    ]);
    let got = pg.psql(&db, READ).unwrap();
    assert_eq!(got.lines().collect::<Vec<_>>(), WANT);
    assert!(
        pg.psql(&db, "UPDATE instances SET network_policy = 'open'")
            .is_err()
    );
}
