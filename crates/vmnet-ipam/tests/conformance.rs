//! The conformance suite, part 1: the rules of "Give a hosted pool a range" and "How leases
//! work" for ranges and leases, run against both stores (`sqlite::*` and `postgres::*`). Part 2
//! (placement, bad input) is `placement.rs`; the validation fixtures are `validation.rs`.
#![allow(missing_docs)]

mod common;

mod cases {
    use crate::common::Kind;
    use vmnet_ipam::{Db, Store};

    use crate::common::*;

    /// The spec's example: /29, gateway .1 → .2 to .6 in order, a sixth fails until one is
    /// deleted, then it gets the freed address.
    pub async fn spec_example_slash29(db: &Db) {
        let r = with_pool(db, "p1", "10.0.0.0/29", "10.0.0.1").await;
        assert_eq!(
            (r.first_host, r.last_host),
            (ip("10.0.0.2"), ip("10.0.0.6"))
        );
        add_host(db, "h1", 64, 65536).await;
        for i in 0..5 {
            let got = create(db, &inst(&format!("vm{i}"), "p1")).await.unwrap();
            assert_eq!(got.address, Some(ip(&format!("10.0.0.{}", i + 2))));
        }
        let before = snapshot(db).await;
        assert_err(
            create(db, &inst("vm5", "p1")).await,
            Kind::Exhausted,
            "Pool p1 has no free IP address",
        );
        assert_eq!(
            snapshot(db).await,
            before,
            "the failed create left nothing behind, host claim included"
        );
        delete(db, "vm2").await.unwrap();
        let got = create(db, &inst("vm5", "p1")).await.unwrap();
        assert_eq!(got.address, Some(ip("10.0.0.4")));
        check_invariants(db).await;
    }

    /// Gateway at the end of a /24: the default first_host is the broadcast address (invalid);
    /// an explicit first_host works and the gateway is never leased.
    pub async fn gateway_at_end_of_slash24(db: &Db) {
        assert_err(
            set_pool(db, range("p1", "10.0.0.0/24", "10.0.0.254")).await,
            Kind::Invalid,
            "pool p1: first_host 10.0.0.255 is the broadcast address of 10.0.0.0/24 \
             (the default is the address after the gateway; set first_host explicitly)",
        );
        let mut req = range("p1", "10.0.0.0/24", "10.0.0.254");
        req.first_host = Some("10.0.0.250".into());
        let r = set_pool(db, req).await.unwrap();
        assert_eq!(
            (r.first_host, r.last_host),
            (ip("10.0.0.250"), ip("10.0.0.254"))
        );
        let got: Vec<_> = [
            lease(db, "p1", "a").await,
            lease(db, "p1", "b").await,
            lease(db, "p1", "c").await,
            lease(db, "p1", "d").await,
        ]
        .into_iter()
        .map(|r| r.unwrap().unwrap())
        .collect();
        assert_eq!(
            got,
            vec![
                ip("10.0.0.250"),
                ip("10.0.0.251"),
                ip("10.0.0.252"),
                ip("10.0.0.253")
            ]
        );
        assert_err(
            lease(db, "p1", "e").await,
            Kind::Exhausted,
            "Pool p1 has no free IP address",
        );
    }

    /// Calling set_ip_pool again replaces the range; leases outside the new range stay.
    pub async fn replacement_keeps_leases_outside_the_new_range(db: &Db) {
        with_pool(db, "p1", "10.0.0.0/24", "10.0.0.1").await;
        for i in 0..4 {
            lease(db, "p1", &format!("vm{i}")).await.unwrap();
        }
        let mut req = range("p1", "10.0.0.0/24", "10.0.0.1");
        req.first_host = Some("10.0.0.100".into());
        req.last_host = Some("10.0.0.101".into());
        let r = set_pool(db, req).await.unwrap();
        assert_eq!(r.first_host, ip("10.0.0.100"));
        let kept = leases(db, "p1").await;
        assert_eq!(kept.len(), 4);
        assert_eq!(kept[0], (ip("10.0.0.2"), "vm0".to_string()));
        // Same instance keeps its (now out-of-range) address.
        assert_eq!(lease(db, "p1", "vm0").await.unwrap(), Some(ip("10.0.0.2")));
        assert_eq!(lease(db, "p1", "n1").await.unwrap(), Some(ip("10.0.0.100")));
        assert_eq!(lease(db, "p1", "n2").await.unwrap(), Some(ip("10.0.0.101")));
        assert_err(
            lease(db, "p1", "n3").await,
            Kind::Exhausted,
            "Pool p1 has no free IP address",
        );
        // Releasing an out-of-range lease does not make it leasable.
        release(db, "vm1").await.unwrap();
        assert_err(
            lease(db, "p1", "n3").await,
            Kind::Exhausted,
            "Pool p1 has no free IP address",
        );
        // Widening the range again makes the free out-of-range addresses leasable; the held ones
        // stay held.
        with_pool(db, "p1", "10.0.0.0/24", "10.0.0.1").await;
        assert_eq!(lease(db, "p1", "n3").await.unwrap(), Some(ip("10.0.0.3")));
        assert_eq!(lease(db, "p1", "n4").await.unwrap(), Some(ip("10.0.0.6")));
    }

    /// Neither the network nor the broadcast address is ever leased, nor the gateway.
    pub async fn network_broadcast_and_gateway_never_leased(db: &Db) {
        let mut req = range("p1", "10.0.0.0/28", "10.0.0.9");
        req.first_host = Some("10.0.0.1".into());
        set_pool(db, req).await.unwrap();
        let mut got = Vec::new();
        for i in 0..20 {
            match lease(db, "p1", &format!("vm{i}")).await {
                Ok(a) => got.push(a.unwrap()),
                Err(e) => {
                    assert_eq!(kind(&e), Kind::Exhausted);
                    break;
                }
            }
        }
        assert_eq!(
            got.len(),
            13,
            "16 addresses minus network, broadcast and gateway: {got:?}"
        );
        assert!(
            !got.contains(&ip("10.0.0.0"))
                && !got.contains(&ip("10.0.0.15"))
                && !got.contains(&ip("10.0.0.9"))
        );
        let mut sorted = got.clone();
        sorted.sort();
        assert_eq!(got, sorted, "lowest first");
        for (field, value, msg) in [
            (
                "first",
                "10.0.0.0",
                "pool p2: first_host 10.0.0.0 is the network address of 10.0.0.0/28",
            ),
            (
                "last",
                "10.0.0.15",
                "pool p2: last_host 10.0.0.15 is the broadcast address of 10.0.0.0/28",
            ),
        ] {
            let mut req = range("p2", "10.0.0.0/28", "10.0.0.1");
            if field == "first" {
                req.first_host = Some(value.into());
            } else {
                req.last_host = Some(value.into());
            }
            assert_err(set_pool(db, req).await, Kind::Invalid, msg);
        }
    }

    /// /31 (RFC 3021): both addresses usable; /32: the one address.
    pub async fn slash31_and_slash32(db: &Db) {
        let r = with_pool(db, "p31", "10.0.0.0/31", "10.0.0.0").await;
        assert_eq!(
            (r.first_host, r.last_host),
            (ip("10.0.0.1"), ip("10.0.0.1"))
        );
        assert_eq!(lease(db, "p31", "a").await.unwrap(), Some(ip("10.0.0.1")));
        assert_err(
            lease(db, "p31", "b").await,
            Kind::Exhausted,
            "Pool p31 has no free IP address",
        );
        // A /31 with the gateway outside leases both addresses.
        let mut req = range("p31b", "10.0.1.0/31", "10.0.0.254");
        req.first_host = Some("10.0.1.0".into());
        let r = set_pool(db, req).await.unwrap();
        assert_eq!(r.last_host, ip("10.0.1.1"));
        assert_eq!(lease(db, "p31b", "c").await.unwrap(), Some(ip("10.0.1.0")));
        assert_eq!(lease(db, "p31b", "d").await.unwrap(), Some(ip("10.0.1.1")));
        // /32 routed from an outside gateway: the default first_host is outside the /32.
        assert_err(
            set_pool(db, range("p32", "10.0.2.5/32", "10.0.2.1")).await,
            Kind::Invalid,
            "pool p32: first_host 10.0.2.2 is outside cidr 10.0.2.5/32 (the default is the address after the gateway; set first_host explicitly)",
        );
        let mut req = range("p32", "10.0.2.5/32", "10.0.2.1");
        req.first_host = Some("10.0.2.5".into());
        let r = set_pool(db, req).await.unwrap();
        assert_eq!(
            (r.first_host, r.last_host),
            (ip("10.0.2.5"), ip("10.0.2.5"))
        );
        assert_eq!(lease(db, "p32", "e").await.unwrap(), Some(ip("10.0.2.5")));
        assert_err(
            lease(db, "p32", "f").await,
            Kind::Exhausted,
            "Pool p32 has no free IP address",
        );
        // /32 that is its own gateway: nothing to lease.
        let mut req = range("p32b", "10.0.3.5/32", "10.0.3.5");
        req.first_host = Some("10.0.3.5".into());
        set_pool(db, req).await.unwrap();
        assert_err(
            lease(db, "p32b", "g").await,
            Kind::Exhausted,
            "Pool p32b has no free IP address",
        );
    }

    /// An instance holds at most one lease; placing it again returns the same address; a
    /// release gives the address back and the next lease takes it (lowest free).
    pub async fn one_lease_per_instance_and_release(db: &Db) {
        with_pool(db, "p1", "10.0.0.0/24", "10.0.0.1").await;
        with_pool(db, "p2", "10.1.0.0/24", "10.1.0.1").await;
        assert_eq!(lease(db, "p1", "a").await.unwrap(), Some(ip("10.0.0.2")));
        assert_eq!(lease(db, "p1", "b").await.unwrap(), Some(ip("10.0.0.3")));
        assert_eq!(lease(db, "p1", "a").await.unwrap(), Some(ip("10.0.0.2")));
        assert_err(
            lease(db, "p2", "a").await,
            Kind::Conflict,
            "instance a already holds lease 10.0.0.2 in pool p1",
        );
        let l = release(db, "a").await.unwrap().unwrap();
        assert_eq!(
            (l.pool_id.as_str(), l.address),
            ("p1", std::net::IpAddr::V4(ip("10.0.0.2")))
        );
        assert_eq!(release(db, "a").await.unwrap(), None);
        assert_eq!(lease(db, "p1", "c").await.unwrap(), Some(ip("10.0.0.2")));
        assert_eq!(lease(db, "p1", "d").await.unwrap(), Some(ip("10.0.0.4")));
        // Release in the middle and at the edges, then re-lease: lowest first, merged index.
        for id in ["b", "c", "d"] {
            release(db, id).await.unwrap();
        }
        let mut tx = db.begin().await.unwrap();
        assert_eq!(
            free_rows(&mut tx)
                .await
                .into_iter()
                .filter(|r| r.0 == "p1")
                .count(),
            1,
            "intervals merged"
        );
        tx.commit().await.unwrap();
        assert_eq!(lease(db, "p1", "e").await.unwrap(), Some(ip("10.0.0.2")));
    }

    /// Leases are listed in address order (.10 after .9), on both stores.
    pub async fn leases_listed_in_address_order(db: &Db) {
        with_pool(db, "p1", "10.0.0.0/24", "10.0.0.1").await;
        for i in 0..12 {
            lease(db, "p1", &format!("vm{i:02}")).await.unwrap();
        }
        let got: Vec<_> = leases(db, "p1").await.into_iter().map(|(a, _)| a).collect();
        let want: Vec<_> = (2..14).map(|i| ip(&format!("10.0.0.{i}"))).collect();
        assert_eq!(got, want);
    }

    /// A pool without a range leases nothing, and placement succeeds without an address.
    pub async fn pool_without_range_places_without_address(db: &Db) {
        let mut tx = db.begin().await.unwrap();
        assert!(vmnet_ipam::create_pool(&mut tx, "bare").await.unwrap());
        tx.commit().await.unwrap();
        assert_eq!(lease(db, "bare", "a").await.unwrap(), None);
        add_host(db, "h1", 4, 4096).await;
        let i = create(db, &inst("vm1", "bare")).await.unwrap();
        assert_eq!(i.address, None);
        assert_eq!(i.host_id.as_deref(), Some("h1"));
    }

    /// The DNS list is stored in order, IPv4 and IPv6, and defaults to empty.
    pub async fn dns_round_trips(db: &Db) {
        let mut req = range("p1", "10.0.0.0/24", "10.0.0.1");
        req.dns = vec!["2001:db8::53".into(), "192.0.2.53".into()];
        set_pool(db, req).await.unwrap();
        let mut tx = db.begin().await.unwrap();
        let r = vmnet_ipam::get_ip_pool(&mut tx, "p1")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            r.dns,
            vec![
                "2001:db8::53".parse::<std::net::IpAddr>().unwrap(),
                "192.0.2.53".parse().unwrap()
            ]
        );
        tx.commit().await.unwrap();
    }

    /// A lease whose insert hits an address taken behind the index's back (as a racing writer
    /// would) is retried on the next free address, and the caller's transaction stays usable.
    pub async fn conflicting_insert_retries_on_next_address(db: &Db) {
        with_pool(db, "p1", "10.0.0.0/24", "10.0.0.1").await;
        // Occupy .2 .. .4 without touching the free index.
        let mut tx = db.begin().await.unwrap();
        let sql = match &tx {
            vmnet_ipam::Tx::Sqlite(_) => {
                "INSERT INTO ip_leases (pool_id, address, address_num, instance_id) \
                 VALUES ('p1', '10.0.0.2', 167772162, 'x2'), ('p1', '10.0.0.3', 167772163, 'x3'), ('p1', '10.0.0.4', 167772164, 'x4')"
            }
            vmnet_ipam::Tx::Postgres(_) => {
                "INSERT INTO ip_leases (pool_id, address, instance_id) \
                 VALUES ('p1', '10.0.0.2', 'x2'), ('p1', '10.0.0.3', 'x3'), ('p1', '10.0.0.4', 'x4')"
            }
        };
        match &mut tx {
            vmnet_ipam::Tx::Sqlite(t) => sqlx::query(sql)
                .execute(&mut **t)
                .await
                .map(|_| ())
                .unwrap(),
            vmnet_ipam::Tx::Postgres(t) => sqlx::query(sql)
                .execute(&mut **t)
                .await
                .map(|_| ())
                .unwrap(),
        }
        tx.commit().await.unwrap();
        let mut tx = db.begin().await.unwrap();
        assert_eq!(
            vmnet_ipam::lease(&mut tx, "p1", "a").await.unwrap(),
            Some(ip("10.0.0.5"))
        );
        // The transaction is not poisoned: more work in it succeeds and commits.
        assert_eq!(
            vmnet_ipam::lease(&mut tx, "p1", "b").await.unwrap(),
            Some(ip("10.0.0.6"))
        );
        tx.commit().await.unwrap();
        // Nine taken in a row exhausts the 8 attempts: UNAVAILABLE, transaction still usable.
        let mut tx = db.begin().await.unwrap();
        let mut values = Vec::new();
        for n in 7..=15 {
            values.push(n);
        }
        for n in values {
            let id = format!("y{n}");
            let addr = format!("10.0.0.{n}");
            match &mut tx {
                vmnet_ipam::Tx::Sqlite(t) => sqlx::query(
                    "INSERT INTO ip_leases (pool_id, address, address_num, instance_id) VALUES ('p1', $1, $2, $3)",
                )
                .bind(&addr)
                .bind(167_772_160_i64 + n)
                .bind(&id)
                .execute(&mut **t)
                .await
                .map(|_| ())
                .unwrap(),
                vmnet_ipam::Tx::Postgres(t) => {
                    sqlx::query("INSERT INTO ip_leases (pool_id, address, instance_id) VALUES ('p1', $1::inet, $2)")
                        .bind(&addr)
                        .bind(&id)
                        .execute(&mut **t)
                        .await
                        .map(|_| ())
                        .unwrap()
                }
            }
        }
        let e = vmnet_ipam::lease(&mut tx, "p1", "c").await.unwrap_err();
        assert_eq!(kind(&e), Kind::Unavailable, "{e}");
        assert_eq!(
            vmnet_ipam::lease_of(&mut tx, "a")
                .await
                .unwrap()
                .unwrap()
                .address,
            ip("10.0.0.5")
        );
        tx.commit().await.unwrap();
        assert_eq!(lease(db, "p1", "c").await.unwrap(), Some(ip("10.0.0.16")));
    }
}

conformance!(cases:
    spec_example_slash29,
    gateway_at_end_of_slash24,
    replacement_keeps_leases_outside_the_new_range,
    network_broadcast_and_gateway_never_leased,
    slash31_and_slash32,
    one_lease_per_instance_and_release,
    leases_listed_in_address_order,
    pool_without_range_places_without_address,
    dns_round_trips,
    conflicting_insert_retries_on_next_address,
);
