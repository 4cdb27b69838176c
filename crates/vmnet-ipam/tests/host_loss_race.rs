//! Host loss racing placements (issue 8, item 9): a host is lost while 40 creates and deletes
//! run on their own connections, repeated 50 times. Every operation must succeed. Each runs in
//! one plain transaction, without the retry loop of `transaction!`, so this proves the lock
//! order alone (hosts, instances, range, free intervals): before it, PostgreSQL failed the host
//! loss with "deadlock detected" in the first round. SQLite runs the same rounds (its writers
//! are serialized). The retry itself is proved in `retry.rs`, the API's answers in the agent's
//! `api_store.rs`.
#![allow(missing_docs)]

mod common;

use std::sync::Arc;
use std::time::Instant;

use common::*;
use tokio::sync::Barrier;
use vmnet_ipam::IpamError;
use vmnet_ipam::{Db, NewInstance};

const ROUNDS: usize = 50;
const CREATES: usize = 20;
const DELETES: usize = 20;
const ON_LOST_HOST: usize = 10;

enum Op {
    Create(NewInstance),
    Delete(String),
    Lose(String),
}

async fn run(db: &Db, op: &Op) -> Result<String, IpamError> {
    match op {
        Op::Create(req) => create(db, req)
            .await
            .map(|i| format!("created {}", i.instance_id)),
        Op::Delete(id) => delete(db, id)
            .await
            .map(|i| format!("deleted {}", i.instance_id)),
        Op::Lose(h) => lose(db, h).await.map(|l| format!("lost {}", l.host_id)),
    }
}

async fn rounds(db: &Db) {
    let started = Instant::now();
    with_pool(db, "p1", "10.50.0.0/20", "10.50.0.1").await;
    for h in ["h0", "h1"] {
        add_host(db, h, 100_000, 100_000_000).await;
    }
    let mut live: Vec<String> = Vec::new();
    for r in 0..ROUNDS {
        // A host with instances on it, half of them recreated on loss (onto h0/h1, where the
        // creates claim too), and live instances from earlier rounds to delete.
        let lost = format!("lost{r:02}");
        add_host(db, &lost, 1_000, 1_000_000).await;
        for i in 0..ON_LOST_HOST {
            let mut req = inst(&format!("r{r:02}-on-{i}"), "p1");
            req.host_id = Some(lost.clone());
            req.recreate_on_host_loss = i % 2 == 0;
            create(db, &req).await.unwrap();
        }
        while live.len() < DELETES {
            let id = format!("r{r:02}-pre-{}", live.len());
            create(db, &inst(&id, "p1")).await.unwrap();
            live.push(id);
        }
        let mut ops: Vec<Op> = live.drain(..).map(Op::Delete).collect();
        let mut made = Vec::new();
        for i in 0..CREATES {
            let id = format!("r{r:02}-new-{i}");
            ops.push(Op::Create(inst(&id, "p1")));
            made.push(id);
        }
        ops.insert(ops.len() / 2, Op::Lose(lost));
        let barrier = Arc::new(Barrier::new(ops.len()));
        let mut tasks = Vec::new();
        for op in ops {
            let db = db.clone();
            let barrier = barrier.clone();
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                run(&db, &op).await
            }));
        }
        let mut failed = Vec::new();
        for t in tasks {
            if let Err(e) = t.await.unwrap() {
                failed.push(e.to_string());
            }
        }
        assert!(failed.is_empty(), "round {r}: {failed:#?}");
        live = made;
        if r % 10 == 9 {
            check_invariants(db).await;
        }
    }
    check_invariants(db).await;
    let took = started.elapsed();
    eprintln!(
        "{ROUNDS} rounds of a host loss with {CREATES} creates and {DELETES} deletes: {took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_host_loss_with_40_concurrent_creates_and_deletes_50_times() {
    let t = postgres_with(Some(48)).await;
    rounds(&t.db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_host_loss_with_40_concurrent_creates_and_deletes_50_times() {
    let t = sqlite().await;
    rounds(&t.db).await;
}
