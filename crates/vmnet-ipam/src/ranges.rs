//! Pool ranges: `set_ip_pool`, reading and listing them (spec: "Give a hosted pool a range").

use std::net::IpAddr;

use crate::error::IpamError;
use ipnet::Ipv4Net;
use sqlx::Row;
use vmnet_model::ids::validate_id;
use vmnet_model::pool::{IpRange, Pool, PoolKind, PoolRange, SetIpPool};

use crate::db::{Tx, db_err, on_tx};
use crate::free;
use crate::stored::{num, parse_stored};

/// Sets (or replaces) the range of `req.pool_id` and returns it with the defaults filled in.
/// Creates the pool if it does not exist. Existing leases are kept, even outside the new range;
/// the free-address index is rebuilt as the new range minus the gateway minus those leases.
///
/// The range must not clash with another pool's ([`IpRange::clash`]: overlapping `cidr`s, or a
/// gateway that the other pool leases). The check runs in the caller's transaction with every
/// other range write shut out until it ends: on PostgreSQL the `ip_pools` table is locked in
/// `SHARE ROW EXCLUSIVE` mode (which conflicts with itself and with row writes, but not with the
/// row share locks placements take), on SQLite writers are serialized anyway. So two concurrent
/// calls cannot both pass the check with clashing ranges.
///
/// # Errors
/// `INVALID_INPUT` naming the pool and the field (see [`SetIpPool::validate`]); `CONFLICT` for
/// a provider pool, and naming the other pool when the range clashes with its range, e.g.
/// `pool p2: cidr 10.0.0.0/16 overlaps cidr 10.0.0.0/24 of pool p1`; `UNAVAILABLE` on a
/// database failure. On error nothing was written.
pub async fn set_ip_pool(tx: &mut Tx, req: SetIpPool) -> Result<IpRange, IpamError> {
    let range = req.validate()?;
    lock_ranges(tx).await?;
    if let Some(p) = crate::providers::provider_of(tx, &range.pool_id).await? {
        return Err(IpamError::Conflict(format!(
            "pool {} is a provider pool ({}); it has no range and leases nothing",
            range.pool_id, p.provider
        )));
    }
    let mine = PoolRange::from(&range);
    let mut others: Vec<PoolRange> = other_ranges(tx, &range.pool_id)
        .await?
        .iter()
        .map(PoolRange::from)
        .collect();
    others.extend(crate::pool_ranges::added_ranges(tx).await?);
    for other in others {
        if let Some(why) = mine.clash(&other) {
            return Err(IpamError::Conflict(format!(
                "pool {}: {why}",
                range.pool_id
            )));
        }
    }
    ensure_pool(tx, &range.pool_id).await?;
    let dns: Vec<String> = range.dns.iter().map(ToString::to_string).collect();
    match tx {
        Tx::Sqlite(t) => {
            let dns = serde_json::to_string(&dns).map_err(|source| IpamError::Json {
                what: "dns".into(),
                source,
            })?;
            sqlx::query(
                "INSERT INTO ip_pools (pool_id, cidr, gateway, first_host, last_host, dns, \
                 first_host_num, last_host_num, gateway_num) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
                 ON CONFLICT (pool_id) DO UPDATE SET cidr = excluded.cidr, gateway = excluded.gateway, \
                 first_host = excluded.first_host, last_host = excluded.last_host, dns = excluded.dns, \
                 first_host_num = excluded.first_host_num, last_host_num = excluded.last_host_num, \
                 gateway_num = excluded.gateway_num",
            )
            .bind(&range.pool_id)
            .bind(range.cidr.to_string())
            .bind(range.gateway.to_string())
            .bind(range.first_host.to_string())
            .bind(range.last_host.to_string())
            .bind(dns)
            .bind(num(range.first_host))
            .bind(num(range.last_host))
            .bind(num(range.gateway))
            .execute(&mut **t)
            .await
            .map_err(db_err)?;
        }
        Tx::Postgres(t) => {
            sqlx::query(
                "INSERT INTO ip_pools (pool_id, cidr, gateway, first_host, last_host, dns) \
                 VALUES ($1, $2::cidr, $3::inet, $4::inet, $5::inet, $6::text[]::inet[]) \
                 ON CONFLICT (pool_id) DO UPDATE SET cidr = excluded.cidr, gateway = excluded.gateway, \
                 first_host = excluded.first_host, last_host = excluded.last_host, dns = excluded.dns",
            )
            .bind(&range.pool_id)
            .bind(range.cidr.to_string())
            .bind(range.gateway.to_string())
            .bind(range.first_host.to_string())
            .bind(range.last_host.to_string())
            .bind(&dns)
            .execute(&mut **t)
            .await
            .map_err(db_err)?;
        }
    }
    let (lo, hi, gw) = (
        num(range.first_host),
        num(range.last_host),
        num(range.gateway),
    );
    free::rebuild(tx, &range.pool_id, free::Bounds { seq: 0, lo, hi, gw }).await?;
    Ok(range)
}

/// Shuts out every other range write until the transaction ends (PostgreSQL; SQLite writers are
/// serialized by `BEGIN IMMEDIATE`).
pub(crate) async fn lock_ranges(tx: &mut Tx) -> Result<(), IpamError> {
    if let Tx::Postgres(t) = tx {
        sqlx::query("LOCK TABLE ip_pools IN SHARE ROW EXCLUSIVE MODE")
            .execute(&mut **t)
            .await
            .map_err(db_err)?;
    }
    Ok(())
}

/// The first IPv4 ranges of every pool but `pool_id`, without their DNS servers.
pub(crate) async fn other_ranges(tx: &mut Tx, pool_id: &str) -> Result<Vec<IpRange>, IpamError> {
    let sql = match tx {
        Tx::Sqlite(_) => {
            "SELECT pool_id, cidr, gateway, first_host, last_host FROM ip_pools WHERE pool_id <> $1"
        }
        Tx::Postgres(_) => {
            "SELECT pool_id, cidr::text, host(gateway), host(first_host), host(last_host) \
             FROM ip_pools WHERE pool_id <> $1"
        }
    };
    let rows: Vec<(String, String, String, String, String)> = on_tx!(tx, t => sqlx::query_as(sql)
        .bind(pool_id)
        .fetch_all(&mut **t)
        .await
        .map_err(db_err)?);
    rows.into_iter()
        .map(|(pool_id, cidr, gateway, first, last)| {
            Ok(IpRange {
                pool_id,
                cidr: parse_stored("cidr", &cidr)?,
                gateway: parse_stored("gateway", &gateway)?,
                first_host: parse_stored("first_host", &first)?,
                last_host: parse_stored("last_host", &last)?,
                dns: Vec::new(),
            })
        })
        .collect()
}

/// Creates the pool `pool_id` without a range if it does not exist (a pool without a range leases
/// nothing). Returns whether it was created.
///
/// # Errors
/// `INVALID_INPUT` for a bad id; `UNAVAILABLE` on a database failure.
pub async fn create_pool(tx: &mut Tx, pool_id: &str) -> Result<bool, IpamError> {
    validate_id("pool_id", pool_id)?;
    ensure_pool(tx, pool_id).await
}

pub(crate) async fn ensure_pool(tx: &mut Tx, pool_id: &str) -> Result<bool, IpamError> {
    let done = on_tx!(tx, t => sqlx::query("INSERT INTO pools (pool_id) VALUES ($1) ON CONFLICT (pool_id) DO NOTHING")
        .bind(pool_id)
        .execute(&mut **t)
        .await
        .map_err(db_err)?
        .rows_affected());
    Ok(done == 1)
}

/// Whether the pool exists.
pub(crate) async fn pool_exists(tx: &mut Tx, pool_id: &str) -> Result<bool, IpamError> {
    let row: Option<String> = on_tx!(tx, t => sqlx::query_scalar("SELECT pool_id FROM pools WHERE pool_id = $1")
        .bind(pool_id)
        .fetch_optional(&mut **t)
        .await
        .map_err(db_err)?);
    Ok(row.is_some())
}

/// `NOT_FOUND` unless the pool exists.
pub(crate) async fn require_pool(tx: &mut Tx, pool_id: &str) -> Result<(), IpamError> {
    if pool_exists(tx, pool_id).await? {
        Ok(())
    } else {
        Err(IpamError::not_found(format!("pool {pool_id}")))
    }
}

/// The first IPv4 range of a pool, `None` when the pool has none (or does not exist). With `lock`, on
/// PostgreSQL the range row is share-locked until the transaction ends, so a concurrent
/// `set_ip_pool` waits (and vice versa).
pub(crate) async fn range_of(
    tx: &mut Tx,
    pool_id: &str,
    lock: bool,
) -> Result<Option<IpRange>, IpamError> {
    let (cidr, gateway, first, last, dns): (String, String, String, String, Vec<String>) = match tx
    {
        Tx::Sqlite(t) => {
            let Some(r) = sqlx::query(
                "SELECT cidr, gateway, first_host, last_host, dns FROM ip_pools WHERE pool_id = $1",
            )
            .bind(pool_id)
            .fetch_optional(&mut **t)
            .await
            .map_err(db_err)?
            else {
                return Ok(None);
            };
            let dns: String = r.get("dns");
            let dns: Vec<String> =
                serde_json::from_str(&dns).map_err(|source| IpamError::Json {
                    what: format!("stored dns {dns:?}"),
                    source,
                })?;
            (
                r.get("cidr"),
                r.get("gateway"),
                r.get("first_host"),
                r.get("last_host"),
                dns,
            )
        }
        Tx::Postgres(t) => {
            let sql = if lock { PG_RANGE_LOCKED } else { PG_RANGE };
            let Some(r) = sqlx::query(sql)
                .bind(pool_id)
                .fetch_optional(&mut **t)
                .await
                .map_err(db_err)?
            else {
                return Ok(None);
            };
            (
                r.get("cidr"),
                r.get("gateway"),
                r.get("first_host"),
                r.get("last_host"),
                r.get("dns"),
            )
        }
    };
    let dns = dns
        .iter()
        .map(|s| parse_stored::<IpAddr>("dns", s))
        .collect::<Result<_, _>>()?;
    Ok(Some(IpRange {
        pool_id: pool_id.to_owned(),
        cidr: parse_stored::<Ipv4Net>("cidr", &cidr)?,
        gateway: parse_stored("gateway", &gateway)?,
        first_host: parse_stored("first_host", &first)?,
        last_host: parse_stored("last_host", &last)?,
        dns,
    }))
}

const PG_RANGE: &str = "SELECT cidr::text AS cidr, host(gateway) AS gateway, host(first_host) AS first_host, \
     host(last_host) AS last_host, \
     ARRAY(SELECT host(d) FROM unnest(dns) WITH ORDINALITY AS u(d, i) ORDER BY i) AS dns \
     FROM ip_pools WHERE pool_id = $1";
const PG_RANGE_LOCKED: &str = "SELECT cidr::text AS cidr, host(gateway) AS gateway, host(first_host) AS first_host, \
     host(last_host) AS last_host, \
     ARRAY(SELECT host(d) FROM unnest(dns) WITH ORDINALITY AS u(d, i) ORDER BY i) AS dns \
     FROM ip_pools WHERE pool_id = $1 FOR SHARE";

/// The range of a pool, or `None` for a pool without a range.
///
/// # Errors
/// `INVALID_INPUT` for a bad id; `NOT_FOUND` for an unknown pool; `UNAVAILABLE` on a database failure.
pub async fn get_ip_pool(tx: &mut Tx, pool_id: &str) -> Result<Option<IpRange>, IpamError> {
    validate_id("pool_id", pool_id)?;
    require_pool(tx, pool_id).await?;
    range_of(tx, pool_id, false).await
}

/// A pool with its kind, its range (or provider settings) and lease count.
///
/// # Errors
/// As [`get_ip_pool`].
pub async fn get_pool(tx: &mut Tx, pool_id: &str) -> Result<Pool, IpamError> {
    let range = get_ip_pool(tx, pool_id).await?;
    pool_of(tx, pool_id.to_owned(), range).await
}

/// The listed form of a pool: its kind and, for a provider pool, its settings.
async fn pool_of(tx: &mut Tx, pool_id: String, range: Option<IpRange>) -> Result<Pool, IpamError> {
    let provider = crate::providers::provider_of(tx, &pool_id).await?;
    let ranges = crate::pool_ranges::ranges_of(tx, &pool_id, None, false)
        .await?
        .into_iter()
        .map(|s| s.range)
        .collect();
    let leases = count_leases(tx, "ip_leases", &pool_id).await?;
    let leases_ipv6 = count_leases(tx, "ip6_leases", &pool_id).await?;
    Ok(Pool {
        kind: if provider.is_some() {
            PoolKind::Provider
        } else {
            PoolKind::Hosted
        },
        pool_id,
        range,
        ranges,
        leases,
        leases_ipv6,
        provider,
    })
}

async fn count_leases(tx: &mut Tx, table: &'static str, pool_id: &str) -> Result<u64, IpamError> {
    let sql = sqlx::AssertSqlSafe(format!("SELECT COUNT(*) FROM {table} WHERE pool_id = $1"));
    let n: i64 = on_tx!(tx, t => sqlx::query_scalar(sql)
        .bind(pool_id)
        .fetch_one(&mut **t)
        .await
        .map_err(db_err)?);
    u64::try_from(n).map_err(|_| IpamError::Corrupt("negative count".into()))
}

/// Every pool, ordered by id, with its range and lease count.
///
/// # Errors
/// `UNAVAILABLE` on a database failure.
pub async fn list_pools(tx: &mut Tx) -> Result<Vec<Pool>, IpamError> {
    let ids: Vec<String> = on_tx!(tx, t => sqlx::query_scalar("SELECT pool_id FROM pools ORDER BY pool_id")
        .fetch_all(&mut **t)
        .await
        .map_err(db_err)?);
    let mut out = Vec::with_capacity(ids.len());
    for id in ids {
        let range = range_of(tx, &id, false).await?;
        out.push(pool_of(tx, id, range).await?);
    }
    Ok(out)
}
