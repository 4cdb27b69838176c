//! Pools must not share addresses: overlapping ranges and gateways that another pool leases are
//! refused with `CONFLICT` naming the other pool, also when the two ranges are set at the same
//! time on separate connections. Run against both stores.
#![allow(missing_docs)]

mod common;

mod overlap {
    use std::sync::Arc;

    use crate::common::Kind;
    use tokio::sync::Barrier;
    use vmnet_ipam::{Db, Store};

    use crate::common::*;

    async fn conflict(db: &Db, req: vmnet_ipam::SetIpPool, message: &str) {
        let before = snapshot(db).await;
        assert_err(set_pool(db, req).await, Kind::Conflict, message);
        assert_eq!(
            snapshot(db).await,
            before,
            "a refused range changes nothing"
        );
    }

    pub async fn overlapping_cidrs_are_refused(db: &Db) {
        with_pool(db, "p1", "10.20.0.0/24", "10.20.0.1").await;
        conflict(
            db,
            range("p2", "10.20.0.0/24", "10.20.0.1"),
            "pool p2: cidr 10.20.0.0/24 overlaps cidr 10.20.0.0/24 of pool p1",
        )
        .await;
        conflict(
            db,
            range("p2", "10.20.0.128/25", "10.20.0.129"),
            "pool p2: cidr 10.20.0.128/25 overlaps cidr 10.20.0.0/24 of pool p1",
        )
        .await;
        // The /16 that leased p1's broadcast address.
        conflict(
            db,
            range("p2", "10.20.0.0/16", "10.20.128.1"),
            "pool p2: cidr 10.20.0.0/16 overlaps cidr 10.20.0.0/24 of pool p1",
        )
        .await;
        let mut routed = range("p2", "10.20.0.9/32", "169.254.1.1");
        routed.first_host = Some("10.20.0.9".into());
        conflict(
            db,
            routed,
            "pool p2: cidr 10.20.0.9/32 overlaps cidr 10.20.0.0/24 of pool p1",
        )
        .await;
        // Neighbours are fine, and a pool may replace its own range with an overlapping one.
        with_pool(db, "p2", "10.20.1.0/24", "10.20.1.1").await;
        with_pool(db, "p1", "10.20.0.0/25", "10.20.0.1").await;
        conflict(
            db,
            range("p1", "10.20.0.0/23", "10.20.0.1"),
            "pool p1: cidr 10.20.0.0/23 overlaps cidr 10.20.1.0/24 of pool p2",
        )
        .await;
        check_invariants(db).await;
    }

    pub async fn gateway_leased_by_another_pool_is_refused(db: &Db) {
        let mut p1 = range("p1", "10.20.0.0/24", "10.20.0.1");
        p1.last_host = Some("10.20.0.50".into());
        set_pool(db, p1).await.unwrap();
        let mut req = range("p2", "10.30.0.0/24", "10.20.0.9");
        req.first_host = Some("10.30.0.1".into());
        conflict(
            db,
            req,
            "pool p2: gateway 10.20.0.9 is a leasable address of pool p1 (10.20.0.2 to 10.20.0.50)",
        )
        .await;
        // A routed /32 whose gateway p1 does not lease; then p1 may not grow over that gateway.
        let mut req = range("p3", "10.20.1.1/32", "10.20.0.77");
        req.first_host = Some("10.20.1.1".into());
        set_pool(db, req).await.unwrap();
        conflict(
            db,
            range("p1", "10.20.0.0/24", "10.20.0.1"),
            "pool p1: the gateway 10.20.0.77 of pool p3 would be leased by this range (10.20.0.2 to 10.20.0.254)",
        )
        .await;
        // Sharing a gateway (routed /32 pools behind one on-link gateway) is fine.
        for (p, a) in [("r1", "203.0.113.7"), ("r2", "203.0.113.8")] {
            let mut req = range(p, &format!("{a}/32"), "169.254.1.1");
            req.first_host = Some(a.into());
            set_pool(db, req).await.unwrap();
        }
        check_invariants(db).await;
    }

    /// Twelve pools set the same range at once, each on its own connection: exactly one wins,
    /// the others get `CONFLICT` naming the winner.
    pub async fn concurrent_overlapping_ranges_one_wins(db: &Db) {
        let n = 12;
        let barrier = Arc::new(Barrier::new(n));
        let mut tasks = Vec::new();
        for i in 0..n {
            let db = db.clone();
            let barrier = barrier.clone();
            tasks.push(tokio::spawn(async move {
                let pool = format!("p{i:02}");
                let mut tx = db.begin().await.unwrap();
                vmnet_ipam::create_pool(&mut tx, &pool).await.unwrap();
                tx.commit().await.unwrap();
                barrier.wait().await;
                let cidr = if i % 2 == 0 {
                    "10.40.0.0/24"
                } else {
                    "10.40.0.0/16"
                };
                (
                    pool.clone(),
                    set_pool(&db, range(&pool, cidr, "10.40.0.1")).await,
                )
            }));
        }
        let mut won = Vec::new();
        let mut refused = Vec::new();
        for t in tasks {
            match t.await.unwrap() {
                (p, Ok(_)) => won.push(p),
                (p, Err(e)) => refused.push((p, e)),
            }
        }
        assert_eq!(
            won.len(),
            1,
            "exactly one range may win: {won:?}, {refused:?}"
        );
        for (p, e) in &refused {
            assert_eq!(kind(e), Kind::Conflict, "{p}: {e}");
            assert!(
                e.to_string()
                    .starts_with(&format!("pool {p}: cidr 10.40.0.0/"))
                    && e.to_string().ends_with(&format!("of pool {}", won[0])),
                "{p}: {e}"
            );
        }
        check_invariants(db).await;
    }
}

conformance!(overlap:
    overlapping_cidrs_are_refused,
    gateway_leased_by_another_pool_is_refused,
    concurrent_overlapping_ranges_one_wins,
);
