//! Random operation sequences (create, delete, host loss, host add, range replacement) keep the
//! invariants on both stores: one lease per placed instance, none leaked or shared, the free
//! index equal to range - gateway - leases, claims equal to placed requests; every successful
//! create gets the lowest free address; every failed operation leaves the database unchanged.
#![allow(missing_docs)]

mod common;

use std::net::Ipv4Addr;

use common::*;
use proptest::prelude::*;
use vmnet_ipam::{Db, Store};

#[derive(Debug, Clone)]
enum Op {
    Create {
        id: u8,
        host: Option<u8>,
        recreate: bool,
        vcpus: u32,
    },
    Delete {
        id: u8,
    },
    Lose {
        host: u8,
    },
    AddHost {
        host: u8,
    },
    SetRange {
        last: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0u8..12, proptest::option::of(0u8..4), any::<bool>(), 1u32..3)
            .prop_map(|(id, host, recreate, vcpus)| Op::Create { id, host, recreate, vcpus }),
        2 => (0u8..12).prop_map(|id| Op::Delete { id }),
        1 => (0u8..4).prop_map(|host| Op::Lose { host }),
        1 => (0u8..4).prop_map(|host| Op::AddHost { host }),
        1 => (3u8..9).prop_map(|last| Op::SetRange { last }),
    ]
}

fn pool_range(last: u8) -> vmnet_ipam::SetIpPool {
    let mut r = range("p", "10.0.0.0/28", "10.0.0.4");
    r.first_host = Some("10.0.0.2".into());
    r.last_host = Some(format!("10.0.0.{last}"));
    r
}

/// The lowest leasable address not leased, from the tables before the operation.
async fn expected_lowest(db: &Db) -> Option<Ipv4Addr> {
    let mut tx = db.begin().await.unwrap();
    let r = vmnet_ipam::get_ip_pool(&mut tx, "p")
        .await
        .unwrap()
        .unwrap();
    let leased: Vec<_> = vmnet_ipam::list_leases(&mut tx, "p")
        .await
        .unwrap()
        .into_iter()
        .map(|l| l.address)
        .filter_map(|a| match a {
            std::net::IpAddr::V4(a) => Some(a),
            std::net::IpAddr::V6(_) => None,
        })
        .collect();
    tx.commit().await.unwrap();
    (u32::from(r.first_host)..=u32::from(r.last_host))
        .map(Ipv4Addr::from)
        .find(|a| r.is_leasable(*a) && !leased.contains(a))
}

async fn run(db: &Db, ops: Vec<Op>) {
    set_pool(db, pool_range(8)).await.unwrap();
    add_host(db, "h0", 4, 4096).await;
    add_host(db, "h1", 4, 4096).await;
    for op in ops {
        let before = snapshot(db).await;
        let failed = match &op {
            Op::Create {
                id,
                host,
                recreate,
                vcpus,
            } => {
                let lowest = expected_lowest(db).await;
                let mut req = inst(&format!("vm{id}"), "p");
                req.host_id = host.map(|h| format!("h{h}"));
                req.recreate_on_host_loss = *recreate;
                req.vcpus = *vcpus;
                let mut tx = db.begin().await.unwrap();
                let existing = vmnet_ipam::get_instance(&mut tx, &req.instance_id)
                    .await
                    .ok();
                tx.commit().await.unwrap();
                match create(db, &req).await {
                    Ok(i) if existing.is_some() => {
                        // The same request for an existing instance: answered as it is.
                        assert_eq!(Some(i), existing, "{op:?} answered the existing instance");
                        assert_eq!(snapshot(db).await, before, "{op:?} changed nothing");
                        None
                    }
                    Ok(i) => {
                        assert_eq!(i.address, lowest, "{op:?} got the lowest free address");
                        None
                    }
                    Err(e) => {
                        assert!(
                            matches!(kind(&e), Kind::Exhausted | Kind::Conflict | Kind::NotFound),
                            "{op:?}: {e}"
                        );
                        if e.to_string() == "Pool p has no free IP address" {
                            assert_eq!(lowest, None, "{op:?} failed with a free address");
                        }
                        Some(e)
                    }
                }
            }
            Op::Delete { id } => delete(db, &format!("vm{id}")).await.err(),
            Op::Lose { host } => lose(db, &format!("h{host}")).await.err(),
            Op::AddHost { host } => {
                let mut tx = db.begin().await.unwrap();
                let r = vmnet_ipam::add_host(&mut tx, &format!("h{host}"), 4, 4096).await;
                tx.commit().await.unwrap();
                r.err()
            }
            Op::SetRange { last } => set_pool(db, pool_range(*last)).await.err(),
        };
        if let Some(e) = failed {
            assert_ne!(kind(&e), Kind::Unavailable, "{op:?}: {e}");
            assert_eq!(
                snapshot(db).await,
                before,
                "{op:?} failed ({e}) and changed the database"
            );
        }
        check_invariants(db).await;
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, max_shrink_iters: 50, ..ProptestConfig::default() })]

    #[test]
    fn random_operations_keep_invariants_sqlite(ops in proptest::collection::vec(op(), 1..30)) {
        runtime().block_on(async {
            let t = sqlite().await;
            run(&t.db, ops).await;
        });
    }

    #[test]
    fn random_operations_keep_invariants_postgres(ops in proptest::collection::vec(op(), 1..30)) {
        runtime().block_on(async {
            let t = postgres().await;
            run(&t.db, ops).await;
            t.db.close().await;
        });
    }
}
