//! Repeated creates: a create whose reply was lost is retried with the same request and gets the
//! existing instance back (nothing claimed or leased twice); a different request with the same
//! id stays `CONFLICT` naming the field. Run against both stores, also with the retries racing.
#![allow(missing_docs)]

mod common;

mod idempotent {
    use std::sync::Arc;

    use crate::common::Kind;
    use tokio::sync::Barrier;
    use vmnet_ipam::{Db, NetworkPolicy, Store};

    use crate::common::*;

    async fn setup(db: &Db) {
        with_pool(db, "p1", "10.0.0.0/24", "10.0.0.1").await;
        with_pool(db, "p2", "10.0.1.0/24", "10.0.1.1").await;
        with_hosts(db, &["h1", "h2"]).await;
    }

    pub async fn identical_create_returns_the_existing_instance(db: &Db) {
        setup(db).await;
        let first = create(db, &inst("vm1", "p1")).await.unwrap();
        let before = snapshot(db).await;
        let again = create(db, &inst("vm1", "p1")).await.unwrap();
        assert_eq!(again, first, "the same instance, lease and allocation");
        assert_eq!(
            snapshot(db).await,
            before,
            "nothing claimed or leased twice"
        );
        // The outcome says whether it was created.
        let mut tx = db.begin().await.unwrap();
        let out = vmnet_ipam::ensure_instance(&mut tx, &inst("vm1", "p1"))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        assert!(!out.created);
        assert_eq!(out.instance, first);
        let mut tx = db.begin().await.unwrap();
        let out = vmnet_ipam::ensure_instance(&mut tx, &inst("vm2", "p1"))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        assert!(out.created);
        // With the host named, the same again.
        let on_h2 = on("vm3", "p1", "h2");
        let placed = create(db, &on_h2).await.unwrap();
        assert_eq!(create(db, &on_h2).await.unwrap(), placed);
        check_invariants(db).await;
    }

    pub async fn different_request_with_the_same_id_is_conflict(db: &Db) {
        setup(db).await;
        let base = on("vm1", "p1", "h1");
        create(db, &base).await.unwrap();
        let before = snapshot(db).await;
        type Change = Box<dyn Fn(&mut vmnet_ipam::NewInstance)>;
        let cases: Vec<(Change, &str)> = vec![
            (
                Box::new(|r| r.pool_id = "p2".into()),
                "pool_id p1 (this request: p2)",
            ),
            (Box::new(|r| r.vcpus = 2), "vcpus 1 (this request: 2)"),
            (
                Box::new(|r| r.memory_mib = 256),
                "memory_mib 512 (this request: 256)",
            ),
            (
                Box::new(|r| r.recreate_on_host_loss = true),
                "recreate_on_host_loss false (this request: true)",
            ),
            (
                Box::new(|r| r.network_policy = NetworkPolicy::None),
                "network_policy public (this request: none)",
            ),
            (
                Box::new(|r| r.sandbox = true),
                "sandbox false (this request: true)",
            ),
            (
                Box::new(|r| r.host_id = Some("h2".into())),
                "host_id h1 (this request: h2)",
            ),
        ];
        for (change, what) in cases {
            let mut req = base.clone();
            change(&mut req);
            assert_err(
                create(db, &req).await,
                Kind::Conflict,
                &format!("instance vm1 already exists with {what}"),
            );
        }
        assert_eq!(snapshot(db).await, before);
        // No host in the request matches any host.
        let mut anywhere = base.clone();
        anywhere.host_id = None;
        assert_eq!(
            create(db, &anywhere).await.unwrap().host_id.as_deref(),
            Some("h1")
        );
        // After a host loss the instance is lost: the same request answers it as it is now.
        lose(db, "h1").await.unwrap();
        let lost = create(db, &anywhere).await.unwrap();
        assert_eq!(lost.state, vmnet_ipam::InstanceState::Lost);
        assert_err(
            create(db, &base).await,
            Kind::Conflict,
            "instance vm1 already exists with host_id none (this request: h1)",
        );
        check_invariants(db).await;
    }

    /// Eight identical creates at once, each on its own connection: all get the one instance.
    pub async fn racing_identical_creates_get_one_instance(db: &Db) {
        setup(db).await;
        let n = 8;
        let barrier = Arc::new(Barrier::new(n));
        let mut tasks = Vec::new();
        for _ in 0..n {
            let db = db.clone();
            let barrier = barrier.clone();
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                create(&db, &inst("vm1", "p1")).await
            }));
        }
        let mut got = Vec::new();
        for t in tasks {
            got.push(t.await.unwrap().unwrap());
        }
        assert!(got.iter().all(|i| *i == got[0]), "{got:?}");
        assert_eq!(leases(db, "p1").await.len(), 1);
        let mut tx = db.begin().await.unwrap();
        let used: u32 = vmnet_ipam::list_hosts(&mut tx)
            .await
            .unwrap()
            .iter()
            .map(|h| h.used_vcpus)
            .sum();
        tx.commit().await.unwrap();
        assert_eq!(used, 1, "claimed once");
        check_invariants(db).await;
    }
}

conformance!(idempotent:
    identical_create_returns_the_existing_instance,
    different_request_with_the_same_id_is_conflict,
    racing_identical_creates_get_one_instance,
);
