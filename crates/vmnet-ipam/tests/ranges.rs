//! A pool's list of ranges on both stores: adding IPv4 ranges after the first and IPv6 ranges,
//! the checks between ranges, removing and listing them, and `pool set` keeping its exact
//! semantics beside them.
#![allow(missing_docs)]

mod common;

mod cases {
    use std::net::IpAddr;

    use vmnet_ipam::{Db, Family, Store};

    use crate::common::*;

    fn a(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// The list holds the first IPv4 range, then the added ones in order; `pool set` still sets
    /// (replaces) the first one and refuses an IPv6 cidr.
    pub async fn list_keeps_the_order_and_pool_set_its_semantics(db: &Db) {
        with_pool(db, "p1", "10.0.0.0/29", "10.0.0.1").await;
        let v6 = add_range(db, add("p1", "2001:db8::/64", "2001:db8::1"))
            .await
            .unwrap();
        assert_eq!(v6.family, Family::Ipv6);
        assert_eq!(
            (v6.first_host, v6.last_host),
            (a("2001:db8::2"), a("2001:db8::ffff:ffff:ffff:ff7f"))
        );
        add_range(db, add("p1", "10.0.1.0/24", "10.0.1.1"))
            .await
            .unwrap();
        let mut tx = db.begin().await.unwrap();
        let list = vmnet_ipam::list_ranges(&mut tx, "p1").await.unwrap();
        let pool = vmnet_ipam::get_pool(&mut tx, "p1").await.unwrap();
        tx.commit().await.unwrap();
        let cidrs: Vec<String> = list.iter().map(|r| r.cidr.to_string()).collect();
        assert_eq!(cidrs, ["10.0.0.0/29", "2001:db8::/64", "10.0.1.0/24"]);
        assert_eq!(pool.ranges, list);
        assert_eq!(pool.range.unwrap().cidr.to_string(), "10.0.0.0/29");
        // pool set replaces the first range only, and keeps refusing IPv6.
        with_pool(db, "p1", "10.0.0.0/28", "10.0.0.1").await;
        let mut tx = db.begin().await.unwrap();
        let list = vmnet_ipam::list_ranges(&mut tx, "p1").await.unwrap();
        tx.commit().await.unwrap();
        let cidrs: Vec<String> = list.iter().map(|r| r.cidr.to_string()).collect();
        assert_eq!(cidrs, ["10.0.0.0/28", "2001:db8::/64", "10.0.1.0/24"]);
        assert_err(
            set_pool(db, range("p1", "2001:db8:1::/64", "2001:db8:1::1")).await,
            Kind::Invalid,
            "pool p1: cidr 2001:db8:1::/64 is IPv6; only IPv4 ranges are supported",
        );
        check_invariants(db).await;
    }

    /// Overlaps are refused within the pool and across pools, per family; `pool set` may not
    /// overlap the pool's own added ranges either.
    pub async fn overlaps_are_conflicts(db: &Db) {
        with_pool(db, "p1", "10.0.0.0/24", "10.0.0.1").await;
        add_range(db, add("p1", "2001:db8::/64", "2001:db8::1"))
            .await
            .unwrap();
        let before = snapshot(db).await;
        assert_err(
            add_range(db, add("p1", "10.0.0.128/25", "10.0.0.129")).await,
            Kind::Conflict,
            "pool p1: cidr 10.0.0.128/25 overlaps cidr 10.0.0.0/24 of pool p1",
        );
        assert_err(
            add_range(db, add("p2", "2001:db8::/56", "fe80::1")).await,
            Kind::Conflict,
            "pool p2: cidr 2001:db8::/56 overlaps cidr 2001:db8::/64 of pool p1",
        );
        assert_err(
            add_range(db, add("p2", "2001:db8:1::/64", "2001:db8::5")).await,
            Kind::Conflict,
            "pool p2: gateway 2001:db8::5 is a leasable address of pool p1 \
             (2001:db8::2 to 2001:db8::ffff:ffff:ffff:ff7f)",
        );
        assert_err(
            add_range(db, add("p2", "10.0.1.0/24", "10.0.1.1")).await,
            Kind::Conflict,
            "pool p2 has no first IPv4 range; set it (vmnet pool set, PUT /v1/pools/p2/range) \
             before adding IPv4 ranges after it",
        );
        assert_err(
            add_range(db, add("p1", "2001:db8::/32", "fe80::1")).await,
            Kind::Invalid,
            "pool p1: cidr 2001:db8::/32 has prefix length 32; it must be between /48 and /128",
        );
        assert_eq!(snapshot(db).await, before, "refused adds wrote nothing");
        add_range(db, add("p1", "10.0.1.0/24", "10.0.1.1"))
            .await
            .unwrap();
        assert_err(
            set_pool(db, range("p1", "10.0.0.0/23", "10.0.0.1")).await,
            Kind::Conflict,
            "pool p1: cidr 10.0.0.0/23 overlaps cidr 10.0.1.0/24 of pool p1",
        );
        // A shared link-local IPv6 gateway is fine (no pool leases it), and so is IPv6 only.
        add_range(db, add("p2", "2001:db8:1::/64", "fe80::1"))
            .await
            .unwrap();
        add_range(db, add("p3", "2001:db8:2::/64", "fe80::1"))
            .await
            .unwrap();
        check_invariants(db).await;
    }

    /// A range that holds leases stays; an empty one goes with its free addresses; the first
    /// range cannot be removed.
    pub async fn remove_refuses_held_ranges_and_the_first(db: &Db) {
        with_pool(db, "p1", "10.0.0.0/29", "10.0.0.1").await;
        add_range(db, add("p1", "2001:db8::/64", "2001:db8::1"))
            .await
            .unwrap();
        add_range(db, add("p1", "2001:db8:1::/64", "2001:db8:1::1"))
            .await
            .unwrap();
        add_host(db, "h1", 64, 65536).await;
        create(db, &inst("vm0", "p1")).await.unwrap();
        let before = snapshot(db).await;
        assert_err(
            remove_range(db, "p1", "2001:db8::/64").await,
            Kind::Conflict,
            "pool p1: range 2001:db8::/64 holds 1 lease; delete their instances first",
        );
        assert_err(
            remove_range(db, "p1", "10.0.0.0/29").await,
            Kind::Conflict,
            "pool p1: range 10.0.0.0/29 is the first IPv4 range; replace it with vmnet pool set \
             (PUT /v1/pools/p1/range) instead",
        );
        assert_err(
            remove_range(db, "p1", "2001:db8:9::/64").await,
            Kind::NotFound,
            "range 2001:db8:9::/64 of pool p1 not found",
        );
        assert_err(
            remove_range(db, "p1", "2001:db8::").await,
            Kind::Invalid,
            "pool p1: cidr \"2001:db8::\" is not a CIDR such as 2001:db8::/64",
        );
        assert_eq!(snapshot(db).await, before, "refused removals wrote nothing");
        let gone = remove_range(db, "p1", "2001:db8:1::/64").await.unwrap();
        assert_eq!(gone.cidr.to_string(), "2001:db8:1::/64");
        check_invariants(db).await;
        delete(db, "vm0").await.unwrap();
        remove_range(db, "p1", "2001:db8::/64").await.unwrap();
        // Without IPv6 ranges the pool leases IPv4 only.
        let vm = create(db, &inst("vm1", "p1")).await.unwrap();
        assert_eq!(vm.address6, None);
        assert_eq!(vm.addresses, ["10.0.0.2/29"]);
        check_invariants(db).await;
    }

    /// An IPv6-only pool: instances get an IPv6 lease and no IPv4 lease.
    pub async fn ipv6_only_pool(db: &Db) {
        add_range(db, add("p6", "2001:db8::/120", "fe80::1"))
            .await
            .unwrap();
        add_host(db, "h1", 64, 65536).await;
        let vm = create(db, &inst("vm0", "p6")).await.unwrap();
        assert_eq!(vm.address, None);
        assert_eq!(vm.address6, Some(ip6("2001:db8::1")));
        assert_eq!(vm.addresses, ["2001:db8::1/120"]);
        let mut tx = db.begin().await.unwrap();
        let pool = vmnet_ipam::get_pool(&mut tx, "p6").await.unwrap();
        tx.commit().await.unwrap();
        assert_eq!((pool.leases, pool.leases_ipv6), (0, 1));
        assert_eq!(pool.range, None);
        check_invariants(db).await;
    }
}

conformance!(cases:
    list_keeps_the_order_and_pool_set_its_semantics,
    overlaps_are_conflicts,
    remove_refuses_held_ranges_and_the_first,
    ipv6_only_pool,
);
