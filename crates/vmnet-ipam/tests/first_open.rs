//! Opening a fresh SQLite database from several connections at once: every open succeeds and
//! the migrations run once (before the migration lock, all but one failed on "table pools
//! already exists", as parallel first runs of the CLI did).
#![allow(missing_docs)]

use vmnet_ipam::Db;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_first_opens_of_one_sqlite_file_all_succeed() {
    for round in 0..5 {
        let tmp = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/state/vmnet.db", tmp.path().display());
        let opens: Vec<_> = (0..8)
            .map(|_| {
                let url = url.clone();
                tokio::spawn(async move { Db::connect(&url).await })
            })
            .collect();
        for (i, o) in opens.into_iter().enumerate() {
            let db = o
                .await
                .unwrap()
                .unwrap_or_else(|e| panic!("round {round}, open {i}: {e:?}"));
            db.close().await;
        }
    }
}
