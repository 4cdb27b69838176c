//! `vm_store` (the agent's desired VM configs) on both stores: put/get/list, the unique user id,
//! outcomes, restore after a failed change, delete; a failed transaction leaves nothing; the
//! one-write path (`get_if_free` then `save`); the states read without the configs.

mod common;

use common::{Kind, kind, postgres_after, sqlite_after};
use vmnet_ipam::vm_store::{self, VmRow};
use vmnet_ipam::{Db, IpamError, Store};

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

/// `get_if_free` reads only, answers the VM's own row and names a holder; `save` writes every column in one statement,
/// inserting or replacing, and its unique indexes still refuse a taken user id or mesh address.
async fn exercise_save(db: &Db) {
    let row = |id: &str, uid: u32, mesh: Option<&str>, cfg: &str| VmRow {
        id: id.to_owned(),
        user_id: uid,
        mesh: mesh.map(str::to_owned),
        config: cfg.to_owned(),
        applied: Some(cfg.to_owned()),
        last_error: None,
        updated_at: 7,
    };
    let mut tx = db.begin().await.unwrap();
    let s1 = row("s1", 201, Some("fdaa:1::201"), r#"{"s":1}"#);
    let none = vm_store::get_if_free(&mut tx, "s1", 201, Some("fdaa:1::201"))
        .await
        .unwrap();
    assert_eq!(none, None);
    vm_store::save(&mut tx, &s1).await.unwrap();
    assert_eq!(vm_store::get(&mut tx, "s1").await.unwrap().unwrap(), s1);
    // Its own user id and address are free for itself, not for another VM.
    let own = vm_store::get_if_free(&mut tx, "s1", 201, Some("fdaa:1::201"))
        .await
        .unwrap();
    assert_eq!(own.as_ref(), Some(&s1));
    let e = vm_store::get_if_free(&mut tx, "s2", 201, None)
        .await
        .unwrap_err();
    assert!(matches!(e, IpamError::Conflict(_)), "{e:?}");
    assert!(
        e.to_string()
            .contains("user_id 201 is already used by vm s1"),
        "{e}"
    );
    let e = vm_store::get_if_free(&mut tx, "s2", 202, Some("fdaa:1::201"))
        .await
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("vm s2: mesh_ipv6 fdaa:1::201 is already used by vm s1"),
        "{e}"
    );
    // Replacing keeps one row with the new columns.
    let mut s1b = row("s1", 203, None, r#"{"s":2}"#);
    s1b.applied = Some(r#"{"s":1}"#.to_owned());
    s1b.last_error = Some("boom".to_owned());
    vm_store::save(&mut tx, &s1b).await.unwrap();
    assert_eq!(vm_store::get(&mut tx, "s1").await.unwrap().unwrap(), s1b);
    tx.commit().await.unwrap();
    // Without the check, the indexes still refuse (the transaction is then rolled back).
    let mut tx = db.begin().await.unwrap();
    let e = vm_store::save(&mut tx, &row("s2", 203, None, "{}"))
        .await
        .unwrap_err();
    assert!(matches!(e, IpamError::Conflict(_)), "{e:?}");
    assert!(e.to_string().contains("vm s2: user_id 203"), "{e}");
    drop(tx);
    let mut tx = db.begin().await.unwrap();
    // s1 gave fdaa:1::201 up above: it is free now.
    vm_store::save(&mut tx, &row("s3", 204, Some("fdaa:1::201"), "{}"))
        .await
        .unwrap();
    let e = vm_store::save(&mut tx, &row("s4", 205, Some("fdaa:1::201"), "{}"))
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("vm s4: mesh_ipv6 fdaa:1::201"),
        "{e}"
    );
}

/// `states` classifies every row as one would from the whole row: failed when the last apply
/// failed, applied when the applied config is the desired one, else pending.
async fn exercise_states(db: &Db) {
    use vm_store::VmState::{Applied, Failed, Pending};
    let mut tx = db.begin().await.unwrap();
    for (id, uid, applied, error) in [
        ("t1", 301, None, None),
        ("t2", 302, Some(r#"{"t":"t2"}"#), None),
        ("t3", 303, Some(r#"{"t":"old"}"#), None),
        ("t4", 304, Some(r#"{"t":"t4"}"#), Some("boom")),
    ] {
        let cfg = format!(r#"{{"t":"{id}"}}"#);
        vm_store::put(&mut tx, id, uid, None, &cfg, 20)
            .await
            .unwrap();
        vm_store::set_result(&mut tx, id, applied, error, 21)
            .await
            .unwrap();
    }
    let states = vm_store::states(&mut tx).await.unwrap();
    let want: Vec<_> = vm_store::list(&mut tx)
        .await
        .unwrap()
        .into_iter()
        .map(|r| {
            let s = if r.last_error.is_some() {
                Failed
            } else if r.applied.as_deref() == Some(r.config.as_str()) {
                Applied
            } else {
                Pending
            };
            (r.id, r.user_id, s)
        })
        .collect();
    assert_eq!(states, want);
    for (id, uid, s) in [
        ("t1", 301, Pending),
        ("t2", 302, Applied),
        ("t3", 303, Pending),
        ("t4", 304, Failed),
    ] {
        assert!(
            states.contains(&(id.to_owned(), uid, s)),
            "{id}: {states:?}"
        );
    }
    tx.commit().await.unwrap();
}

/// The candidates of a public address check: only the rows that could conflict, found through
/// the indexed columns every write keeps (migration 0140), whatever was stored before.
async fn exercise_public(db: &Db) {
    let cfg = |v4: &str, v6: &str| {
        let mut s = String::from(r#"{"firewall":{"enabled":true,"inbound":[]}"#);
        if !v4.is_empty() {
            s.push_str(&format!(r#","public_ipv4":"{v4}""#));
        }
        if !v6.is_empty() {
            s.push_str(&format!(r#","public_ipv6":"{v6}""#));
        }
        s.push('}');
        s
    };
    let mut tx = db.begin().await.unwrap();
    let rows = [
        ("p1", "203.0.113.1", "2001:db8:1::/56"),
        ("p2", "", "2001:db8:2::5"),
        ("p3", "203.0.113.3", "2001:db8:3::/48"),
        ("p4", "", ""),
    ];
    for (i, (id, v4, v6)) in (300u32..).zip(rows) {
        vm_store::put(&mut tx, id, i, None, &cfg(v4, v6), 1)
            .await
            .unwrap();
    }
    // p2 rewritten by `save`: the columns follow the config.
    let mut p2 = vm_store::get(&mut tx, "p2").await.unwrap().unwrap();
    p2.config = cfg("", "2001:db8:2::6");
    vm_store::save(&mut tx, &p2).await.unwrap();
    let ids = |v: Vec<(String, String)>| v.into_iter().map(|(id, _)| id).collect::<Vec<_>>();
    let net = |s: &str| Some(s.parse().unwrap());
    let cand = async |tx: &mut vmnet_ipam::db::Tx, v4: Option<&str>, v6: Option<ipnet::Ipv6Net>| {
        ids(
            vm_store::public_candidates(tx, "new", v4.map(|a| a.parse().unwrap()), v6)
                .await
                .unwrap(),
        )
    };
    assert_eq!(cand(&mut tx, Some("203.0.113.3"), None).await, ["p3"]);
    assert!(cand(&mut tx, Some("203.0.113.9"), None).await.is_empty());
    // Inside p1's block: p1 starts last before it.
    assert_eq!(
        cand(&mut tx, None, net("2001:db8:1:5::1/128")).await,
        ["p1"]
    );
    // A /32 holding every block: each starts inside it.
    assert_eq!(
        cand(&mut tx, None, net("2001:db8::/32")).await,
        ["p1", "p2", "p3"]
    );
    // p2's new address (not its old one), and p1 starting last before it.
    assert_eq!(
        cand(&mut tx, None, net("2001:db8:2::6/128")).await,
        ["p1", "p2"]
    );
    assert_eq!(cand(&mut tx, None, net("2001:db8:2::5/128")).await, ["p1"]);
    assert_eq!(
        ids(
            vm_store::public_candidates(&mut tx, "p2", None, net("2001:db8:2::6/128"))
                .await
                .unwrap()
        ),
        ["p1"],
        "a VM is not its own candidate (the one before is p1, which a caller then compares)"
    );
    for id in ["p1", "p2", "p3", "p4"] {
        vm_store::delete(&mut tx, id).await.unwrap();
    }
    tx.commit().await.unwrap();
}

#[tokio::test]
async fn sqlite() {
    let s = common::sqlite().await;
    exercise(&s.db).await;
    exercise_save(&s.db).await;
    exercise_public(&s.db).await;
    exercise_states(&s.db).await;
}

#[tokio::test]
async fn postgres() {
    let s = common::postgres().await;
    exercise(&s.db).await;
    exercise_save(&s.db).await;
    exercise_public(&s.db).await;
    exercise_states(&s.db).await;
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
