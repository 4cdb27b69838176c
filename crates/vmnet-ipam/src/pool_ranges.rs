//! A pool's ordered list of ranges: the first IPv4 range (`ip_pools`, position 0, set by
//! [`crate::set_ip_pool`]) and the ranges added after it (`ip_ranges`, positions 1, 2, …),
//! IPv4 and IPv6 ([`add_range`], [`remove_range`], [`list_ranges`]).
//!
//! Ranges of one family never overlap, in one pool or across pools, and no range's gateway is
//! another's leasable address ([`PoolRange::clash`]). Like `set_ip_pool`, a range write checks
//! that in its own transaction with every other range write shut out (PostgreSQL: the
//! `ip_pools` table in `SHARE ROW EXCLUSIVE` mode; SQLite serializes writers).
//!
//! Placements share-lock the range rows of the family they lease from (level 3 of
//! [`crate::locks`]), so removing a range waits for placements leasing from it, and then sees
//! their leases.

use std::net::IpAddr;

use ipnet::IpNet;
use vmnet_model::ids::validate_id;
use vmnet_model::pool::{AddRange, Family, PoolRange, addr_num};

use crate::db::{Tx, atomically, db_err, on_tx};
use crate::error::IpamError;
use crate::free::{self, Bounds};
use crate::free6::{self, Bounds6};
use crate::ranges::{ensure_pool, lock_ranges, range_of, require_pool};
use crate::stored::{bytes6, parse_stored};

/// A range with its position in the pool's list.
#[derive(Debug, Clone)]
pub(crate) struct Stored {
    /// The position: 0 for the first IPv4 range, then 1, 2, … in the order ranges were added.
    pub(crate) seq: i64,
    /// The range.
    pub(crate) range: PoolRange,
}

impl Stored {
    /// The IPv4 bounds (`None` for an IPv6 range).
    pub(crate) fn bounds(&self) -> Option<Bounds> {
        let (lo, hi, gw) = self.range.bounds();
        (self.range.family == Family::Ipv4).then(|| Bounds {
            seq: self.seq,
            lo: num_i64(lo),
            hi: num_i64(hi),
            gw: num_i64(gw),
        })
    }

    /// The IPv6 bounds (`None` for an IPv4 range).
    pub(crate) fn bounds6(&self) -> Option<Bounds6> {
        let (lo, hi, gw) = self.range.bounds();
        (self.range.family == Family::Ipv6).then_some(Bounds6 {
            seq: self.seq,
            lo,
            hi,
            gw,
        })
    }
}

/// An IPv4 address number as the integer `ip_free` stores (it always fits: 32 bits).
fn num_i64(n: u128) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The ranges of `pool_id` in order (of one family, or all), without the DNS servers. With
/// `lock`, on PostgreSQL the range rows are share-locked until the transaction ends.
pub(crate) async fn ranges_of(
    tx: &mut Tx,
    pool_id: &str,
    family: Option<Family>,
    lock: bool,
) -> Result<Vec<Stored>, IpamError> {
    let mut out = Vec::new();
    if family != Some(Family::Ipv6)
        && let Some(first) = range_of(tx, pool_id, lock).await?
    {
        out.push(Stored {
            seq: 0,
            range: PoolRange::from(&first),
        });
    }
    let fam: i16 = match family {
        None => 0,
        Some(Family::Ipv4) => 4,
        Some(Family::Ipv6) => 6,
    };
    let sql = match (&*tx, lock) {
        (Tx::Sqlite(_), _) => {
            "SELECT seq, cidr, gateway, first_host, last_host FROM ip_ranges \
             WHERE pool_id = $1 AND $2 IN (0, family) ORDER BY seq"
        }
        (Tx::Postgres(_), false) => {
            "SELECT seq, cidr::text, host(gateway), host(first_host), host(last_host) \
             FROM ip_ranges WHERE pool_id = $1 AND $2 IN (0, family) ORDER BY seq"
        }
        (Tx::Postgres(_), true) => {
            "SELECT seq, cidr::text, host(gateway), host(first_host), host(last_host) \
             FROM ip_ranges WHERE pool_id = $1 AND $2 IN (0, family) ORDER BY seq FOR SHARE"
        }
    };
    let rows: Vec<Row> = on_tx!(tx, t => sqlx::query_as(sql)
        .bind(pool_id)
        .bind(fam)
        .fetch_all(&mut **t)
        .await
        .map_err(db_err)?);
    for row in rows {
        out.push(stored(pool_id, row)?);
    }
    Ok(out)
}

type Row = (i64, String, String, String, String);

fn stored(pool_id: &str, (seq, cidr, gw, first, last): Row) -> Result<Stored, IpamError> {
    let cidr: IpNet = parse_stored("range cidr", &cidr)?;
    Ok(Stored {
        seq,
        range: PoolRange {
            pool_id: pool_id.to_owned(),
            family: match cidr {
                IpNet::V4(_) => Family::Ipv4,
                IpNet::V6(_) => Family::Ipv6,
            },
            cidr,
            gateway: parse_stored("range gateway", &gw)?,
            first_host: parse_stored("range first_host", &first)?,
            last_host: parse_stored("range last_host", &last)?,
        },
    })
}

/// Every added range (`ip_ranges`) of every pool.
pub(crate) async fn added_ranges(tx: &mut Tx) -> Result<Vec<PoolRange>, IpamError> {
    let sql = match tx {
        Tx::Sqlite(_) => {
            "SELECT pool_id, seq, cidr, gateway, first_host, last_host FROM ip_ranges \
             ORDER BY pool_id, seq"
        }
        Tx::Postgres(_) => {
            "SELECT pool_id, seq, cidr::text, host(gateway), host(first_host), host(last_host) \
             FROM ip_ranges ORDER BY pool_id, seq"
        }
    };
    let rows: Vec<(String, i64, String, String, String, String)> =
        on_tx!(tx, t => sqlx::query_as(sql).fetch_all(&mut **t).await.map_err(db_err)?);
    rows.into_iter()
        .map(|(p, seq, c, g, f, l)| stored(&p, (seq, c, g, f, l)).map(|s| s.range))
        .collect()
}

/// Every range of every pool: the first IPv4 ranges and the added ones.
async fn all_ranges(tx: &mut Tx) -> Result<Vec<PoolRange>, IpamError> {
    let mut out: Vec<PoolRange> = crate::ranges::other_ranges(tx, "")
        .await?
        .iter()
        .map(PoolRange::from)
        .collect();
    out.extend(added_ranges(tx).await?);
    Ok(out)
}

/// Appends a range to the pool's list and returns it with its defaults filled in: an IPv4 range
/// after the first one (which the pool must have: `set_ip_pool` sets it) and the IPv4 ranges
/// added before, or an IPv6 range after the IPv6 ranges added before. Creates the pool if it does
/// not exist (for an IPv6 range). Its free addresses are the range minus the gateway minus any
/// lease it already contains.
///
/// # Errors
/// `INVALID_INPUT` naming the pool and the field ([`AddRange::validate`]); `CONFLICT` for a
/// provider pool, for an IPv4 range in a pool without its first IPv4 range, and naming the other
/// pool (possibly this one) when the range clashes with a range, e.g.
/// `pool p2: cidr 2001:db8::/64 overlaps cidr 2001:db8::/56 of pool p1`; `UNAVAILABLE` on a
/// database failure. On error nothing was written.
pub async fn add_range(tx: &mut Tx, req: &AddRange) -> Result<PoolRange, IpamError> {
    let range = req.validate()?;
    atomically!(tx, "vmnet_add_range", add_inner(tx, range).await)
}

async fn add_inner(tx: &mut Tx, range: PoolRange) -> Result<PoolRange, IpamError> {
    let pool = range.pool_id.clone();
    lock_ranges(tx).await?;
    if let Some(p) = crate::providers::provider_of(tx, &pool).await? {
        return Err(IpamError::Conflict(format!(
            "pool {pool} is a provider pool ({}); it has no range and leases nothing",
            p.provider
        )));
    }
    if range.family == Family::Ipv4 && range_of(tx, &pool, false).await?.is_none() {
        return Err(IpamError::Conflict(format!(
            "pool {pool} has no first IPv4 range; set it (vmnet pool set, PUT /v1/pools/{pool}/range) \
             before adding IPv4 ranges after it"
        )));
    }
    for other in all_ranges(tx).await? {
        if let Some(why) = range.clash(&other) {
            return Err(IpamError::Conflict(format!("pool {pool}: {why}")));
        }
    }
    ensure_pool(tx, &pool).await?;
    let seq: i64 = on_tx!(tx, t => sqlx::query_scalar(
        "SELECT COALESCE(MAX(seq), 0) + 1 FROM ip_ranges WHERE pool_id = $1")
        .bind(&pool)
        .fetch_one(&mut **t)
        .await
        .map_err(db_err)?);
    let family: i16 = match range.family {
        Family::Ipv4 => 4,
        Family::Ipv6 => 6,
    };
    let sql = match tx {
        Tx::Sqlite(_) => {
            "INSERT INTO ip_ranges (pool_id, seq, family, cidr, gateway, first_host, last_host) \
             VALUES ($1, $2, $3, $4, $5, $6, $7)"
        }
        Tx::Postgres(_) => {
            "INSERT INTO ip_ranges (pool_id, seq, family, cidr, gateway, first_host, last_host) \
             VALUES ($1, $2, $3, $4::cidr, $5::inet, $6::inet, $7::inet)"
        }
    };
    on_tx!(tx, t => sqlx::query(sql)
        .bind(&pool)
        .bind(seq)
        .bind(family)
        .bind(range.cidr.to_string())
        .bind(range.gateway.to_string())
        .bind(range.first_host.to_string())
        .bind(range.last_host.to_string())
        .execute(&mut **t)
        .await
        .map_err(db_err)?
        .rows_affected());
    let s = Stored {
        seq,
        range: range.clone(),
    };
    if let Some(b) = s.bounds() {
        free::rebuild(tx, &pool, b).await?;
    }
    if let Some(b) = s.bounds6() {
        free6::rebuild6(tx, &pool, b).await?;
    }
    Ok(range)
}

/// Removes the added range `cidr` (as listed, e.g. `2001:db8::/64`) from the pool's list and
/// returns it. A range that holds leases stays: their instances would lose their addresses'
/// gateway and prefix.
///
/// # Errors
/// `INVALID_INPUT` for a bad id or a `cidr` that is not a CIDR; `NOT_FOUND` for an unknown pool,
/// or a pool without that range; `CONFLICT` for the first IPv4 range (`set_ip_pool` replaces
/// it) and for a range that holds leases, e.g. `pool p1: range 2001:db8::/64 holds 3 leases;
/// delete their instances first`; `UNAVAILABLE` on a database failure. On error nothing was
/// written.
pub async fn remove_range(tx: &mut Tx, pool_id: &str, cidr: &str) -> Result<PoolRange, IpamError> {
    validate_id("pool_id", pool_id)?;
    let Some(net) = vmnet_model::vm::parse_net(cidr) else {
        return Err(IpamError::invalid(format!(
            "pool {pool_id}: cidr {cidr:?} is not a CIDR such as 2001:db8::/64"
        )));
    };
    atomically!(
        tx,
        "vmnet_remove_range",
        remove_inner(tx, pool_id, net).await
    )
}

async fn remove_inner(tx: &mut Tx, pool_id: &str, net: IpNet) -> Result<PoolRange, IpamError> {
    require_pool(tx, pool_id).await?;
    lock_ranges(tx).await?;
    let list = ranges_of(tx, pool_id, None, false).await?;
    let Some(s) = list.into_iter().find(|s| s.range.cidr == net) else {
        return Err(IpamError::not_found(format!(
            "range {net} of pool {pool_id}"
        )));
    };
    if s.seq == 0 {
        return Err(IpamError::Conflict(format!(
            "pool {pool_id}: range {net} is the first IPv4 range; replace it with vmnet pool set \
             (PUT /v1/pools/{pool_id}/range) instead"
        )));
    }
    // The row first: on PostgreSQL the delete waits for placements that share-locked it, and the
    // count below then sees their leases.
    on_tx!(tx, t => sqlx::query("DELETE FROM ip_ranges WHERE pool_id = $1 AND seq = $2")
        .bind(pool_id)
        .bind(s.seq)
        .execute(&mut **t)
        .await
        .map_err(db_err)?
        .rows_affected());
    match s.range.family {
        Family::Ipv4 => free::clear(tx, pool_id, s.seq).await?,
        Family::Ipv6 => free6::clear6(tx, pool_id, s.seq).await?,
    }
    let held = leases_in(tx, pool_id, net).await?;
    if held > 0 {
        let what = if held == 1 { "lease" } else { "leases" };
        return Err(IpamError::Conflict(format!(
            "pool {pool_id}: range {net} holds {held} {what}; delete their instances first"
        )));
    }
    Ok(s.range)
}

/// How many leases of `pool_id` lie in `net`.
async fn leases_in(tx: &mut Tx, pool_id: &str, net: IpNet) -> Result<i64, IpamError> {
    let (lo, hi) = (
        addr_num(net.network()),
        addr_num(match net {
            IpNet::V4(n) => IpAddr::V4(n.broadcast()),
            IpNet::V6(n) => IpAddr::V6(n.broadcast()),
        }),
    );
    let n: i64 = match (tx, net) {
        (Tx::Postgres(t), IpNet::V4(_)) => sqlx::query_scalar(
            "SELECT COUNT(*) FROM ip_leases WHERE pool_id = $1 AND address <<= $2::cidr",
        )
        .bind(pool_id)
        .bind(net.to_string())
        .fetch_one(&mut **t)
        .await
        .map_err(db_err)?,
        (Tx::Postgres(t), IpNet::V6(_)) => sqlx::query_scalar(
            "SELECT COUNT(*) FROM ip6_leases WHERE pool_id = $1 AND address <<= $2::cidr",
        )
        .bind(pool_id)
        .bind(net.to_string())
        .fetch_one(&mut **t)
        .await
        .map_err(db_err)?,
        (Tx::Sqlite(t), IpNet::V4(_)) => sqlx::query_scalar(
            "SELECT COUNT(*) FROM ip_leases WHERE pool_id = $1 AND address_num BETWEEN $2 AND $3",
        )
        .bind(pool_id)
        .bind(num_i64(lo))
        .bind(num_i64(hi))
        .fetch_one(&mut **t)
        .await
        .map_err(db_err)?,
        (Tx::Sqlite(t), IpNet::V6(_)) => sqlx::query_scalar(
            "SELECT COUNT(*) FROM ip6_leases WHERE pool_id = $1 \
             AND address_bytes BETWEEN $2 AND $3",
        )
        .bind(pool_id)
        .bind(bytes6(lo))
        .bind(bytes6(hi))
        .fetch_one(&mut **t)
        .await
        .map_err(db_err)?,
    };
    Ok(n)
}

/// The pool's ranges in order: the first IPv4 range, then the added ones.
///
/// # Errors
/// `INVALID_INPUT` for a bad id; `NOT_FOUND` for an unknown pool; `UNAVAILABLE` on a database
/// failure.
pub async fn list_ranges(tx: &mut Tx, pool_id: &str) -> Result<Vec<PoolRange>, IpamError> {
    validate_id("pool_id", pool_id)?;
    require_pool(tx, pool_id).await?;
    Ok(ranges_of(tx, pool_id, None, false)
        .await?
        .into_iter()
        .map(|s| s.range)
        .collect())
}
