//! `vm_store` (the agent's desired VM configs) on both stores: put/get/list, the unique user id,
//! outcomes, restore after a failed change, delete; a failed transaction leaves nothing.

mod common;

use common::{Kind, kind, postgres_after, sqlite_after};
use vmnet_ipam::vm_store::{self, VmRow};
use vmnet_ipam::{Db, Store};

async fn exercise(db: &Db) {
    let mut tx = db.begin().await.unwrap();
    assert_eq!(
        vm_store::put(&mut tx, "a", 1, None, r#"{"v":1}"#, 10)
            .await
            .unwrap(),
        None
    );
    let before = vm_store::put(&mut tx, "a", 1, None, r#"{"v":2}"#, 11)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(before.config, r#"{"v":1}"#);
    vm_store::put(&mut tx, "b", 2, None, r#"{"b":1}"#, 12)
        .await
        .unwrap();
    let e = vm_store::put(&mut tx, "c", 2, None, "{}", 13)
        .await
        .unwrap_err();
    assert_eq!(kind(&e), Kind::Conflict);
    assert!(
        e.to_string().contains("user_id 2 is already used by vm b"),
        "{e}"
    );
    tx.commit().await.unwrap();

    // The mesh address is unique too; a VM may keep or change its own.
    let mut tx = db.begin().await.unwrap();
    vm_store::put(&mut tx, "m1", 101, Some("fdaa:1::100"), "{}", 14)
        .await
        .unwrap();
    let e = vm_store::put(&mut tx, "m3", 103, Some("fdaa:1::100"), "{}", 15)
        .await
        .unwrap_err();
    assert_eq!(kind(&e), Kind::Conflict);
    assert!(
        e.to_string()
            .contains("vm m3: mesh_ipv6 fdaa:1::100 is already used by vm m1"),
        "{e}"
    );
    vm_store::put(&mut tx, "m1", 101, Some("fdaa:1::100"), "{}", 16)
        .await
        .unwrap();
    let before = vm_store::put(&mut tx, "m1", 101, Some("fdaa:1::101"), "{}", 17)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(before.mesh.as_deref(), Some("fdaa:1::100"));
    vm_store::put(&mut tx, "m3", 103, Some("fdaa:1::100"), "{}", 18)
        .await
        .unwrap();
    // Restoring m1's old row while m3 holds its old address is refused by the index, not
    // silently duplicated (the agent restores under its kernel lock, so this is a guard).
    assert!(
        vm_store::restore(&mut tx, "m1", Some(&before))
            .await
            .is_err()
    );
    tx.rollback().await.unwrap();

    // The unique index holds even for a write that skips the check (restore), on both stores.
    let mut tx = db.begin().await.unwrap();
    vm_store::put(&mut tx, "m1", 101, Some("fdaa:1::100"), "{}", 14)
        .await
        .unwrap();
    vm_store::put(&mut tx, "m2", 102, None, "{}", 14)
        .await
        .unwrap();
    vm_store::put(&mut tx, "m4", 104, None, "{}", 14)
        .await
        .unwrap();
    let m2 = vm_store::get(&mut tx, "m2").await.unwrap().unwrap();
    assert_eq!(m2.mesh, None, "VMs without a mesh address do not collide");
    let dup = VmRow {
        mesh: Some("fdaa:1::100".into()),
        ..m2
    };
    assert!(vm_store::restore(&mut tx, "m2", Some(&dup)).await.is_err());
    tx.rollback().await.unwrap();

    let mut tx = db.begin().await.unwrap();
    vm_store::set_result(&mut tx, "a", Some(r#"{"v":2}"#), None, 20)
        .await
        .unwrap();
    let e = vm_store::set_result(&mut tx, "zz", None, None, 20)
        .await
        .unwrap_err();
    assert_eq!(kind(&e), Kind::NotFound);
    let good: VmRow = vm_store::get(&mut tx, "a").await.unwrap().unwrap();
    assert_eq!(
        (good.applied.as_deref(), good.updated_at),
        (Some(r#"{"v":2}"#), 20)
    );
    // A change that fails is put back exactly, with the error recorded by the caller.
    let prev = vm_store::put(&mut tx, "a", 5, None, r#"{"v":3}"#, 30)
        .await
        .unwrap();
    vm_store::restore(&mut tx, "a", prev.as_ref())
        .await
        .unwrap();
    assert_eq!(vm_store::get(&mut tx, "a").await.unwrap().unwrap(), good);
    // A new VM whose first apply fails is removed again.
    vm_store::put(&mut tx, "new", 9, None, "{}", 40)
        .await
        .unwrap();
    vm_store::restore(&mut tx, "new", None).await.unwrap();
    assert!(vm_store::get(&mut tx, "new").await.unwrap().is_none());
    tx.commit().await.unwrap();

    // Dropping a transaction rolls its writes back.
    {
        let mut tx = db.begin().await.unwrap();
        vm_store::put(&mut tx, "ghost", 77, None, "{}", 50)
            .await
            .unwrap();
    }
    let mut tx = db.begin().await.unwrap();
    let ids: Vec<String> = vm_store::list(&mut tx)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(ids, ["a", "b"]);
    assert!(vm_store::delete(&mut tx, "b").await.unwrap());
    assert!(!vm_store::delete(&mut tx, "b").await.unwrap());
    tx.commit().await.unwrap();
}

#[tokio::test]
async fn sqlite() {
    exercise(&common::sqlite().await.db).await;
}

#[tokio::test]
async fn postgres() {
    exercise(&common::postgres().await.db).await;
}

/// Rows stored before migration 0101, two of them sharing a mesh address.
const OLD_ROWS: &str = r#"INSERT INTO vm_configs (id, user_id, config, updated_at) VALUES
    ('a1', 1, '{"id":"a1","mesh_ipv6":"fdaa:1::100"}', 1),
    ('a3', 3, '{"id":"a3","mesh_ipv6":"fdaa:1::100"}', 1),
    ('b', 4, '{"id":"b"}', 1),
    ('c', 5, '{"id":"c","mesh_ipv6":"fdaa:1::5"}', 1);"#;
const BACKFILLED: &str = "SELECT id, COALESCE(mesh, '-') FROM vm_configs ORDER BY id";
/// What 0101 makes of [`OLD_ROWS`]: the smallest id keeps a shared address.
const WANT: [(&str, &str); 4] = [
    ("a1", "fdaa:1::100"),
    ("a3", "-"),
    ("b", "-"),
    ("c", "fdaa:1::5"),
];

#[tokio::test]
async fn migration_0101_backfills_mesh_on_sqlite() {
    let (_tmp, mut c) = sqlite_after(&[
        include_str!("../migrations/sqlite/0100_vm_configs.sql"),
        OLD_ROWS,
        include_str!("../migrations/sqlite/0101_vm_mesh_unique.sql"),
    ])
    .await;
    let got: Vec<(String, String)> = sqlx::query_as(BACKFILLED).fetch_all(&mut c).await.unwrap();
    let got: Vec<(&str, &str)> = got.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
    assert_eq!(got, WANT);
}

#[tokio::test]
async fn migration_0101_backfills_mesh_on_postgres() {
    let (pg, db) = postgres_after(&[
        include_str!("../migrations/postgres/0100_vm_configs.sql"),
        OLD_ROWS,
        include_str!("../migrations/postgres/0101_vm_mesh_unique.sql"),
    ]);
    let got = pg.psql(&db, BACKFILLED).unwrap();
    let want: Vec<String> = WANT.iter().map(|(a, b)| format!("{a}|{b}")).collect();
    assert_eq!(got.lines().collect::<Vec<_>>(), want);
}
