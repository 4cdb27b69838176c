//! Shared fixtures: a fresh store of either backend, helpers and a whole-database snapshot.
#![allow(dead_code, missing_docs)]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use std::collections::BTreeSet;
use vmnet_ipam::IpamError;
use vmnet_ipam::{AddRange, Db, Family, NewInstance, SetIpPool, Store, Tx};

use vmnet_model::error::chain;
use vmnet_model::pool::addr_num;

/// The kind of failure a test expects, read from the [`IpamError`] variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// [`IpamError::Invalid`].
    Invalid,
    /// [`IpamError::NotFound`].
    NotFound,
    /// [`IpamError::Conflict`].
    Conflict,
    /// [`IpamError::Exhausted`].
    Exhausted,
    /// The request may succeed later: contention, busy, the database or its files.
    Unavailable,
    /// A stored value does not decode.
    Corrupt,
}

/// The [`Kind`] of `e`.
pub fn kind(e: &IpamError) -> Kind {
    match e {
        IpamError::Invalid(_) | IpamError::UnknownScheme { .. } | IpamError::Url { .. } => {
            Kind::Invalid
        }
        IpamError::NotFound { .. } => Kind::NotFound,
        IpamError::Conflict(_) => Kind::Conflict,
        IpamError::Exhausted(_) => Kind::Exhausted,
        IpamError::Contended(_)
        | IpamError::Busy
        | IpamError::Database { .. }
        | IpamError::Connect(_)
        | IpamError::Migrate(_)
        | IpamError::Io { .. } => Kind::Unavailable,
        IpamError::Corrupt(_) | IpamError::Json { .. } => Kind::Corrupt,
    }
}

/// A fresh store; keeps its temp dir (SQLite) alive.
pub struct TestDb {
    pub db: Db,
    _dir: Option<tempfile::TempDir>,
}

pub async fn sqlite() -> TestDb {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("ipam.db").display());
    TestDb {
        db: Db::connect(&url).await.unwrap(),
        _dir: Some(dir),
    }
}

pub async fn postgres() -> TestDb {
    postgres_with(None).await
}

pub async fn postgres_with(max_connections: Option<u32>) -> TestDb {
    let url = vmnet_testkit::postgres::PgCluster::shared()
        .fresh_database_url()
        .unwrap();
    TestDb {
        db: Db::connect_with(&url, max_connections).await.unwrap(),
        _dir: None,
    }
}

pub fn ip(s: &str) -> Ipv4Addr {
    s.parse().unwrap()
}

pub fn range(pool: &str, cidr: &str, gw: &str) -> SetIpPool {
    SetIpPool {
        pool_id: pool.into(),
        cidr: cidr.into(),
        gateway: gw.into(),
        ..Default::default()
    }
}

pub fn inst(id: &str, pool: &str) -> NewInstance {
    NewInstance::new(id, pool)
}

/// Instance `id` in `pool` placed on `host` by its caller.
pub fn on(id: &str, pool: &str, host: &str) -> NewInstance {
    let mut r = inst(id, pool);
    r.host_id = Some(host.into());
    r
}

/// A fixture: pool `pool` with range `cidr` and gateway `gw` (the rest defaulted); the range.
pub async fn with_pool(db: &Db, pool: &str, cidr: &str, gw: &str) -> vmnet_ipam::IpRange {
    set_pool(db, range(pool, cidr, gw))
        .await
        .unwrap_or_else(|e| panic!("range {cidr} of pool {pool}: {e}"))
}

/// A fixture: `hosts`, 8 vCPUs and 8 GiB each.
pub async fn with_hosts(db: &Db, hosts: &[&str]) {
    for h in hosts {
        add_host(db, h, 8, 8192).await;
    }
}

/// A SQLite file (in the returned directory) after running `scripts` in order: a store as an
/// older version left it, for migration tests.
pub async fn sqlite_after(scripts: &[&'static str]) -> (tempfile::TempDir, sqlx::SqliteConnection) {
    use sqlx::Connection;
    let tmp = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}?mode=rwc", tmp.path().join("m.db").display());
    let mut c = sqlx::SqliteConnection::connect(&url).await.unwrap();
    for sql in scripts {
        sqlx::raw_sql(*sql).execute(&mut c).await.unwrap();
    }
    (tmp, c)
}

/// A fresh database of the shared PostgreSQL cluster after running `scripts` in order (see
/// [`sqlite_after`]); the cluster and the database's name.
pub fn postgres_after(scripts: &[&str]) -> (&'static vmnet_testkit::postgres::PgCluster, String) {
    let pg = vmnet_testkit::postgres::PgCluster::shared();
    let db = pg.fresh_database().unwrap();
    for sql in scripts {
        pg.psql(&db, sql).unwrap();
    }
    (pg, db)
}

/// Runs one operation in its own transaction and commits it only on success.
pub async fn set_pool(db: &Db, req: SetIpPool) -> Result<vmnet_ipam::IpRange, IpamError> {
    let mut tx = db.begin().await?;
    let r = vmnet_ipam::set_ip_pool(&mut tx, req).await?;
    tx.commit().await?;
    Ok(r)
}

pub async fn add_host(db: &Db, id: &str, vcpus: u32, mem: u32) {
    let mut tx = db.begin().await.unwrap();
    vmnet_ipam::add_host(&mut tx, id, vcpus, mem).await.unwrap();
    tx.commit().await.unwrap();
}

pub async fn create(db: &Db, req: &NewInstance) -> Result<vmnet_ipam::Instance, IpamError> {
    let mut tx = db.begin().await?;
    let r = vmnet_ipam::create_instance(&mut tx, req).await?;
    tx.commit().await?;
    Ok(r)
}

pub async fn delete(db: &Db, id: &str) -> Result<vmnet_ipam::Instance, IpamError> {
    let mut tx = db.begin().await?;
    let r = vmnet_ipam::delete_instance(&mut tx, id).await?;
    tx.commit().await?;
    Ok(r)
}

pub async fn lose(db: &Db, host: &str) -> Result<vmnet_ipam::HostLoss, IpamError> {
    let mut tx = db.begin().await?;
    let r = vmnet_ipam::lose_host(&mut tx, host).await?;
    tx.commit().await?;
    Ok(r)
}

pub async fn lease(db: &Db, pool: &str, instance: &str) -> Result<Option<Ipv4Addr>, IpamError> {
    let mut tx = db.begin().await?;
    let r = vmnet_ipam::lease(&mut tx, pool, instance).await?;
    tx.commit().await?;
    Ok(r)
}

pub async fn release(db: &Db, instance: &str) -> Result<Option<vmnet_ipam::Lease>, IpamError> {
    let mut tx = db.begin().await?;
    let r = vmnet_ipam::release(&mut tx, instance).await?;
    tx.commit().await?;
    Ok(r)
}

/// The IPv4 leases of a pool in address order.
pub async fn leases(db: &Db, pool: &str) -> Vec<(Ipv4Addr, String)> {
    let mut tx = db.begin().await.unwrap();
    let r = vmnet_ipam::list_leases(&mut tx, pool).await.unwrap();
    tx.commit().await.unwrap();
    r.into_iter()
        .filter_map(|l| match l.address {
            IpAddr::V4(a) => Some((a, l.instance_id)),
            IpAddr::V6(_) => None,
        })
        .collect()
}

/// The IPv6 leases of a pool in address order.
pub async fn leases6(db: &Db, pool: &str) -> Vec<(Ipv6Addr, String)> {
    let mut tx = db.begin().await.unwrap();
    let r = vmnet_ipam::list_leases(&mut tx, pool).await.unwrap();
    tx.commit().await.unwrap();
    r.into_iter()
        .filter_map(|l| match l.address {
            IpAddr::V6(a) => Some((a, l.instance_id)),
            IpAddr::V4(_) => None,
        })
        .collect()
}

pub fn ip6(s: &str) -> Ipv6Addr {
    s.parse().unwrap()
}

/// An added range request.
pub fn add(pool: &str, cidr: &str, gw: &str) -> AddRange {
    AddRange {
        pool_id: pool.into(),
        cidr: cidr.into(),
        gateway: gw.into(),
        ..Default::default()
    }
}

/// Runs `add_range` in its own transaction.
pub async fn add_range(db: &Db, req: AddRange) -> Result<vmnet_ipam::PoolRange, IpamError> {
    let mut tx = db.begin().await?;
    let r = vmnet_ipam::add_range(&mut tx, &req).await?;
    tx.commit().await?;
    Ok(r)
}

/// Runs `remove_range` in its own transaction.
pub async fn remove_range(
    db: &Db,
    pool: &str,
    cidr: &str,
) -> Result<vmnet_ipam::PoolRange, IpamError> {
    let mut tx = db.begin().await?;
    let r = vmnet_ipam::remove_range(&mut tx, pool, cidr).await?;
    tx.commit().await?;
    Ok(r)
}

/// Runs `lease6` in its own transaction.
pub async fn lease6(db: &Db, pool: &str, instance: &str) -> Result<Option<Ipv6Addr>, IpamError> {
    let mut tx = db.begin().await?;
    let r = vmnet_ipam::lease6(&mut tx, pool, instance).await?;
    tx.commit().await?;
    Ok(r)
}

/// The IPv6 free intervals as `(pool, range_seq, first, last)`.
pub async fn free6_rows(tx: &mut Tx) -> Vec<(String, i64, u128, u128)> {
    let sql = "SELECT pool_id, range_seq, first, last FROM ip6_free ORDER BY pool_id, first";
    let rows: Vec<(String, i64, Vec<u8>, Vec<u8>)> = match tx {
        Tx::Sqlite(t) => sqlx::query_as(sql).fetch_all(&mut **t).await.unwrap(),
        Tx::Postgres(t) => sqlx::query_as(sql).fetch_all(&mut **t).await.unwrap(),
    };
    let n = |b: &[u8]| u128::from_be_bytes(b.try_into().unwrap());
    rows.into_iter()
        .map(|(p, s, f, l)| (p, s, n(&f), n(&l)))
        .collect()
}

pub fn assert_err(r: Result<impl std::fmt::Debug, IpamError>, want: Kind, message: &str) {
    match r {
        Ok(v) => panic!("expected {want:?}: {message}, got Ok({v:?})"),
        Err(e) => {
            assert_eq!(kind(&e), want, "kind of {e}");
            assert_eq!(chain(&e), message, "message of {e}");
        }
    }
}

/// Every row of every IPAM table, in a stable text form.
pub async fn snapshot(db: &Db) -> Vec<String> {
    let mut tx = db.begin().await.unwrap();
    let mut out = Vec::new();
    for p in vmnet_ipam::list_pools(&mut tx).await.unwrap() {
        out.push(format!("{p:?}"));
        for l in vmnet_ipam::list_leases(&mut tx, &p.pool_id).await.unwrap() {
            out.push(format!("{l:?}"));
        }
    }
    for h in vmnet_ipam::list_hosts(&mut tx).await.unwrap() {
        out.push(format!("{h:?}"));
    }
    for i in vmnet_ipam::list_instances(&mut tx).await.unwrap() {
        out.push(format!("{i:?}"));
    }
    for (p, f, l) in free_rows(&mut tx).await {
        out.push(format!("free {p} {f} {l}"));
    }
    for (p, s, f, l) in free6_rows(&mut tx).await {
        out.push(format!("free6 {p} {s} {f} {l}"));
    }
    out.push(format!(
        "all leases {} {}",
        count(&mut tx, "SELECT COUNT(*) FROM ip_leases").await,
        count(&mut tx, "SELECT COUNT(*) FROM ip6_leases").await
    ));
    tx.commit().await.unwrap();
    out
}

pub async fn free_rows(tx: &mut Tx) -> Vec<(String, i64, i64)> {
    let sql = "SELECT pool_id, first, last FROM ip_free ORDER BY pool_id, first";
    match tx {
        Tx::Sqlite(t) => sqlx::query_as(sql).fetch_all(&mut **t).await.unwrap(),
        Tx::Postgres(t) => sqlx::query_as(sql).fetch_all(&mut **t).await.unwrap(),
    }
}

pub async fn count(tx: &mut Tx, sql: &'static str) -> i64 {
    match tx {
        Tx::Sqlite(t) => sqlx::query_scalar(sql).fetch_one(&mut **t).await.unwrap(),
        Tx::Postgres(t) => sqlx::query_scalar(sql).fetch_one(&mut **t).await.unwrap(),
    }
}

/// Checks the invariants with SQL against the tables: one lease per placed instance, none
/// leaked (every lease belongs to a running instance), none shared, no free interval overlapping
/// a lease, host claims equal to the sum of their instances' requests.
pub async fn check_invariants(db: &Db) {
    let mut tx = db.begin().await.unwrap();
    let q = |s: &'static str| s;
    // Placed (running) instances in pools with a range each hold exactly one lease.
    let missing = count(
        &mut tx,
        q("SELECT COUNT(*) FROM instances i JOIN ip_pools p ON p.pool_id = i.pool_id \
           WHERE i.state = 'running' AND NOT EXISTS (SELECT 1 FROM ip_leases l WHERE l.instance_id = i.instance_id)"),
    )
    .await;
    assert_eq!(missing, 0, "running instances without a lease");
    let leaked = count(
        &mut tx,
        q("SELECT COUNT(*) FROM ip_leases l WHERE NOT EXISTS \
           (SELECT 1 FROM instances i WHERE i.instance_id = l.instance_id AND i.state = 'running' AND i.pool_id = l.pool_id)"),
    )
    .await;
    assert_eq!(
        leaked, 0,
        "leases not held by a running instance of the pool"
    );
    let shared = count(
        &mut tx,
        q("SELECT COUNT(*) FROM (SELECT pool_id, address FROM ip_leases GROUP BY pool_id, address HAVING COUNT(*) > 1) s"),
    )
    .await;
    assert_eq!(shared, 0, "shared addresses");
    let multi = count(
        &mut tx,
        q("SELECT COUNT(*) FROM (SELECT instance_id FROM ip_leases GROUP BY instance_id HAVING COUNT(*) > 1) s"),
    )
    .await;
    assert_eq!(multi, 0, "instances with more than one lease");
    let missing6 = count(
        &mut tx,
        q(
            "SELECT COUNT(*) FROM instances i WHERE i.state = 'running' \
           AND EXISTS (SELECT 1 FROM ip_ranges r WHERE r.pool_id = i.pool_id AND r.family = 6) \
           AND NOT EXISTS (SELECT 1 FROM ip6_leases l WHERE l.instance_id = i.instance_id)",
        ),
    )
    .await;
    assert_eq!(missing6, 0, "running instances without an IPv6 lease");
    let leaked6 = count(
        &mut tx,
        q("SELECT COUNT(*) FROM ip6_leases l WHERE NOT EXISTS \
           (SELECT 1 FROM instances i WHERE i.instance_id = l.instance_id AND i.state = 'running' AND i.pool_id = l.pool_id)"),
    )
    .await;
    assert_eq!(
        leaked6, 0,
        "IPv6 leases not held by a running instance of the pool"
    );
    let multi6 = count(
        &mut tx,
        q("SELECT COUNT(*) FROM (SELECT instance_id FROM ip6_leases GROUP BY instance_id HAVING COUNT(*) > 1) s"),
    )
    .await;
    assert_eq!(multi6, 0, "instances with more than one IPv6 lease");
    let unplaced_with_host = count(
        &mut tx,
        q("SELECT COUNT(*) FROM instances WHERE state <> 'running' AND host_id IS NOT NULL"),
    )
    .await;
    assert_eq!(unplaced_with_host, 0);
    let bad_claims = count(
        &mut tx,
        q("SELECT COUNT(*) FROM hosts h WHERE h.used_vcpus <> COALESCE((SELECT SUM(i.vcpus) FROM instances i \
           WHERE i.host_id = h.host_id AND i.state = 'running'), 0) \
           OR h.used_memory_mib <> COALESCE((SELECT SUM(i.memory_mib) FROM instances i \
           WHERE i.host_id = h.host_id AND i.state = 'running'), 0)"),
    )
    .await;
    assert_eq!(
        bad_claims, 0,
        "host claims differ from their running instances"
    );
    tx.commit().await.unwrap();
    check_free_index(db).await;
}

/// Checks that the free index is exactly range - gateway - leases, per family.
pub async fn check_free_index(db: &Db) {
    let mut tx = db.begin().await.unwrap();
    let pools = vmnet_ipam::list_pools(&mut tx).await.unwrap();
    let free = free_rows(&mut tx).await;
    let free6 = free6_rows(&mut tx).await;
    for p in pools {
        let all = vmnet_ipam::list_leases(&mut tx, &p.pool_id).await.unwrap();
        let leased: BTreeSet<u128> = all.iter().map(|l| addr_num(l.address)).collect();
        // IPv4: every address of every range, enumerated.
        let mut free_set = BTreeSet::new();
        for (_, f, l) in free.iter().filter(|(pp, _, _)| *pp == p.pool_id) {
            for a in *f..=*l {
                assert!(
                    free_set.insert(u128::try_from(a).unwrap()),
                    "overlapping free intervals"
                );
            }
        }
        let v4: Vec<_> = p
            .ranges
            .iter()
            .filter(|r| r.family == Family::Ipv4)
            .collect();
        for r in &v4 {
            let (lo, hi, gw) = r.bounds();
            for a in lo..=hi {
                let expect_free = a != gw && !leased.contains(&a);
                assert_eq!(
                    free_set.contains(&a),
                    expect_free,
                    "free index wrong for {a}"
                );
            }
        }
        assert!(
            free_set.iter().all(|a| v4
                .iter()
                .any(|r| r.is_leasable(IpAddr::V4(Ipv4Addr::from(u32::try_from(*a).unwrap()))))),
            "free address outside the ranges"
        );
        // IPv6: ranges too large to enumerate. Disjoint intervals inside the ranges, holding no
        // lease and no gateway, as many free addresses as the ranges less their leases.
        let v6: Vec<_> = p
            .ranges
            .iter()
            .filter(|r| r.family == Family::Ipv6)
            .collect();
        let mut iv: Vec<(u128, u128)> = free6
            .iter()
            .filter(|r| r.0 == p.pool_id)
            .map(|r| (r.2, r.3))
            .collect();
        iv.sort_unstable();
        for w in iv.windows(2) {
            assert!(w[0].1 < w[1].0, "overlapping IPv6 free intervals");
        }
        let mut free_count = 0u128;
        for (f, l) in &iv {
            assert!(f <= l);
            let r = v6
                .iter()
                .find(|r| {
                    let (lo, hi, _) = r.bounds();
                    lo <= *f && *l <= hi
                })
                .expect("IPv6 free interval outside the ranges");
            let gw = r.bounds().2;
            assert!(!(*f..=*l).contains(&gw), "free IPv6 gateway");
            assert!(
                leased.range(*f..=*l).next().is_none(),
                "free interval holds a lease"
            );
            free_count += l - f + 1;
        }
        let in_ranges = leased
            .iter()
            .filter(|a| {
                v6.iter()
                    .any(|r| r.is_leasable(IpAddr::V6(Ipv6Addr::from(**a))))
            })
            .count();
        let size: u128 = v6.iter().map(|r| r.size()).sum();
        assert_eq!(free_count, size - in_ranges as u128, "IPv6 free count");
    }
    tx.commit().await.unwrap();
}

/// Generates one `#[tokio::test]` per case and backend: `sqlite::case` and `postgres::case`.
#[macro_export]
macro_rules! conformance {
    ($cases:ident: $($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let t = $crate::common::sqlite().await;
                    $crate::$cases::$name(&t.db).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let t = $crate::common::postgres().await;
                    $crate::$cases::$name(&t.db).await;
                }
            )*
        }
    };
}
