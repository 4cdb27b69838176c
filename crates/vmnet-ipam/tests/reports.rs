//! The conformance suite, part 3: `Instance.addresses` and host status reports (spec:
//! hosted-pool-networking.md, "Addresses on an instance", hosted pools), on both stores.
#![allow(missing_docs)]

mod common;

mod cases {
    use crate::common::Kind;
    use vmnet_ipam::IpamError;
    use vmnet_ipam::{Db, SkipReason, StatusReport, StatusReportOutcome, Store, Tx};

    use crate::common::*;

    async fn report(db: &Db, host: &str, json: &str) -> Result<StatusReportOutcome, IpamError> {
        let r: StatusReport = serde_json::from_str(json).unwrap();
        let mut tx = db.begin().await?;
        let out = vmnet_ipam::report_host_status(&mut tx, host, &r).await?;
        tx.commit().await?;
        Ok(out)
    }

    async fn addresses(db: &Db, id: &str) -> Vec<String> {
        let mut tx = db.begin().await.unwrap();
        let got = vmnet_ipam::get_instance(&mut tx, id)
            .await
            .unwrap()
            .addresses;
        let listed = vmnet_ipam::list_instances(&mut tx)
            .await
            .unwrap()
            .into_iter()
            .find(|i| i.instance_id == id)
            .unwrap()
            .addresses;
        tx.commit().await.unwrap();
        assert_eq!(got, listed, "get and list agree on {id}");
        got
    }

    async fn stored_rows(db: &Db) -> i64 {
        let mut tx = db.begin().await.unwrap();
        let n = count(&mut tx, "SELECT COUNT(*) FROM instance_addresses").await;
        tx.commit().await.unwrap();
        n
    }

    fn strs(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    async fn setup(db: &Db) {
        with_pool(db, "p1", "10.0.0.0/29", "10.0.0.1").await;
        with_hosts(db, &["h1", "h2"]).await;
    }

    /// The lease comes first (CIDR form, the range's prefix length); a report appends new
    /// addresses in its order; a second, overlapping report appends only the new ones.
    pub async fn lease_first_then_reports_append_in_order(db: &Db) {
        setup(db).await;
        let created = create(db, &on("vm1", "p1", "h1")).await.unwrap();
        assert_eq!(created.addresses, strs(&["10.0.0.2/29"]));
        assert_eq!(addresses(db, "vm1").await, strs(&["10.0.0.2/29"]));

        let out = report(
            db,
            "h1",
            r#"{"instances": [{"instance_id": "vm1",
                "addresses": ["2001:DB8::5/64", "10.0.0.2/29", "192.168.1.7/24"]}]}"#,
        )
        .await
        .unwrap();
        assert_eq!(out.host_id, "h1");
        assert!(out.skipped.is_empty());
        assert_eq!(out.updated.len(), 1);
        assert_eq!(
            out.updated[0].added,
            strs(&["2001:db8::5/64", "192.168.1.7/24"]),
            "the lease is not stored again; IPv6 in canonical form"
        );
        let want = strs(&["10.0.0.2/29", "2001:db8::5/64", "192.168.1.7/24"]);
        assert_eq!(out.updated[0].addresses, want);
        assert_eq!(addresses(db, "vm1").await, want);

        let out = report(
            db,
            "h1",
            r#"{"instances": [{"instance_id": "vm1",
                "addresses": ["192.168.1.7/24", "10.1.0.1/16", "2001:db8::5/64", "10.0.0.9/8"]}]}"#,
        )
        .await
        .unwrap();
        assert_eq!(out.updated[0].added, strs(&["10.1.0.1/16", "10.0.0.9/8"]));
        let want = strs(&[
            "10.0.0.2/29",
            "2001:db8::5/64",
            "192.168.1.7/24",
            "10.1.0.1/16",
            "10.0.0.9/8",
        ]);
        assert_eq!(addresses(db, "vm1").await, want);
        assert_eq!(stored_rows(db).await, 4);

        // The same report again adds nothing and changes nothing.
        let out = report(
            db,
            "h1",
            r#"{"instances": [{"instance_id": "vm1", "addresses": ["10.1.0.1/16"]}]}"#,
        )
        .await
        .unwrap();
        assert!(out.updated[0].added.is_empty());
        assert_eq!(out.updated[0].addresses, want);
        assert_eq!(addresses(db, "vm1").await, want);
        check_invariants(db).await;
    }

    /// Reports never replace the lease: an empty report, or one with the lease's address under
    /// another prefix length, leaves the lease first; the `address` field stays the lease.
    pub async fn reports_never_replace_the_lease(db: &Db) {
        setup(db).await;
        create(db, &on("vm1", "p1", "h1")).await.unwrap();
        let out = report(db, "h1", r#"{"instances": [{"instance_id": "vm1"}]}"#)
            .await
            .unwrap();
        assert!(out.updated[0].added.is_empty());
        assert_eq!(addresses(db, "vm1").await, strs(&["10.0.0.2/29"]));
        report(
            db,
            "h1",
            r#"{"instances": [{"instance_id": "vm1", "addresses": ["10.0.0.3/29", "10.0.0.2/24"]}]}"#,
        )
        .await
        .unwrap();
        assert_eq!(
            addresses(db, "vm1").await,
            strs(&["10.0.0.2/29", "10.0.0.3/29", "10.0.0.2/24"])
        );
        let mut tx = db.begin().await.unwrap();
        let i = vmnet_ipam::get_instance(&mut tx, "vm1").await.unwrap();
        tx.commit().await.unwrap();
        assert_eq!(i.address, Some(ip("10.0.0.2")));
        assert_eq!(
            leases(db, "p1").await,
            vec![(ip("10.0.0.2"), "vm1".into())],
            "a report takes no lease"
        );
        check_invariants(db).await;
    }

    /// A pool without a range: the instance lists only what reports added.
    pub async fn without_a_lease_only_reported_addresses(db: &Db) {
        let mut tx = db.begin().await.unwrap();
        vmnet_ipam::create_pool(&mut tx, "p0").await.unwrap();
        tx.commit().await.unwrap();
        with_hosts(db, &["h1"]).await;
        let created = create(db, &inst("vm1", "p0")).await.unwrap();
        assert!(created.addresses.is_empty());
        report(
            db,
            "h1",
            r#"{"instances": [{"instance_id": "vm1", "addresses": ["172.16.0.9/12"]}]}"#,
        )
        .await
        .unwrap();
        assert_eq!(addresses(db, "vm1").await, strs(&["172.16.0.9/12"]));
    }

    /// Entries for unknown instances and instances on another host (or on none) are skipped and
    /// listed; the others are applied.
    pub async fn other_hosts_and_unknown_instances_are_skipped(db: &Db) {
        setup(db).await;
        create(db, &on("vm1", "p1", "h1")).await.unwrap();
        create(db, &on("vm2", "p1", "h2")).await.unwrap();
        let out = report(
            db,
            "h1",
            r#"{"instances": [
                {"instance_id": "ghost", "addresses": ["10.9.0.1/24"]},
                {"instance_id": "vm2", "addresses": ["10.9.0.2/24"]},
                {"instance_id": "vm1", "addresses": ["10.9.0.3/24"]}
            ]}"#,
        )
        .await
        .unwrap();
        let skipped: Vec<_> = out
            .skipped
            .iter()
            .map(|s| (s.instance_id.as_str(), s.reason, s.message.as_str()))
            .collect();
        assert_eq!(
            skipped,
            vec![
                (
                    "ghost",
                    SkipReason::UnknownInstance,
                    "instance ghost not found"
                ),
                (
                    "vm2",
                    SkipReason::NotOnHost,
                    "instance vm2 is placed on host h2, not h1"
                ),
            ]
        );
        assert_eq!(out.updated.len(), 1);
        assert_eq!(out.updated[0].instance_id, "vm1");
        assert_eq!(addresses(db, "vm2").await, strs(&["10.0.0.3/29"]));
        assert_eq!(
            addresses(db, "vm1").await,
            strs(&["10.0.0.2/29", "10.9.0.3/24"])
        );
        assert_err(
            report(db, "h9", r#"{"instances": []}"#).await,
            Kind::NotFound,
            "host h9 not found",
        );
    }

    /// A malformed report is INVALID_INPUT naming the instance and field, and writes nothing,
    /// not even its valid entries.
    pub async fn bad_cidr_is_invalid_and_writes_nothing(db: &Db) {
        setup(db).await;
        create(db, &on("vm1", "p1", "h1")).await.unwrap();
        create(db, &on("vm2", "p1", "h1")).await.unwrap();
        let before = snapshot(db).await;
        assert_err(
            report(
                db,
                "h1",
                r#"{"instances": [
                    {"instance_id": "vm1", "addresses": ["10.9.0.1/24"]},
                    {"instance_id": "vm2", "addresses": ["10.9.0.2/24", "10.9.0.300/24"]}
                ]}"#,
            )
            .await,
            Kind::Invalid,
            "instance vm2: addresses[1] \"10.9.0.300/24\" is not an address in CIDR form such as 10.0.0.2/24",
        );
        assert_err(
            report(
                db,
                "h1",
                r#"{"instances": [{"instance_id": "vm1", "addresses": ["10.9.0.1"]}]}"#,
            )
            .await,
            Kind::Invalid,
            "instance vm1: addresses[0] \"10.9.0.1\" is not an address in CIDR form such as 10.0.0.2/24",
        );
        assert_err(
            report(db, "bad host", r#"{"instances": []}"#).await,
            Kind::Invalid,
            "host_id \"bad host\" may only contain A-Z a-z 0-9 . _ - and must start with a letter or digit",
        );
        assert_eq!(snapshot(db).await, before);
        assert_eq!(stored_rows(db).await, 0);

        // In a caller's transaction that goes on: the failed call leaves it usable and unchanged.
        let mut tx: Tx = db.begin().await.unwrap();
        let bad: StatusReport = serde_json::from_str(
            r#"{"instances": [{"instance_id": "vm1", "addresses": ["10.9.0.1/24", "x/1"]}]}"#,
        )
        .unwrap();
        vmnet_ipam::report_host_status(&mut tx, "h1", &bad)
            .await
            .unwrap_err();
        let i = vmnet_ipam::get_instance(&mut tx, "vm1").await.unwrap();
        assert_eq!(i.addresses, strs(&["10.0.0.2/29"]));
        tx.commit().await.unwrap();
        assert_eq!(snapshot(db).await, before);
    }

    /// Deleting an instance deletes its reported addresses; the id reused starts again from its
    /// lease.
    pub async fn deletion_cascades(db: &Db) {
        setup(db).await;
        create(db, &on("vm1", "p1", "h1")).await.unwrap();
        create(db, &on("vm2", "p1", "h1")).await.unwrap();
        report(
            db,
            "h1",
            r#"{"instances": [{"instance_id": "vm1", "addresses": ["10.9.0.1/24", "fd00::1/64"]},
                              {"instance_id": "vm2", "addresses": ["10.9.0.2/24"]}]}"#,
        )
        .await
        .unwrap();
        assert_eq!(stored_rows(db).await, 3);
        let deleted = delete(db, "vm1").await.unwrap();
        assert_eq!(
            deleted.addresses,
            strs(&["10.0.0.2/29", "10.9.0.1/24", "fd00::1/64"]),
            "the deleted instance as it was"
        );
        assert_eq!(stored_rows(db).await, 1);
        let again = create(db, &on("vm1", "p1", "h1")).await.unwrap();
        assert_eq!(again.addresses, strs(&["10.0.0.2/29"]));
        assert_eq!(
            addresses(db, "vm2").await,
            strs(&["10.0.0.3/29", "10.9.0.2/24"])
        );
        check_invariants(db).await;
    }

    /// A host loss clears the reported addresses of every instance on it (they came from the old
    /// machine): a recreated instance starts again from its new lease, a lost one lists nothing;
    /// the old host's reports are skipped afterwards, the new host's are applied.
    pub async fn host_loss_clears_reported_addresses(db: &Db) {
        setup(db).await;
        let mut keep = on("vm1", "p1", "h1");
        keep.recreate_on_host_loss = true;
        create(db, &keep).await.unwrap();
        create(db, &on("vm2", "p1", "h1")).await.unwrap();
        create(db, &on("vm3", "p1", "h2")).await.unwrap();
        report(
            db,
            "h1",
            r#"{"instances": [{"instance_id": "vm1", "addresses": ["10.9.0.1/24"]},
                              {"instance_id": "vm2", "addresses": ["10.9.0.2/24"]}]}"#,
        )
        .await
        .unwrap();
        report(
            db,
            "h2",
            r#"{"instances": [{"instance_id": "vm3", "addresses": ["10.9.0.3/24"]}]}"#,
        )
        .await
        .unwrap();
        let loss = lose(db, "h1").await.unwrap();
        let got: Vec<_> = loss
            .instances
            .iter()
            .map(|i| {
                (
                    i.instance_id.as_str(),
                    i.host_id.as_deref(),
                    i.addresses.clone(),
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                ("vm1", Some("h2"), strs(&["10.0.0.2/29"])),
                ("vm2", None, vec![]),
            ],
            "vm1 re-placed with the lowest free lease; vm2 lost without one"
        );
        assert_eq!(addresses(db, "vm1").await, strs(&["10.0.0.2/29"]));
        assert!(addresses(db, "vm2").await.is_empty());
        assert_eq!(
            addresses(db, "vm3").await,
            strs(&["10.0.0.4/29", "10.9.0.3/24"]),
            "instances on other hosts keep theirs"
        );
        assert_eq!(stored_rows(db).await, 1);

        let out = report(
            db,
            "h1",
            r#"{"instances": [{"instance_id": "vm1", "addresses": ["10.9.0.1/24"]},
                              {"instance_id": "vm2", "addresses": ["10.9.0.2/24"]}]}"#,
        )
        .await
        .unwrap();
        assert!(out.updated.is_empty());
        let skipped: Vec<_> = out.skipped.iter().map(|s| s.message.as_str()).collect();
        assert_eq!(
            skipped,
            vec![
                "instance vm1 is placed on host h2, not h1",
                "instance vm2 is not placed on any host",
            ]
        );
        report(
            db,
            "h2",
            r#"{"instances": [{"instance_id": "vm1", "addresses": ["10.8.0.1/24"]}]}"#,
        )
        .await
        .unwrap();
        assert_eq!(
            addresses(db, "vm1").await,
            strs(&["10.0.0.2/29", "10.8.0.1/24"])
        );
        check_invariants(db).await;
    }

    /// A lease outside the pool's current range (after a range replacement) shows as /32.
    pub async fn lease_outside_the_replaced_range_is_slash32(db: &Db) {
        setup(db).await;
        create(db, &on("vm1", "p1", "h1")).await.unwrap();
        with_pool(db, "p1", "10.5.0.0/24", "10.5.0.1").await;
        assert_eq!(addresses(db, "vm1").await, strs(&["10.0.0.2/32"]));
    }
}

conformance!(cases:
    lease_first_then_reports_append_in_order,
    reports_never_replace_the_lease,
    without_a_lease_only_reported_addresses,
    other_hosts_and_unknown_instances_are_skipped,
    bad_cidr_is_invalid_and_writes_nothing,
    deletion_cascades,
    host_loss_clears_reported_addresses,
    lease_outside_the_replaced_range_is_slash32,
);

/// PostgreSQL (READ COMMITTED, row locks): a status report and a host loss of the reporting host
/// racing on separate connections never leave the lost host's addresses on the instance.
mod postgres_races {
    use std::time::Duration;

    use vmnet_ipam::{Db, StatusReport, Store};

    use crate::common::*;

    const REPORT: &str = r#"{"instances": [{"instance_id": "vm1", "addresses": ["10.9.0.1/24"]}]}"#;

    async fn setup() -> TestDb {
        let t = postgres().await;
        with_pool(&t.db, "p1", "10.0.0.0/29", "10.0.0.1").await;
        with_hosts(&t.db, &["h1", "h2"]).await;
        let mut r = on("vm1", "p1", "h1");
        r.recreate_on_host_loss = true;
        create(&t.db, &r).await.unwrap();
        t
    }

    async fn addresses(db: &Db) -> Vec<String> {
        let mut tx = db.begin().await.unwrap();
        let i = vmnet_ipam::get_instance(&mut tx, "vm1").await.unwrap();
        tx.commit().await.unwrap();
        i.addresses
    }

    /// The report holds the instance row; the host loss waits for it, then clears what it added.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn report_first_then_host_loss_clears_it() {
        let t = setup().await;
        let report: StatusReport = serde_json::from_str(REPORT).unwrap();
        let mut a = t.db.begin().await.unwrap();
        let out = vmnet_ipam::report_host_status(&mut a, "h1", &report)
            .await
            .unwrap();
        assert_eq!(out.updated[0].added, ["10.9.0.1/24"]);
        let db = t.db.clone();
        let loss = tokio::spawn(async move { lose(&db, "h1").await });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!loss.is_finished(), "the host loss waits for the report");
        a.commit().await.unwrap();
        let loss = loss.await.unwrap().unwrap();
        assert_eq!(loss.instances[0].addresses, ["10.0.0.2/29"]);
        assert_eq!(addresses(&t.db).await, ["10.0.0.2/29"]);
    }

    /// The host loss holds the instance row; the report waits for it, then skips the instance.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn host_loss_first_then_report_skips() {
        let t = setup().await;
        let mut b = t.db.begin().await.unwrap();
        vmnet_ipam::lose_host(&mut b, "h1").await.unwrap();
        let db = t.db.clone();
        let report = tokio::spawn(async move {
            let r: StatusReport = serde_json::from_str(REPORT).unwrap();
            let mut a = db.begin().await.unwrap();
            let out = vmnet_ipam::report_host_status(&mut a, "h1", &r).await;
            a.commit().await.unwrap();
            out
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!report.is_finished(), "the report waits for the host loss");
        b.commit().await.unwrap();
        let out = report.await.unwrap().unwrap();
        assert!(out.updated.is_empty());
        assert_eq!(
            out.skipped[0].message,
            "instance vm1 is placed on host h2, not h1"
        );
        assert_eq!(addresses(&t.db).await, ["10.0.0.2/29"]);
    }
}
