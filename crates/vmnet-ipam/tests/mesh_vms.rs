//! `mesh_vms` (the mesh's VM registrations) on both stores: each host writes only its own rows,
//! a re-registration keeps the claim's age, a complete replacement writes only what differs,
//! conflicting claims resolve by age then host; on PostgreSQL a change notifies the listeners.

mod common;

use std::time::Duration;

use vmnet_ipam::mesh_vms::{self, MeshVmRow, Replaced};
use vmnet_ipam::{Db, Store};

fn row(host: &str, addr: &str, uid: u32, at: i64) -> MeshVmRow {
    MeshVmRow {
        host: host.to_owned(),
        mesh_address: addr.to_owned(),
        user_id: uid,
        tenant: 1,
        public_block: None,
        gateway: false,
        registered_at: at,
    }
}

async fn exercise(db: &Db) {
    let mut tx = db.begin().await.unwrap();
    assert!(mesh_vms::list(&mut tx).await.unwrap().is_empty());
    assert!(
        mesh_vms::register(&mut tx, &row("fdaa::1", "fdaa:1::1", 1, 10))
            .await
            .unwrap()
    );
    assert!(
        mesh_vms::register(&mut tx, &row("fdaa::2", "fdaa:2::1", 1, 11))
            .await
            .unwrap()
    );
    // The same claim again writes nothing; a changed one is rewritten with its age kept.
    assert!(
        !mesh_vms::register(&mut tx, &row("fdaa::1", "fdaa:1::1", 1, 20))
            .await
            .unwrap()
    );
    let mut changed = row("fdaa::1", "fdaa:1::1", 1, 30);
    changed.tenant = 2;
    changed.public_block = Some("2001:db8:1::/48".to_owned());
    changed.gateway = true;
    assert!(mesh_vms::register(&mut tx, &changed).await.unwrap());
    tx.commit().await.unwrap();

    let mut tx = db.begin().await.unwrap();
    let all = mesh_vms::list(&mut tx).await.unwrap();
    assert_eq!(
        all,
        vec![
            MeshVmRow {
                registered_at: 10,
                ..changed.clone()
            },
            row("fdaa::2", "fdaa:2::1", 1, 11)
        ]
    );
    // Host 2 claims host 1's address later: host 1's older claim wins.
    assert!(
        mesh_vms::register(&mut tx, &row("fdaa::2", "fdaa:1::1", 7, 40))
            .await
            .unwrap()
    );
    let (w, c) = mesh_vms::resolve(&mesh_vms::list(&mut tx).await.unwrap());
    assert_eq!(w["fdaa:1::1"].host, "fdaa::1");
    assert_eq!(c.len(), 1);
    assert_eq!(c[0].losers, ["fdaa::2"]);

    // A complete replacement of host 2's set touches only host 2's rows, and only what differs.
    let r = mesh_vms::replace_host(
        &mut tx,
        "fdaa::2",
        &[
            row("fdaa::2", "fdaa:2::1", 1, 50),
            row("fdaa::2", "fdaa:2::2", 2, 50),
        ],
    )
    .await
    .unwrap();
    assert_eq!(
        r,
        Replaced {
            written: vec!["fdaa:2::2".to_owned()],
            removed: vec!["fdaa:1::1".to_owned()],
        }
    );
    assert!(
        mesh_vms::replace_host(&mut tx, "fdaa::2", &[row("fdaa::1", "fdaa:2::9", 1, 1)])
            .await
            .is_err(),
        "a host writes only its own rows"
    );
    assert_eq!(
        mesh_vms::of_host(&mut tx, "fdaa::1").await.unwrap().len(),
        1
    );
    assert!(
        mesh_vms::unregister(&mut tx, "fdaa::1", "fdaa:1::1")
            .await
            .unwrap()
    );
    assert!(
        !mesh_vms::unregister(&mut tx, "fdaa::1", "fdaa:1::1")
            .await
            .unwrap()
    );
    let left: Vec<String> = mesh_vms::list(&mut tx)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.mesh_address)
        .collect();
    assert_eq!(left, ["fdaa:2::1", "fdaa:2::2"]);
    tx.commit().await.unwrap();
}

#[tokio::test]
async fn registrations_on_sqlite() {
    let t = common::sqlite().await;
    exercise(&t.db).await;
    assert!(mesh_vms::listener(&t.db).await.unwrap().is_none());
}

#[tokio::test]
async fn registrations_on_postgres() {
    exercise(&common::postgres().await.db).await;
}

#[tokio::test]
async fn a_committed_registration_notifies_the_listeners_on_postgres() {
    let t = common::postgres().await;
    let mut l = mesh_vms::listener(&t.db)
        .await
        .unwrap()
        .expect("a listener");
    let mut tx = t.db.begin().await.unwrap();
    mesh_vms::register(&mut tx, &row("fdaa::1", "fdaa:1::1", 1, 1))
        .await
        .unwrap();
    // Nothing before the commit.
    assert!(
        tokio::time::timeout(Duration::from_millis(200), l.recv())
            .await
            .is_err()
    );
    tx.commit().await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), l.recv())
        .await
        .expect("a notification within 5 s")
        .unwrap();
    assert_eq!(n.channel(), mesh_vms::CHANNEL);
}
