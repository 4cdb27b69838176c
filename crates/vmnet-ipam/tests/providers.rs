//! The conformance suite, part 4: provider pools (spec: hosted-pool-networking.md, the table of
//! pools, "Provider"; "Addresses on an instance", provider pools), on both stores.
#![allow(missing_docs)]

mod common;

mod cases {
    use ipnet::IpNet;
    use vmnet_ipam::{
        Credentials, Db, IpamError, Machine, MachinePoll, NewInstance, PoolKind, Provider,
        ProviderPool, SetProviderPool, Store,
    };

    use crate::common::*;

    fn hetzner(pool: &str) -> SetProviderPool {
        SetProviderPool {
            pool_id: pool.into(),
            provider: "hetzner-cloud".into(),
            api_url: None,
            credentials: Credentials::Env("HCLOUD_TOKEN".into()),
            poll_interval_secs: None,
        }
    }

    async fn set(db: &Db, req: &SetProviderPool) -> Result<ProviderPool, IpamError> {
        let mut tx = db.begin().await?;
        let r = vmnet_ipam::set_provider_pool(&mut tx, req).await?;
        tx.commit().await?;
        Ok(r)
    }

    fn machine(id: &str, pool: &str, m: Machine) -> NewInstance {
        let mut r = NewInstance::new(id, pool);
        r.machine = Some(m);
        r
    }

    fn nets(v: &[&str]) -> Vec<IpNet> {
        v.iter().map(|s| s.parse().unwrap()).collect()
    }

    async fn poll(db: &Db, pool: &str, at: i64, results: Vec<MachinePoll>) {
        let mut tx = db.begin().await.unwrap();
        vmnet_ipam::record_poll(&mut tx, pool, at, &results)
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }

    async fn get(db: &Db, id: &str) -> vmnet_ipam::Instance {
        let mut tx = db.begin().await.unwrap();
        let i = vmnet_ipam::get_instance(&mut tx, id).await.unwrap();
        let listed = vmnet_ipam::list_instances(&mut tx)
            .await
            .unwrap()
            .into_iter()
            .find(|x| x.instance_id == id)
            .unwrap();
        tx.commit().await.unwrap();
        assert_eq!(i, listed, "get and list agree on {id}");
        i
    }

    /// A provider pool is stored with its settings (the credentials' source, never a secret),
    /// listed as kind `provider`, replaced by a second set, and listed for the poller.
    pub async fn settings_are_stored_and_listed(db: &Db) {
        let p = set(db, &hetzner("hz")).await.unwrap();
        assert_eq!(p.api_url, "https://api.hetzner.cloud/v1");
        assert_eq!(p.poll_interval_secs, 30);
        with_pool(db, "p1", "10.0.0.0/29", "10.0.0.1").await;
        let mut tx = db.begin().await.unwrap();
        let pool = vmnet_ipam::get_pool(&mut tx, "hz").await.unwrap();
        assert_eq!(pool.kind, PoolKind::Provider);
        assert_eq!(pool.provider.as_ref(), Some(&p));
        assert!(pool.range.is_none());
        let hosted = vmnet_ipam::get_pool(&mut tx, "p1").await.unwrap();
        assert_eq!(hosted.kind, PoolKind::Hosted);
        assert!(hosted.provider.is_none());
        tx.commit().await.unwrap();

        let mut pve = hetzner("pve");
        pve.provider = "proxmox-ve".into();
        pve.api_url = Some("https://pve1.example.com:8006/api2/json".into());
        pve.credentials = Credentials::File("/etc/vmnet/pve.token".into());
        pve.poll_interval_secs = Some(60);
        set(db, &pve).await.unwrap();
        pve.poll_interval_secs = Some(90);
        set(db, &pve).await.unwrap();
        let mut tx = db.begin().await.unwrap();
        let all = vmnet_ipam::list_provider_pools(&mut tx).await.unwrap();
        tx.commit().await.unwrap();
        assert_eq!(all.len(), 2);
        assert_eq!(all[0], p);
        assert_eq!(all[1].provider, Provider::ProxmoxVe);
        assert_eq!(all[1].poll_interval_secs, 90);
        assert_eq!(
            all[1].credentials,
            Credentials::File("/etc/vmnet/pve.token".into())
        );
    }

    /// A pool is hosted or provider, never both; the provider of a pool with machines stays.
    pub async fn kinds_do_not_mix(db: &Db) {
        with_pool(db, "p1", "10.0.0.0/29", "10.0.0.1").await;
        assert_err(
            set(db, &hetzner("p1")).await,
            Kind::Conflict,
            "pool p1 has a range; a provider pool leases nothing (use another pool id)",
        );
        set(db, &hetzner("hz")).await.unwrap();
        assert_err(
            set_pool(db, range("hz", "10.1.0.0/29", "10.1.0.1")).await,
            Kind::Conflict,
            "pool hz is a provider pool (hetzner-cloud); it has no range and leases nothing",
        );
        let mut tx = db.begin().await.unwrap();
        vmnet_ipam::create_pool(&mut tx, "bare").await.unwrap();
        tx.commit().await.unwrap();
        with_hosts(db, &["h1"]).await;
        create(db, &inst("vm0", "bare")).await.unwrap();
        assert_err(
            set(db, &hetzner("bare")).await,
            Kind::Conflict,
            "pool bare has 1 hosted instance(s) without a machine; a provider pool's instances are machines",
        );
        create(db, &machine("vm1", "hz", Machine::hetzner(42)))
            .await
            .unwrap();
        let mut pve = hetzner("hz");
        pve.provider = "proxmox-ve".into();
        pve.api_url = Some("https://pve.example.com:8006/api2/json".into());
        assert_err(
            set(db, &pve).await,
            Kind::Conflict,
            "pool hz has 1 hetzner-cloud machine(s); delete their instances before changing the provider to proxmox-ve",
        );
        assert_err(
            set(
                db,
                &SetProviderPool {
                    poll_interval_secs: Some(2),
                    ..hetzner("hz")
                },
            )
            .await,
            Kind::Invalid,
            "pool hz: poll_interval_secs 2 must be between 5 and 86400",
        );
        check_invariants(db).await;
    }

    /// An instance of a provider pool is its machine: no host, no claim, no lease; the machine
    /// must fit the provider and belong to one instance; a re-create is idempotent; a delete
    /// removes the machine.
    pub async fn instances_are_machines(db: &Db) {
        set(db, &hetzner("hz")).await.unwrap();
        with_pool(db, "p1", "10.0.0.0/29", "10.0.0.1").await;
        with_hosts(db, &["h1"]).await;
        assert_err(
            create(db, &inst("vm1", "hz")).await,
            Kind::Invalid,
            "instance vm1: machine is required for an instance of provider pool hz (hetzner-cloud)",
        );
        assert_err(
            create(db, &machine("vm1", "hz", Machine::proxmox("pve1", 100))).await,
            Kind::Invalid,
            "instance vm1: machine.node is not used by a hetzner-cloud pool",
        );
        let mut placed = machine("vm1", "hz", Machine::hetzner(42));
        placed.host_id = Some("h1".into());
        assert_err(
            create(db, &placed).await,
            Kind::Invalid,
            "instance vm1: host_id: an instance of provider pool hz is a machine at hetzner-cloud, not placed on a host",
        );
        assert_err(
            create(db, &machine("vm1", "p1", Machine::hetzner(42))).await,
            Kind::Invalid,
            "instance vm1: machine is only for instances of a provider pool; pool p1 is hosted",
        );
        let vm1 = create(db, &machine("vm1", "hz", Machine::hetzner(42)))
            .await
            .unwrap();
        assert_eq!(vm1.machine, Some(Machine::hetzner(42)));
        assert_eq!(vm1.host_id, None);
        assert_eq!(vm1.address, None);
        assert!(vm1.addresses.is_empty());
        assert!(!vm1.addresses_stale);
        assert_eq!(vm1.addresses_polled_at_unix_ms, None);
        assert_eq!(vm1.allocation_id, "vm1");
        let again = create(db, &machine("vm1", "hz", Machine::hetzner(42)))
            .await
            .unwrap();
        assert_eq!(again, vm1, "the same request again answers the instance");
        assert_err(
            create(db, &machine("vm1", "hz", Machine::hetzner(43))).await,
            Kind::Conflict,
            "instance vm1 already exists with machine server 42 (this request: server 43)",
        );
        assert_err(
            create(db, &machine("vm2", "hz", Machine::hetzner(42))).await,
            Kind::Conflict,
            "instance vm2: machine server 42 of pool hz is instance vm1",
        );
        let mut tx = db.begin().await.unwrap();
        let host = vmnet_ipam::get_host(&mut tx, "h1").await.unwrap();
        assert_eq!(host.used_vcpus, 0, "no claim");
        let machines = vmnet_ipam::provider_machines(&mut tx, "hz").await.unwrap();
        tx.commit().await.unwrap();
        assert_eq!(machines, vec![("vm1".to_owned(), Machine::hetzner(42))]);
        assert!(leases(db, "hz").await.is_empty());
        delete(db, "vm1").await.unwrap();
        create(db, &machine("vm2", "hz", Machine::hetzner(42)))
            .await
            .unwrap();
        check_invariants(db).await;
    }

    /// Each poll replaces the addresses (never appends); a failed machine or pool keeps the
    /// last good ones, marked stale, until the next good poll.
    pub async fn polls_replace_and_failures_keep_the_last_good(db: &Db) {
        set(db, &hetzner("hz")).await.unwrap();
        create(db, &machine("vm1", "hz", Machine::hetzner(1)))
            .await
            .unwrap();
        create(db, &machine("vm2", "hz", Machine::hetzner(2)))
            .await
            .unwrap();
        let first = nets(&["203.0.113.7/32", "2001:db8:7::/64", "10.0.0.2/32"]);
        poll(
            db,
            "hz",
            1000,
            vec![
                MachinePoll {
                    instance_id: "vm1".into(),
                    addresses: Some(first.clone()),
                },
                MachinePoll {
                    instance_id: "vm2".into(),
                    addresses: Some(Vec::new()),
                },
            ],
        )
        .await;
        let vm1 = get(db, "vm1").await;
        assert_eq!(
            vm1.addresses,
            vec!["203.0.113.7/32", "2001:db8:7::/64", "10.0.0.2/32"]
        );
        assert_eq!(vm1.addresses_polled_at_unix_ms, Some(1000));
        assert!(!vm1.addresses_stale);

        poll(
            db,
            "hz",
            2000,
            vec![MachinePoll {
                instance_id: "vm1".into(),
                addresses: Some(nets(&["198.51.100.9/32"])),
            }],
        )
        .await;
        let vm1 = get(db, "vm1").await;
        assert_eq!(
            vm1.addresses,
            vec!["198.51.100.9/32"],
            "replaced, not appended"
        );
        assert_eq!(vm1.addresses_polled_at_unix_ms, Some(2000));

        poll(
            db,
            "hz",
            3000,
            vec![MachinePoll {
                instance_id: "vm1".into(),
                addresses: None,
            }],
        )
        .await;
        let vm1 = get(db, "vm1").await;
        assert_eq!(vm1.addresses, vec!["198.51.100.9/32"], "kept");
        assert!(vm1.addresses_stale);
        assert_eq!(vm1.addresses_polled_at_unix_ms, Some(2000));
        assert!(!get(db, "vm2").await.addresses_stale);

        let mut tx = db.begin().await.unwrap();
        assert_eq!(vmnet_ipam::mark_pool_stale(&mut tx, "hz").await.unwrap(), 2);
        tx.commit().await.unwrap();
        assert!(get(db, "vm2").await.addresses_stale);

        poll(
            db,
            "hz",
            4000,
            vec![MachinePoll {
                instance_id: "vm1".into(),
                addresses: Some(first),
            }],
        )
        .await;
        let vm1 = get(db, "vm1").await;
        assert!(!vm1.addresses_stale);
        assert_eq!(vm1.addresses.len(), 3);
        assert_eq!(vm1.addresses_polled_at_unix_ms, Some(4000));
        // A poll naming a deleted instance writes nothing for it.
        delete(db, "vm2").await.unwrap();
        let mut tx = db.begin().await.unwrap();
        let n = vmnet_ipam::record_poll(
            &mut tx,
            "hz",
            5000,
            &[MachinePoll {
                instance_id: "vm2".into(),
                addresses: Some(Vec::new()),
            }],
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
        assert_eq!(n, 0);
    }
}

conformance!(cases:
    settings_are_stored_and_listed,
    kinds_do_not_mix,
    instances_are_machines,
    polls_replace_and_failures_keep_the_last_good,
);
