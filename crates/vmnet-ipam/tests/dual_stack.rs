//! The conformance suite, dual-stack part (issue 48), on both stores: the /29 walk-through with
//! an IPv6 range of 5 addresses beside it, a second IPv4 range used after the first is full,
//! the 200-instance churn on 3 hosts with one lease per family per instance, and concurrent
//! placements racing.
#![allow(missing_docs)]

mod common;

mod cases {
    use std::collections::BTreeSet;
    use std::sync::Arc;

    use tokio::sync::Barrier;
    use vmnet_ipam::{Db, Store};

    use crate::common::*;

    /// `/29` (gateway .1) and `2001:db8::/64` leasing `::2` to `::6` (gateway `::1`).
    async fn dual_pool(db: &Db, pool: &str) {
        with_pool(db, pool, "10.0.0.0/29", "10.0.0.1").await;
        let mut r = add(pool, "2001:db8::/64", "2001:db8::1");
        r.first_host = Some("2001:db8::2".into());
        r.last_host = Some("2001:db8::6".into());
        let v6 = add_range(db, r).await.unwrap();
        assert_eq!(v6.size(), 5);
    }

    /// The spec's walk-through, dual-stack: five instances get `.2`/`::2` to `.6`/`::6` in
    /// order, the sixth fails and leaves nothing behind, a delete frees both addresses and the
    /// sixth then gets both.
    pub async fn dual_stack_walk_through(db: &Db) {
        dual_pool(db, "p1").await;
        add_host(db, "h1", 64, 65536).await;
        for i in 0..5 {
            let got = create(db, &inst(&format!("vm{i}"), "p1")).await.unwrap();
            assert_eq!(got.address, Some(ip(&format!("10.0.0.{}", i + 2))));
            assert_eq!(got.address6, Some(ip6(&format!("2001:db8::{}", i + 2))));
            assert_eq!(
                got.addresses,
                [
                    format!("10.0.0.{}/29", i + 2),
                    format!("2001:db8::{}/64", i + 2)
                ]
            );
        }
        let before = snapshot(db).await;
        assert_err(
            create(db, &inst("vm5", "p1")).await,
            Kind::Exhausted,
            "Pool p1 has no free IP address",
        );
        assert_eq!(snapshot(db).await, before, "the failed create left nothing");
        let gone = delete(db, "vm2").await.unwrap();
        assert_eq!(gone.address6, Some(ip6("2001:db8::4")));
        assert!(leases6(db, "p1").await.iter().all(|(_, i)| i != "vm2"));
        let got = create(db, &inst("vm5", "p1")).await.unwrap();
        assert_eq!(
            (got.address, got.address6),
            (Some(ip("10.0.0.4")), Some(ip6("2001:db8::4")))
        );
        check_invariants(db).await;
    }

    /// IPv6 runs out while IPv4 has room: placement fails naming the pool and the family, and
    /// the IPv4 lease and the host claim roll back with it.
    pub async fn ipv6_exhaustion_fails_the_placement(db: &Db) {
        with_pool(db, "p1", "10.0.0.0/24", "10.0.0.1").await;
        let mut r = add("p1", "2001:db8::/64", "2001:db8::1");
        r.last_host = Some("2001:db8::3".into());
        add_range(db, r).await.unwrap();
        add_host(db, "h1", 64, 65536).await;
        create(db, &inst("vm0", "p1")).await.unwrap();
        create(db, &inst("vm1", "p1")).await.unwrap();
        let before = snapshot(db).await;
        assert_err(
            create(db, &inst("vm2", "p1")).await,
            Kind::Exhausted,
            "Pool p1 has no free IPv6 address",
        );
        assert_eq!(
            snapshot(db).await,
            before,
            "IPv4 lease and claim rolled back"
        );
        check_invariants(db).await;
    }

    /// A second IPv4 range (and a second IPv6 range) is used once the first is full, and the
    /// first again as soon as it has room.
    pub async fn second_range_after_the_first_is_full(db: &Db) {
        dual_pool(db, "p1").await;
        add_range(db, add("p1", "10.0.1.0/29", "10.0.1.1"))
            .await
            .unwrap();
        add_range(db, add("p1", "2001:db8:1::/120", "fe80::1"))
            .await
            .unwrap();
        add_host(db, "h1", 64, 65536).await;
        for i in 0..5 {
            create(db, &inst(&format!("vm{i}"), "p1")).await.unwrap();
        }
        let sixth = create(db, &inst("vm5", "p1")).await.unwrap();
        assert_eq!(sixth.addresses, ["10.0.1.2/29", "2001:db8:1::1/120"]);
        let seventh = create(db, &inst("vm6", "p1")).await.unwrap();
        assert_eq!(seventh.addresses, ["10.0.1.3/29", "2001:db8:1::2/120"]);
        delete(db, "vm1").await.unwrap();
        let back = create(db, &inst("vm7", "p1")).await.unwrap();
        assert_eq!(back.addresses, ["10.0.0.3/29", "2001:db8::3/64"]);
        // Released addresses of the second ranges go back to them.
        delete(db, "vm5").await.unwrap();
        let refill = create(db, &inst("vm8", "p1")).await.unwrap();
        assert_eq!(refill.addresses, ["10.0.1.2/29", "2001:db8:1::1/120"]);
        check_invariants(db).await;
    }

    /// A small deterministic generator (xorshift), so a failure replays exactly.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            usize::try_from(self.next() % n as u64).unwrap()
        }
    }

    /// 200 instances churn (create, delete, host loss with and without recreation) on 3 hosts
    /// dual-stack, IPv6 the scarcer family; afterwards exactly one lease per family per placed
    /// instance, none leaked, none shared (SQL on the tables).
    pub async fn churn_200_dual_stack_on_3_hosts(db: &Db) {
        let mut r = range("pool_01jz", "10.0.0.0/24", "10.0.0.1");
        r.last_host = Some("10.0.0.151".into());
        set_pool(db, r).await.unwrap();
        let mut r6 = add("pool_01jz", "2001:db8::/64", "fe80::1");
        r6.last_host = Some("2001:db8::64".into()); // 100 addresses
        add_range(db, r6).await.unwrap();
        let mut hosts: Vec<String> = (0..3).map(|i| format!("host-{i}")).collect();
        for h in &hosts {
            add_host(db, h, 128, 128 * 1024).await;
        }
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        let (mut created, mut deleted, mut exhausted, mut losses) = (0, 0, 0, 0);
        for step in 0..1000 {
            if step % 200 == 199 {
                let victim = hosts.remove(rng.below(hosts.len()));
                lose(db, &victim).await.unwrap();
                losses += 1;
                let h = format!("host-{}", 3 + losses);
                add_host(db, &h, 128, 128 * 1024).await;
                hosts.push(h);
                check_invariants(db).await;
                continue;
            }
            let id = format!("vm-{:03}", rng.below(200));
            let mut tx = db.begin().await.unwrap();
            let found = vmnet_ipam::get_instance(&mut tx, &id).await.ok();
            tx.commit().await.unwrap();
            if found.is_some() {
                delete(db, &id).await.unwrap();
                deleted += 1;
                continue;
            }
            let mut req = inst(&id, "pool_01jz");
            req.recreate_on_host_loss = rng.below(2) == 0;
            match create(db, &req).await {
                Ok(i) => {
                    assert!(i.address.is_some() && i.address6.is_some(), "{i:?}");
                    created += 1;
                }
                Err(e) => {
                    assert_eq!(kind(&e), Kind::Exhausted, "{e}");
                    assert_eq!(e.to_string(), "Pool pool_01jz has no free IPv6 address");
                    exhausted += 1;
                }
            }
        }
        check_invariants(db).await;
        assert!(
            created > 150 && deleted > 100 && exhausted > 0 && losses == 5,
            "created {created} deleted {deleted} exhausted {exhausted}"
        );
        let mut tx = db.begin().await.unwrap();
        let placed = count(
            &mut tx,
            "SELECT COUNT(*) FROM instances WHERE state = 'running'",
        )
        .await;
        let v4 = count(&mut tx, "SELECT COUNT(*) FROM ip_leases").await;
        let v6 = count(&mut tx, "SELECT COUNT(*) FROM ip6_leases").await;
        let both = count(
            &mut tx,
            "SELECT COUNT(*) FROM instances i \
             JOIN ip_leases l ON l.instance_id = i.instance_id AND l.pool_id = i.pool_id \
             JOIN ip6_leases l6 ON l6.instance_id = i.instance_id AND l6.pool_id = i.pool_id \
             WHERE i.state = 'running'",
        )
        .await;
        tx.commit().await.unwrap();
        assert_eq!(
            (placed, v4, v6),
            (both, both, both),
            "one lease per family per placed instance, none leaked"
        );
    }

    /// 12 creates race on their own connections (PostgreSQL: in parallel; SQLite: queued for the
    /// write lock): all succeed with distinct addresses of both families, the 12 lowest.
    pub async fn concurrent_placements_race(db: &Db) {
        with_pool(db, "p1", "10.0.0.0/24", "10.0.0.1").await;
        add_range(db, add("p1", "2001:db8::/64", "2001:db8::1"))
            .await
            .unwrap();
        add_host(db, "h1", 64, 65536).await;
        add_host(db, "h2", 64, 65536).await;
        const N: usize = 12;
        let barrier = Arc::new(Barrier::new(N));
        let tasks: Vec<_> = (0..N)
            .map(|i| {
                let (db, barrier) = (db.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    create(&db, &inst(&format!("r{i:02}"), "p1")).await
                })
            })
            .collect();
        let mut v4 = BTreeSet::new();
        let mut v6 = BTreeSet::new();
        for t in tasks {
            let i = t
                .await
                .unwrap()
                .unwrap_or_else(|e| panic!("placement failed: {e}"));
            v4.insert(i.address.unwrap());
            v6.insert(i.address6.unwrap());
        }
        let want4: BTreeSet<_> = (2..2 + N).map(|i| ip(&format!("10.0.0.{i}"))).collect();
        let want6: BTreeSet<_> = (2..2 + N)
            .map(|i| ip6(&format!("2001:db8::{i:x}")))
            .collect();
        assert_eq!(
            (v4, v6),
            (want4, want6),
            "distinct, the lowest of each family"
        );
        check_invariants(db).await;
    }
}

conformance!(cases:
    dual_stack_walk_through,
    ipv6_exhaustion_fails_the_placement,
    second_range_after_the_first_is_full,
    churn_200_dual_stack_on_3_hosts,
    concurrent_placements_race,
);
