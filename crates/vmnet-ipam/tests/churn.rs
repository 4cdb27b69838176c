//! The spec's acceptance run: 200 instances churning (create, delete, host loss) on 3 hosts,
//! then SQL checks against the tables: exactly one lease per placed instance, none leaked, none
//! shared. Run on both stores.
#![allow(missing_docs)]

mod common;

mod cases {
    use crate::common::Kind;
    use vmnet_ipam::{Db, Store};

    use crate::common::*;

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

    pub async fn churn_200_instances_on_3_hosts(db: &Db) {
        // 100 leasable addresses for ~150 live instances: exhaustion happens and must roll back.
        let mut r = range("pool_01jz", "10.0.0.0/24", "10.0.0.1");
        r.last_host = Some("10.0.0.101".into());
        set_pool(db, r).await.unwrap();
        let mut hosts: Vec<String> = (0..3).map(|i| format!("host-{i}")).collect();
        for h in &hosts {
            add_host(db, h, 128, 128 * 1024).await;
        }
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut next_host = 3;
        let (mut created, mut deleted, mut exhausted, mut losses, mut conflicts) = (0, 0, 0, 0, 0);
        for step in 0..1200 {
            if step % 200 == 199 {
                // Lose a host and bring up a replacement, keeping 3 hosts.
                let victim = hosts.remove(rng.below(hosts.len()));
                let loss = lose(db, &victim).await.unwrap();
                losses += 1;
                for i in &loss.instances {
                    assert!(i.host_id.as_deref() != Some(victim.as_str()));
                }
                let h = format!("host-{next_host}");
                next_host += 1;
                add_host(db, &h, 128, 128 * 1024).await;
                hosts.push(h);
                check_invariants(db).await;
                continue;
            }
            let id = format!("vm-{:03}", rng.below(200));
            let mut tx = db.begin().await.unwrap();
            let found = vmnet_ipam::get_instance(&mut tx, &id).await.ok();
            tx.commit().await.unwrap();
            let exists = found.is_some();
            let running = found
                .as_ref()
                .is_some_and(|i| i.state == vmnet_ipam::InstanceState::Running);
            if exists && (!running || rng.below(3) == 0) {
                delete(db, &id).await.unwrap();
                deleted += 1;
            } else if let Some(found) = found {
                // The same request again gets the instance as it is; another one conflicts.
                // Either way nothing changes.
                let before = snapshot(db).await;
                let mut req = inst(&id, "pool_01jz");
                req.recreate_on_host_loss = found.recreate_on_host_loss;
                req.vcpus = found.vcpus;
                if rng.below(2) == 0 {
                    assert_eq!(create(db, &req).await.unwrap(), found);
                } else {
                    req.vcpus += 1;
                    let e = create(db, &req).await.unwrap_err();
                    assert_eq!(kind(&e), Kind::Conflict);
                    conflicts += 1;
                }
                assert_eq!(snapshot(db).await, before);
            } else {
                let mut req = inst(&id, "pool_01jz");
                req.recreate_on_host_loss = rng.below(2) == 0;
                req.vcpus = u32::try_from(1 + rng.below(2)).unwrap();
                match create(db, &req).await {
                    Ok(i) => {
                        assert!(i.address.is_some());
                        created += 1;
                    }
                    Err(e) => {
                        assert_eq!(kind(&e), Kind::Exhausted, "{e}");
                        assert_eq!(e.to_string(), "Pool pool_01jz has no free IP address");
                        exhausted += 1;
                    }
                }
            }
        }
        check_invariants(db).await;
        assert!(
            created > 150 && deleted > 100 && exhausted > 0 && conflicts > 0 && losses == 6,
            "created {created} deleted {deleted} exhausted {exhausted} conflicts {conflicts}"
        );
        // And with plain SQL on the tables: exactly one lease per placed instance.
        let mut tx = db.begin().await.unwrap();
        let placed = count(
            &mut tx,
            "SELECT COUNT(*) FROM instances WHERE state = 'running'",
        )
        .await;
        let leased = count(&mut tx, "SELECT COUNT(*) FROM ip_leases").await;
        let joined = count(
            &mut tx,
            "SELECT COUNT(*) FROM instances i JOIN ip_leases l ON l.instance_id = i.instance_id AND l.pool_id = i.pool_id \
             WHERE i.state = 'running'",
        )
        .await;
        tx.commit().await.unwrap();
        assert_eq!(
            (placed, leased),
            (joined, joined),
            "one lease per placed instance, none leaked"
        );
    }
}

conformance!(cases: churn_200_instances_on_3_hosts);
