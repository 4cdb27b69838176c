//! `mesh_store` (the record of applied WireGuard peers and the whitelist) on both stores.

mod common;

use vmnet_ipam::mesh_store::{self, MeshPeerRow};
use vmnet_ipam::{Db, Store};

fn row(k: &str, mesh: &str) -> MeshPeerRow {
    MeshPeerRow {
        public_key: k.to_owned(),
        endpoint: "[fd00:10::2]:51820".to_owned(),
        mesh_address: mesh.to_owned(),
        leaving: false,
    }
}

async fn exercise(db: &Db) {
    let mut tx = db.begin().await.unwrap();
    assert!(mesh_store::list_peers(&mut tx).await.unwrap().is_empty());
    mesh_store::upsert_peers(&mut tx, &[row("b", "fdaa::2"), row("a", "fdaa::1")], 1)
        .await
        .unwrap();
    mesh_store::upsert_peers(&mut tx, &[row("b", "fdaa::22")], 2)
        .await
        .unwrap();
    mesh_store::mark_leaving(&mut tx, &["a".to_owned()], 3)
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let mut tx = db.begin().await.unwrap();
    let got = mesh_store::list_peers(&mut tx).await.unwrap();
    let mut a = row("a", "fdaa::1");
    a.leaving = true;
    assert_eq!(got, vec![a, row("b", "fdaa::22")]);
    // A leaving row that came back is not deleted; one still leaving is.
    mesh_store::delete_leaving(&mut tx, &["a".to_owned(), "b".to_owned()])
        .await
        .unwrap();
    assert_eq!(
        mesh_store::list_peers(&mut tx).await.unwrap(),
        vec![row("b", "fdaa::22")]
    );
    mesh_store::set_whitelist(
        &mut tx,
        &["fdaa::1/128".to_owned(), "fdaa:2::/32".to_owned()],
    )
    .await
    .unwrap();
    mesh_store::set_whitelist(
        &mut tx,
        &["fdaa:2::/32".to_owned(), "fdaa:3::/32".to_owned()],
    )
    .await
    .unwrap();
    assert_eq!(
        mesh_store::whitelist(&mut tx).await.unwrap(),
        ["fdaa:2::/32", "fdaa:3::/32"]
    );
    tx.commit().await.unwrap();
}

#[tokio::test]
async fn mesh_record_on_sqlite() {
    exercise(&common::sqlite().await.db).await;
}

#[tokio::test]
async fn mesh_record_on_postgres() {
    exercise(&common::postgres().await.db).await;
}
