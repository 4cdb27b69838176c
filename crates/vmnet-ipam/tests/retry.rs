//! Deadlocks on PostgreSQL: a transaction PostgreSQL fails with a deadlock is retried by
//! `transaction!` (bounded, with jitter) and succeeds; without the retry the caller sees our own
//! `UNAVAILABLE` sentence, never PostgreSQL's message ("deadlock detected at line …").
//!
//! The deadlock is forced: two transactions each hold one host row (taken by hand, against the
//! lock order) and then place an instance on the other host.
#![allow(missing_docs)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use common::*;
use tokio::sync::Barrier;
use vmnet_ipam::{BUSY, Db, Tx};

use vmnet_ipam::IpamError;

async fn lock_host_by_hand(tx: &mut Tx, host: &str) {
    let Tx::Postgres(t) = tx else {
        panic!("PostgreSQL only")
    };
    sqlx::query("UPDATE hosts SET vcpus = vcpus WHERE host_id = $1")
        .bind(host)
        .execute(&mut **t)
        .await
        .unwrap();
}

async fn setup() -> TestDb {
    let t = postgres_with(Some(8)).await;
    with_pool(&t.db, "p1", "10.0.0.0/24", "10.0.0.1").await;
    with_hosts(&t.db, &["a", "b"]).await;
    t
}

/// One side of the forced deadlock, in one transaction: hold `mine`, wait until the other side
/// holds its host too, then place an instance on `theirs`. `meet` is waited on only once.
async fn side(
    db: &Db,
    mine: &str,
    theirs: &str,
    meet: &Barrier,
    met: &AtomicBool,
) -> Result<(), IpamError> {
    vmnet_ipam::transaction!(db, tx => async {
        lock_host_by_hand(tx, mine).await;
        if !met.swap(true, Ordering::SeqCst) {
            meet.wait().await;
        }
        vmnet_ipam::create_instance(tx, &on(&format!("on-{theirs}"), "p1", theirs)).await
    }.await)
    .map(|_| ())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deadlocked_transaction_is_retried_and_succeeds() {
    let t = setup().await;
    let before = vmnet_ipam::retried_transactions();
    let meet = Arc::new(Barrier::new(2));
    let (met_a, met_b) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let (db1, db2) = (t.db.clone(), t.db.clone());
    let (m1, m2) = (meet.clone(), meet.clone());
    let one = tokio::spawn(async move { side(&db1, "a", "b", &m1, &met_a).await });
    let two = tokio::spawn(async move { side(&db2, "b", "a", &m2, &met_b).await });
    one.await.unwrap().unwrap();
    two.await.unwrap().unwrap();
    assert!(
        vmnet_ipam::retried_transactions() > before,
        "PostgreSQL broke the deadlock by failing one side, which ran again"
    );
    assert_eq!(leases(&t.db, "p1").await.len(), 2);
    check_invariants(&t.db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_a_retry_the_caller_sees_our_words_not_postgres() {
    let t = setup().await;
    let meet = Arc::new(Barrier::new(2));
    let mut tasks = Vec::new();
    for (mine, theirs) in [("a", "b"), ("b", "a")] {
        let db = t.db.clone();
        let meet = meet.clone();
        tasks.push(tokio::spawn(async move {
            use vmnet_ipam::Store;
            let mut tx = db.begin().await.unwrap();
            lock_host_by_hand(&mut tx, mine).await;
            meet.wait().await;
            let r =
                vmnet_ipam::create_instance(&mut tx, &on(&format!("on-{theirs}"), "p1", theirs))
                    .await;
            match r {
                Ok(_) => tx.commit().await,
                Err(e) => {
                    tx.rollback().await.unwrap();
                    Err(e)
                }
            }
        }));
    }
    let mut errors = Vec::new();
    for task in tasks {
        if let Err(e) = task.await.unwrap() {
            errors.push(e);
        }
    }
    assert_eq!(
        errors.len(),
        1,
        "PostgreSQL fails exactly one side: {errors:?}"
    );
    let e = &errors[0];
    assert_eq!(kind(e), Kind::Unavailable);
    assert_eq!(e.to_string(), BUSY);
    assert!(e.is_busy());
    check_invariants(&t.db).await;
}
