//! The conformance suite, part 2: placement (claims and lease in one transaction, host loss)
//! and bad input (unknown objects, duplicates, malformed ids), run against both stores.
#![allow(missing_docs)]

mod common;

mod cases {
    use crate::common::Kind;
    use vmnet_ipam::{Db, Store};

    use crate::common::*;

    /// instances.create claims capacity and takes the lease in one transaction; without room the
    /// whole create rolls back; delete returns both.
    pub async fn placement_claims_and_rolls_back(db: &Db) {
        with_pool(db, "p1", "10.0.0.0/29", "10.0.0.1").await;
        add_host(db, "h1", 2, 2048).await;
        add_host(db, "h2", 1, 1024).await;
        let mut big = inst("big", "p1");
        big.vcpus = 2;
        let i = create(db, &big).await.unwrap();
        assert_eq!(i.host_id.as_deref(), Some("h1"));
        let i = create(db, &inst("small", "p1")).await.unwrap();
        assert_eq!(i.host_id.as_deref(), Some("h2"));
        let before = snapshot(db).await;
        assert_err(
            create(db, &inst("nope", "p1")).await,
            Kind::Exhausted,
            "no host has room for instance nope (1 vCPUs, 512 MiB)",
        );
        let on_h1 = on("nope", "p1", "h1");
        assert_err(
            create(db, &on_h1).await,
            Kind::Exhausted,
            "host h1 has no room for instance nope (1 vCPUs, 512 MiB)",
        );
        assert_eq!(snapshot(db).await, before);
        let gone = delete(db, "big").await.unwrap();
        assert_eq!(gone.address, Some(ip("10.0.0.2")));
        let mut tx = db.begin().await.unwrap();
        let h1 = vmnet_ipam::get_host(&mut tx, "h1").await.unwrap();
        tx.commit().await.unwrap();
        assert_eq!((h1.used_vcpus, h1.used_memory_mib), (0, 0));
        let i = create(db, &inst("again", "p1")).await.unwrap();
        assert_eq!(i.address, Some(ip("10.0.0.2")));
        check_invariants(db).await;
    }

    /// A host loss returns leases and claims; recreate_on_host_loss places on another host with
    /// the lowest free address; without room the instance moves to error/Unschedulable.
    pub async fn host_loss_recreates_or_marks_unschedulable(db: &Db) {
        with_pool(db, "p1", "10.0.0.0/29", "10.0.0.1").await;
        with_hosts(db, &["h1", "h2"]).await;
        for (id, host, recreate) in [
            ("a", "h1", true),
            ("b", "h2", false),
            ("c", "h1", false),
            ("d", "h2", true),
        ] {
            let mut r = on(id, "p1", host);
            r.recreate_on_host_loss = recreate;
            create(db, &r).await.unwrap();
        }
        // a=.2 (h1), b=.3 (h2), c=.4 (h1), d=.5 (h2); free: .6
        let loss = lose(db, "h1").await.unwrap();
        let by_id: std::collections::HashMap<_, _> = loss
            .instances
            .iter()
            .map(|i| (i.instance_id.clone(), i.clone()))
            .collect();
        assert_eq!(by_id.len(), 2);
        let a = &by_id["a"];
        assert_eq!(
            (a.state, a.host_id.as_deref()),
            (vmnet_ipam::InstanceState::Running, Some("h2"))
        );
        assert_eq!(
            a.address,
            Some(ip("10.0.0.2")),
            "lowest free after both h1 leases were returned"
        );
        let c = &by_id["c"];
        assert_eq!(
            (c.state, c.host_id.as_deref(), c.address),
            (vmnet_ipam::InstanceState::Lost, None, None)
        );
        check_invariants(db).await;
        // Fill the range, add a small host, then lose h2 (a, b, d, e, f are on it).
        create(db, &inst("e", "p1")).await.unwrap(); // .4
        create(db, &inst("f", "p1")).await.unwrap(); // .6
        add_host(db, "h3", 1, 512).await;
        let loss = lose(db, "h2").await.unwrap();
        // a and d recreate; only h3 has room (1 vCPU): a is placed there, d has no host.
        let by_id: std::collections::HashMap<_, _> = loss
            .instances
            .iter()
            .map(|i| (i.instance_id.clone(), i.clone()))
            .collect();
        assert_eq!(by_id["a"].host_id.as_deref(), Some("h3"));
        assert_eq!(by_id["a"].address, Some(ip("10.0.0.2")));
        let d = &by_id["d"];
        assert_eq!(d.state, vmnet_ipam::InstanceState::Error);
        assert_eq!(d.conditions[0].kind, "Unschedulable");
        assert_eq!(
            d.conditions[0].message,
            "no host has room for instance d (1 vCPUs, 512 MiB)"
        );
        assert_eq!(d.address, None);
        check_invariants(db).await;
        // Address exhaustion on replacement: the range shrinks under two placed instances, so
        // after the loss only one of them gets an address back.
        let mut r = range("q", "10.9.0.0/29", "10.9.0.1");
        r.last_host = Some("10.9.0.3".into());
        set_pool(db, r.clone()).await.unwrap();
        with_hosts(db, &["h4", "h5"]).await;
        for id in ["x1", "x2"] {
            let mut x = on(id, "q", "h4");
            x.recreate_on_host_loss = true;
            create(db, &x).await.unwrap();
        }
        r.last_host = Some("10.9.0.2".into());
        set_pool(db, r).await.unwrap();
        let loss = lose(db, "h4").await.unwrap();
        assert_eq!(loss.instances[0].instance_id, "x1");
        assert_eq!(loss.instances[0].host_id.as_deref(), Some("h5"));
        assert_eq!(loss.instances[0].address, Some(ip("10.9.0.2")));
        let x2 = &loss.instances[1];
        assert_eq!(
            (x2.state, x2.host_id.as_deref(), x2.address),
            (vmnet_ipam::InstanceState::Error, None, None)
        );
        assert_eq!(x2.conditions.len(), 1);
        assert_eq!(x2.conditions[0].kind, "Unschedulable");
        assert_eq!(x2.conditions[0].message, "Pool q has no free IP address");
        let mut tx = db.begin().await.unwrap();
        let h5 = vmnet_ipam::get_host(&mut tx, "h5").await.unwrap();
        tx.commit().await.unwrap();
        assert_eq!(
            h5.used_vcpus, 1,
            "the failed placement's claim was rolled back"
        );
        let on_lost = on("z", "q", "h4");
        assert_err(
            create(db, &on_lost).await,
            Kind::Exhausted,
            "host h4 is lost",
        );
        check_invariants(db).await;
    }

    /// Errors for unknown objects and duplicates, with the database unchanged.
    pub async fn not_found_and_conflict(db: &Db) {
        with_pool(db, "p1", "10.0.0.0/24", "10.0.0.1").await;
        with_hosts(db, &["h1"]).await;
        create(db, &inst("vm1", "p1")).await.unwrap();
        let before = snapshot(db).await;
        assert_err(
            create(db, &inst("vm2", "nope")).await,
            Kind::NotFound,
            "pool nope not found",
        );
        assert_err(
            lease(db, "nope", "vm2").await,
            Kind::NotFound,
            "pool nope not found",
        );
        let mut bigger = inst("vm1", "p1");
        bigger.vcpus = 2;
        assert_err(
            create(db, &bigger).await,
            Kind::Conflict,
            "instance vm1 already exists with vcpus 1 (this request: 2)",
        );
        let elsewhere = on("vm3", "p1", "hx");
        assert_err(
            create(db, &elsewhere).await,
            Kind::NotFound,
            "host hx not found",
        );
        assert_err(
            delete(db, "ghost").await,
            Kind::NotFound,
            "instance ghost not found",
        );
        assert_err(lose(db, "hx").await, Kind::NotFound, "host hx not found");
        let mut tx = db.begin().await.unwrap();
        assert_err(
            vmnet_ipam::get_instance(&mut tx, "ghost").await,
            Kind::NotFound,
            "instance ghost not found",
        );
        assert_err(
            vmnet_ipam::list_leases(&mut tx, "nope").await,
            Kind::NotFound,
            "pool nope not found",
        );
        assert_err(
            vmnet_ipam::get_ip_pool(&mut tx, "nope").await,
            Kind::NotFound,
            "pool nope not found",
        );
        assert_err(
            vmnet_ipam::add_host(&mut tx, "h1", 1, 1).await,
            Kind::Conflict,
            "host h1 already exists",
        );
        // Even committing the transaction after the errors writes nothing.
        tx.commit().await.unwrap();
        assert_eq!(snapshot(db).await, before);
    }

    /// Bad ids (empty, oversized, SQL and shell metacharacters) and bad ranges are refused with
    /// INVALID_INPUT naming the field, and the database is unchanged even if the caller commits.
    pub async fn bad_input_leaves_database_unchanged(db: &Db) {
        with_pool(db, "p1", "10.0.0.0/24", "10.0.0.1").await;
        with_hosts(db, &["h1"]).await;
        create(db, &inst("vm1", "p1")).await.unwrap();
        let before = snapshot(db).await;
        let long = "a".repeat(65);
        let nasty = [
            "x'); DROP TABLE ip_leases; --",
            "$(rm -rf /)",
            "a;b",
            "`reboot`",
            "a b",
            "-rf",
            "a\"b",
            "a\nb",
            "a|b&c>d",
            "ä",
        ];
        let mut tx = db.begin().await.unwrap();
        for bad in nasty {
            let e = vmnet_ipam::create_instance(&mut tx, &inst(bad, "p1"))
                .await
                .unwrap_err();
            assert_eq!(kind(&e), Kind::Invalid);
            assert_eq!(
                e.to_string(),
                format!(
                    "instance_id {bad:?} may only contain A-Z a-z 0-9 . _ - and must start with a letter or digit"
                )
            );
            let e = vmnet_ipam::create_instance(&mut tx, &inst("ok", bad))
                .await
                .unwrap_err();
            assert!(e.to_string().starts_with("pool_id "), "{e}");
            assert!(
                vmnet_ipam::set_ip_pool(&mut tx, range(bad, "10.0.0.0/24", "10.0.0.1"))
                    .await
                    .is_err()
            );
            assert!(vmnet_ipam::lease(&mut tx, "p1", bad).await.is_err());
            assert!(vmnet_ipam::release(&mut tx, bad).await.is_err());
            assert!(vmnet_ipam::add_host(&mut tx, bad, 1, 1).await.is_err());
            assert!(vmnet_ipam::lose_host(&mut tx, bad).await.is_err());
            assert!(vmnet_ipam::delete_instance(&mut tx, bad).await.is_err());
        }
        assert_err(
            vmnet_ipam::create_instance(&mut tx, &inst("", "p1")).await,
            Kind::Invalid,
            "instance_id must not be empty",
        );
        assert_err(
            vmnet_ipam::create_instance(&mut tx, &inst(&long, "p1")).await,
            Kind::Invalid,
            "instance_id is 65 bytes long; at most 64 are allowed",
        );
        assert_err(
            vmnet_ipam::create_instance(&mut tx, &inst("vm2", "")).await,
            Kind::Invalid,
            "pool_id must not be empty",
        );
        assert_err(
            vmnet_ipam::add_host(&mut tx, &long, 1, 1).await,
            Kind::Invalid,
            "host_id is 65 bytes long; at most 64 are allowed",
        );
        assert_err(
            vmnet_ipam::add_host(&mut tx, "h2", 0, 1).await,
            Kind::Invalid,
            "host h2: vcpus must be at least 1",
        );
        let mut zero = inst("vm2", "p1");
        zero.memory_mib = 0;
        assert_err(
            vmnet_ipam::create_instance(&mut tx, &zero).await,
            Kind::Invalid,
            "instance vm2: memory_mib must be at least 1",
        );
        let mut dns = range("p1", "10.0.0.0/24", "10.0.0.1");
        dns.dns = vec!["1.1.1.1'; DROP TABLE ip_pools; --".into()];
        assert_err(
            vmnet_ipam::set_ip_pool(&mut tx, dns).await,
            Kind::Invalid,
            "pool p1: dns[0] \"1.1.1.1'; DROP TABLE ip_pools; --\" is not an IP address",
        );
        tx.commit().await.unwrap();
        assert_eq!(snapshot(db).await, before);
    }

    /// Policy and sandbox are stored and read back (create, get, list); every placement takes a
    /// new, valid allocation id; re-placement after a host loss keeps policy and sandbox.
    pub async fn policy_sandbox_and_allocation_ids(db: &Db) {
        use vmnet_ipam::NetworkPolicy;
        with_pool(db, "p1", "10.0.0.0/29", "10.0.0.1").await;
        with_hosts(db, &["h1", "h2"]).await;
        let plain = create(db, &inst("plain", "p1")).await.unwrap();
        assert_eq!(
            (plain.network_policy, plain.sandbox),
            (NetworkPolicy::Public, false)
        );
        let mut r = on("boxed", "p1", "h1");
        r.network_policy = NetworkPolicy::Private;
        r.sandbox = true;
        r.recreate_on_host_loss = true;
        let boxed = create(db, &r).await.unwrap();
        assert_eq!(
            (boxed.network_policy, boxed.sandbox),
            (NetworkPolicy::Private, true)
        );
        let mut r = inst("dark", "p1");
        r.network_policy = NetworkPolicy::None;
        let dark = create(db, &r).await.unwrap();
        assert_eq!(dark.network_policy, NetworkPolicy::None);
        for i in [&plain, &boxed, &dark] {
            vmnet_model::ids::validate_id("allocation_id", &i.allocation_id).unwrap();
            assert!(
                i.allocation_id.starts_with("alloc-")
                    && i.allocation_id.ends_with(&format!("-{}", i.instance_id)),
                "{}",
                i.allocation_id
            );
        }
        let ids: std::collections::HashSet<_> = [&plain, &boxed, &dark]
            .iter()
            .map(|i| i.allocation_id.clone())
            .collect();
        assert_eq!(ids.len(), 3, "{ids:?}");
        let mut tx = db.begin().await.unwrap();
        assert_eq!(
            vmnet_ipam::get_instance(&mut tx, "boxed").await.unwrap(),
            boxed
        );
        let all = vmnet_ipam::list_instances(&mut tx).await.unwrap();
        tx.commit().await.unwrap();
        assert_eq!(all, vec![boxed.clone(), dark.clone(), plain.clone()]);
        // Re-placement after a host loss: same policy and sandbox, a new allocation id.
        let loss = lose(db, "h1").await.unwrap();
        let moved = loss
            .instances
            .iter()
            .find(|i| i.instance_id == "boxed")
            .unwrap();
        assert_eq!(moved.host_id.as_deref(), Some("h2"));
        assert_eq!(
            (moved.network_policy, moved.sandbox),
            (NetworkPolicy::Private, true)
        );
        assert_ne!(moved.allocation_id, boxed.allocation_id);
        assert!(moved.allocation_id.ends_with("-boxed"));
        // A deleted and re-created id never gets an allocation id it had before.
        let mut tx = db.begin().await.unwrap();
        vmnet_ipam::delete_instance(&mut tx, "plain").await.unwrap();
        tx.commit().await.unwrap();
        let again = create(db, &inst("plain", "p1")).await.unwrap();
        assert_ne!(again.allocation_id, plain.allocation_id);
        // A 64-byte instance id still gets a valid (cut) allocation id.
        let long = "l".repeat(64);
        let l = create(db, &inst(&long, "p1")).await.unwrap();
        assert_eq!(l.allocation_id.len(), 64);
        vmnet_model::ids::validate_id("allocation_id", &l.allocation_id).unwrap();
        check_invariants(db).await;
    }
}

conformance!(cases:
    placement_claims_and_rolls_back,
    host_loss_recreates_or_marks_unschedulable,
    policy_sandbox_and_allocation_ids,
    not_found_and_conflict,
    bad_input_leaves_database_unchanged,
);
