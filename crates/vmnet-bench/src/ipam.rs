//! `vmnet-lab bench ipam`: lease/release latency and throughput on SQLite and PostgreSQL.
//!
//! For each store, three dual-stack pools are filled to 0 %, 50 % and 99 % with a bulk insert
//! (50 %: every other address, the most fragmented free index; 99 %: every hundredth address
//! left free): a `/16` and an IPv6 range of as many addresses (65,533) at the top of a `/64`, each
//! filled the same way. One writer takes `--ops` IPv4 leases (at most as many as are free: 655 at
//! 99 %), each in its own committed transaction, releases them again, each in its own
//! transaction, then does the same with IPv6 leases of the same pool; the IPv6 columns stand
//! beside the IPv4 ones. On PostgreSQL the same runs again with
//! `--placers` concurrent placers on separate connections. The table shows per-transaction
//! latency (median, p99) and leases per second; the two targets (99 %-full lease at most 3× the
//! empty-pool lease; SQLite at least 2,000 durable leases/s) are checked on the last lines.
//!
//! Durability: SQLite in WAL mode with `synchronous=FULL` (the WAL is fsynced on every commit);
//! PostgreSQL with its defaults `fsync=on`, `synchronous_commit=on`. Without `--postgres-url`
//! a throwaway cluster (unix socket only) is started and removed afterwards.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use vmnet_ipam::{AddRange, Db, IpamError, SetIpPool, Store};
use vmnet_model::Error;

use crate::BenchError;
use vmnet_sandbox::postgres::{PgCluster, PgOptions};

/// Arguments of this command.
#[derive(Debug, clap::Args)]
pub struct IpamBenchArgs {
    /// Lease (and release) transactions per fill level for the single writer.
    #[arg(long, default_value_t = 1000)]
    pub ops: usize,
    /// Concurrent placers for the PostgreSQL run.
    #[arg(long, default_value_t = 8)]
    pub placers: usize,
    /// Use this PostgreSQL database instead of starting a throwaway cluster.
    #[arg(long)]
    pub postgres_url: Option<String>,
    /// Skip PostgreSQL.
    #[arg(long)]
    pub skip_postgres: bool,
    /// Directory for the SQLite benchmark database `bench.db` (default: a new directory under the
    /// system temp dir, removed afterwards).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// One row of the table.
struct Row {
    store: String,
    fill: u32,
    lease: Vec<Duration>,
    release: Vec<Duration>,
    leases_per_s: f64,
    lease6: Vec<Duration>,
    release6: Vec<Duration>,
    leases6_per_s: f64,
}

/// The leasable addresses of each range, IPv4 and IPv6 alike: a `/16` less network, gateway and
/// broadcast.
const RANGE_SIZE: u128 = 65_533;

fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let i = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1000.0)
}

fn bench_err(e: impl std::fmt::Display) -> BenchError {
    Error::unavailable(format!("bench: {e}")).into()
}

/// Creates pool `pool` on `10.<octet>.0.0/16` and bulk-fills `fill` percent of it; returns how
/// many addresses are left free.
async fn prepare(db: &Db, pool: &str, octet: u8, fill: u32) -> Result<usize, BenchError> {
    let mut tx = db.begin().await?;
    let req = SetIpPool {
        pool_id: pool.to_owned(),
        cidr: format!("10.{octet}.0.0/16"),
        gateway: format!("10.{octet}.0.1"),
        ..SetIpPool::default()
    };
    let r = vmnet_ipam::set_ip_pool(&mut tx, req).await?;
    let all: Vec<Ipv4Addr> = (u32::from(r.first_host)..=u32::from(r.last_host))
        .map(Ipv4Addr::from)
        .filter(|a| r.is_leasable(*a))
        .collect();
    let taken: Vec<Ipv4Addr> = match fill {
        0 => Vec::new(),
        50 => all.iter().step_by(2).copied().collect(),
        _ => all
            .iter()
            .enumerate()
            .filter(|(i, _)| i % 100 != 0)
            .map(|(_, a)| *a)
            .collect(),
    };
    vmnet_ipam::bulk_insert_leases(&mut tx, pool, &taken, &format!("{pool}-fill-")).await?;
    // The IPv6 range: as many addresses, at the top of a /64 (the default last host).
    let net = u128::from(Ipv6Addr::new(
        0x2001,
        0xdb8,
        u16::from(octet),
        0,
        0,
        0,
        0,
        0,
    ));
    let last = net + (1u128 << 64) - 129;
    let first = last + 1 - RANGE_SIZE;
    let r6 = vmnet_ipam::add_range(
        &mut tx,
        &AddRange {
            pool_id: pool.to_owned(),
            cidr: format!("{}/64", Ipv6Addr::from(net)),
            gateway: "fe80::1".into(),
            first_host: Some(Ipv6Addr::from(first).to_string()),
            last_host: None,
        },
    )
    .await?;
    if r6.size() != RANGE_SIZE {
        return Err(bench_err(format!("IPv6 range of {} addresses", r6.size())));
    }
    let taken6: Vec<Ipv6Addr> = (first..=last)
        .enumerate()
        .filter(|(i, _)| match fill {
            0 => false,
            50 => i % 2 == 0,
            _ => i % 100 != 0,
        })
        .map(|(_, a)| Ipv6Addr::from(a))
        .collect();
    vmnet_ipam::bulk_insert_leases6(&mut tx, pool, &taken6, &format!("{pool}-fill6-")).await?;
    tx.commit().await?;
    Ok(all.len() - taken.len())
}

/// What one writer measured for one family.
type Measured = (Vec<Duration>, Vec<Duration>, f64);

/// One writer: `ops` leases of one family then `ops` releases, each its own transaction.
async fn single(db: &Db, pool: &str, ops: usize, v6: bool) -> Result<Measured, BenchError> {
    let mut lease = Vec::with_capacity(ops);
    let start = Instant::now();
    for i in 0..ops {
        let t = Instant::now();
        let mut tx = db.begin().await?;
        let id = format!("{pool}-b{i}");
        let got = if v6 {
            vmnet_ipam::lease6(&mut tx, pool, &id).await?.is_some()
        } else {
            vmnet_ipam::lease(&mut tx, pool, &id).await?.is_some()
        };
        if !got {
            return Err(bench_err("no range"));
        }
        tx.commit().await?;
        lease.push(t.elapsed());
    }
    #[allow(clippy::cast_precision_loss)]
    let rate = ops as f64 / start.elapsed().as_secs_f64();
    let mut release = Vec::with_capacity(ops);
    for i in 0..ops {
        let t = Instant::now();
        let mut tx = db.begin().await?;
        let id = format!("{pool}-b{i}");
        if v6 {
            vmnet_ipam::release6(&mut tx, &id).await?;
        } else {
            vmnet_ipam::release(&mut tx, &id).await?;
        }
        tx.commit().await?;
        release.push(t.elapsed());
    }
    Ok((lease, release, rate))
}

/// `placers` concurrent writers, `per` leases each, then the releases, concurrently too.
async fn concurrent(
    db: &Db,
    pool: &str,
    placers: usize,
    per: usize,
    v6: bool,
) -> Result<Measured, BenchError> {
    let run = |release: bool| {
        let mut tasks = Vec::new();
        for p in 0..placers {
            let db = db.clone();
            let pool = pool.to_owned();
            tasks.push(tokio::spawn(async move {
                let mut lat = Vec::with_capacity(per);
                for i in 0..per {
                    let id = format!("{pool}-p{p}-{i}");
                    let t = Instant::now();
                    let mut tx = db.begin().await?;
                    match (release, v6) {
                        (true, false) => drop(vmnet_ipam::release(&mut tx, &id).await?),
                        (true, true) => drop(vmnet_ipam::release6(&mut tx, &id).await?),
                        (false, false) => drop(vmnet_ipam::lease(&mut tx, &pool, &id).await?),
                        (false, true) => drop(vmnet_ipam::lease6(&mut tx, &pool, &id).await?),
                    }
                    tx.commit().await?;
                    lat.push(t.elapsed());
                }
                Ok::<_, IpamError>(lat)
            }));
        }
        tasks
    };
    let start = Instant::now();
    let mut lease = Vec::new();
    for t in run(false) {
        lease.extend(t.await.map_err(bench_err)??);
    }
    #[allow(clippy::cast_precision_loss)]
    let rate = (placers * per) as f64 / start.elapsed().as_secs_f64();
    let mut release = Vec::new();
    for t in run(true) {
        release.extend(t.await.map_err(bench_err)??);
    }
    Ok((lease, release, rate))
}

async fn store_rows(
    db: &Db,
    name: &str,
    ops: usize,
    placers: Option<usize>,
    rows: &mut Vec<Row>,
) -> Result<(), BenchError> {
    for (k, fill) in [0u32, 50, 99].into_iter().enumerate() {
        let octet = u8::try_from(k).map_err(bench_err)?;
        let pool = format!("fill{fill}");
        let free = prepare(db, &pool, octet, fill).await?;
        let (lease, release, rate) = single(db, &pool, ops.min(free), false).await?;
        let (lease6, release6, rate6) = single(db, &pool, ops.min(free), true).await?;
        rows.push(Row {
            store: name.to_owned(),
            fill,
            lease,
            release,
            leases_per_s: rate,
            lease6,
            release6,
            leases6_per_s: rate6,
        });
    }
    if let Some(placers) = placers {
        for (k, fill) in [0u32, 50, 99].into_iter().enumerate() {
            let octet = u8::try_from(k + 3).map_err(bench_err)?;
            let pool = format!("conc{fill}");
            let free = prepare(db, &pool, octet, fill).await?;
            let per = ops.min(free) / placers;
            let (lease, release, rate) = concurrent(db, &pool, placers, per, false).await?;
            let (lease6, release6, rate6) = concurrent(db, &pool, placers, per, true).await?;
            rows.push(Row {
                store: format!("{name}, {placers} placers"),
                fill,
                lease,
                release,
                leases_per_s: rate,
                lease6,
                release6,
                leases6_per_s: rate6,
            });
        }
    }
    Ok(())
}

fn print_table(rows: &mut [Row]) {
    use vmnet_agent::table::{Align, render_aligned};
    let cells: Vec<Vec<String>> = rows
        .iter_mut()
        .map(|r| {
            r.lease.sort();
            r.release.sort();
            r.lease6.sort();
            r.release6.sort();
            vec![
                r.store.clone(),
                format!("{}%", r.fill),
                format!("{} ms", ms(pct(&r.lease, 0.5))),
                format!("{} ms", ms(pct(&r.lease, 0.99))),
                format!("{} ms", ms(pct(&r.release, 0.5))),
                format!("{} ms", ms(pct(&r.release, 0.99))),
                format!("{:.0}", r.leases_per_s),
                format!("{} ms", ms(pct(&r.lease6, 0.5))),
                format!("{} ms", ms(pct(&r.lease6, 0.99))),
                format!("{} ms", ms(pct(&r.release6, 0.5))),
                format!("{:.0}", r.leases6_per_s),
            ]
        })
        .collect();
    let mut align = vec![Align::Left];
    align.extend([Align::Right; 10]);
    print!(
        "{}",
        render_aligned(
            &[
                "store",
                "full",
                "lease p50",
                "lease p99",
                "release p50",
                "release p99",
                "leases/s",
                "IPv6 lease p50",
                "IPv6 lease p99",
                "IPv6 release p50",
                "IPv6 leases/s"
            ],
            &align,
            &cells
        )
    );
}

fn check_targets(rows: &[Row]) {
    let stores: Vec<&str> = rows
        .iter()
        .filter(|r| r.fill == 0)
        .map(|r| r.store.as_str())
        .collect();
    for s in stores {
        for (family, v6) in [("", false), (" IPv6", true)] {
            let p50 = |fill| {
                rows.iter()
                    .find(|r| r.store == s && r.fill == fill)
                    .map(|r| pct(if v6 { &r.lease6 } else { &r.lease }, 0.5))
            };
            if let (Some(empty), Some(full)) = (p50(0), p50(99)) {
                let ratio = full.as_secs_f64() / empty.as_secs_f64().max(1e-9);
                let verdict = if ratio <= 3.0 { "ok" } else { "MISSED" };
                println!(
                    "target {s}:{family} 99%-full lease p50 / empty lease p50 = {ratio:.2} (at most 3): {verdict}"
                );
            }
        }
    }
    if let Some(r) = rows.iter().find(|r| r.store == "sqlite" && r.fill == 0) {
        let verdict = if r.leases_per_s >= 2000.0 {
            "ok"
        } else {
            "MISSED"
        };
        println!(
            "target sqlite: {:.0} durable leases/s from one writer (at least 2000): {verdict}",
            r.leases_per_s
        );
    }
}

/// Runs the command.
///
/// # Errors
/// `UNAVAILABLE` when a database cannot be opened or the PostgreSQL cluster cannot start.
pub async fn run(args: IpamBenchArgs) -> Result<(), BenchError> {
    let mut rows = Vec::new();
    println!(
        "durability: SQLite WAL + synchronous=FULL; PostgreSQL fsync=on, synchronous_commit=on"
    );
    println!(
        "pools: /16 (65,533 leasable addresses) and as many IPv6 addresses at the top of a /64; up \
         to {} lease + {} release transactions per family and row (at most the free addresses: \
         655 at 99 %)",
        args.ops, args.ops
    );
    let (dir, remove) = match &args.dir {
        Some(d) => (d.clone(), false),
        None => (
            std::env::temp_dir().join(format!("vmnet-bench-{}", std::process::id())),
            true,
        ),
    };
    let file = dir.join("bench.db");
    for f in ["bench.db", "bench.db-wal", "bench.db-shm"] {
        let _ = std::fs::remove_file(dir.join(f));
    }
    let sqlite = Db::connect(&format!("sqlite://{}", file.display())).await?;
    let result = store_rows(&sqlite, "sqlite", args.ops, None, &mut rows).await;
    sqlite.close().await;
    if remove {
        let _ = std::fs::remove_dir_all(&dir);
    }
    result?;
    if !args.skip_postgres {
        let mut cluster = None;
        let url = match &args.postgres_url {
            Some(u) => u.clone(),
            None => {
                let c =
                    tokio::task::spawn_blocking(|| PgCluster::start(PgOptions { durable: true }))
                        .await
                        .map_err(bench_err)?
                        .map_err(|e| {
                            BenchError::from(Error::unavailable(format!(
                                "cannot start PostgreSQL: {e:#}"
                            )))
                        })?;
                let u = c.fresh_database_url().map_err(bench_err)?;
                cluster = Some(c);
                u
            }
        };
        let pg = Db::connect_with(
            &url,
            Some(u32::try_from(args.placers + 2).map_err(bench_err)?),
        )
        .await?;
        let result = store_rows(&pg, "postgres", args.ops, Some(args.placers), &mut rows).await;
        pg.close().await;
        drop(cluster);
        result?;
    }
    print_table(&mut rows);
    check_targets(&rows);
    Ok(())
}
