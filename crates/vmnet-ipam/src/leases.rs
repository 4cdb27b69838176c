//! IPv4 leases: the lowest free address of the first IPv4 range of a pool with room for an
//! instance, and returning it (spec: "How leases work"). IPv6 leases are [`crate::leases6`].

use std::net::{IpAddr, Ipv4Addr};

use crate::error::IpamError;
use vmnet_model::ids::validate_id;
use vmnet_model::pool::Lease;

use crate::db::{Tx, db_err, on_tx, release_savepoint, rollback_to, savepoint};
use crate::free;
use crate::pool_ranges::ranges_of;
use crate::ranges::require_pool;
use crate::stored::{addr, num, parse_stored};
use vmnet_model::pool::Family;

/// How many times a placement retries on the next free address after its insert hit an address
/// another transaction took (spec: "retry, up to 8 times").
pub const LEASE_ATTEMPTS: usize = 8;

/// Leases the lowest free IPv4 address of `pool_id`'s first IPv4 range with room (from
/// `first_host` to `last_host`, skipping the gateway; then the next IPv4 range) to
/// `instance_id`, in the caller's transaction.
///
/// * An instance holding a lease in this pool gets the same address back.
/// * A pool without an IPv4 range leases nothing: `Ok(None)`.
/// * A conflicting insert (the address was taken concurrently) is undone (inside a savepoint on
///   PostgreSQL; SQLite undoes just the failed statement) and retried on the next free address,
///   up to [`LEASE_ATTEMPTS`] times; the caller's transaction stays usable.
///
/// # Errors
/// `INVALID_INPUT` for a bad id; `NOT_FOUND` for an unknown pool; `CONFLICT` when the instance
/// holds a lease in another pool; `CAPACITY_UNAVAILABLE` `Pool <id> has no free IP address` when
/// the range is exhausted; `UNAVAILABLE` on a database failure or after 8 conflicting attempts.
pub async fn lease(
    tx: &mut Tx,
    pool_id: &str,
    instance_id: &str,
) -> Result<Option<Ipv4Addr>, IpamError> {
    validate_id("pool_id", pool_id)?;
    validate_id("instance_id", instance_id)?;
    let has_range = match tx {
        // One round trip: the instance's lease, if any, and whether the pool has a range.
        Tx::Sqlite(t) => {
            let (held_pool, held_addr, has_range): (Option<String>, Option<String>, bool) =
                sqlx::query_as(
                    "SELECT l.pool_id, l.address, p.pool_id IS NOT NULL FROM (SELECT 1) AS one \
                     LEFT JOIN ip_leases l ON l.instance_id = $2 \
                     LEFT JOIN ip_pools p ON p.pool_id = $1",
                )
                .bind(pool_id)
                .bind(instance_id)
                .fetch_one(&mut **t)
                .await
                .map_err(db_err)?;
            if let (Some(p), Some(a)) = (held_pool, held_addr) {
                let l = Lease {
                    pool_id: p,
                    address: IpAddr::V4(parse_stored("address", &a)?),
                    instance_id: instance_id.to_owned(),
                };
                return held_in(pool_id, &l).map(Some);
            }
            has_range
        }
        // The range rows are share-locked here (FOR SHARE cannot go on an outer join's
        // nullable side), so more round trips.
        Tx::Postgres(_) => {
            if let Some(held) = same_pool_lease(tx, pool_id, instance_id).await? {
                return Ok(Some(held));
            }
            !ranges_of(tx, pool_id, Some(Family::Ipv4), true)
                .await?
                .is_empty()
        }
    };
    if !has_range {
        require_pool(tx, pool_id).await?;
        return Ok(None);
    }
    // PostgreSQL: a failed statement aborts the whole transaction, so the insert runs in a
    // savepoint. SQLite: a failed statement undoes only itself (conflict resolution ABORT) and
    // the transaction stays usable, so no savepoint is needed (and writers are serialized, so a
    // conflict there only means the free index was out of step with the leases).
    let guarded = matches!(tx, Tx::Postgres(_));
    for _ in 0..LEASE_ATTEMPTS {
        let Some(n) = free::take_lowest(tx, pool_id).await? else {
            return Err(exhausted(pool_id));
        };
        if guarded {
            savepoint(tx, "vmnet_lease").await?;
        }
        match insert_lease(tx, pool_id, n, instance_id).await {
            Ok(()) => {
                if guarded {
                    release_savepoint(tx, "vmnet_lease").await?;
                }
                return Ok(Some(addr(n)?));
            }
            Err(sqlx::Error::Database(e)) if e.is_unique_violation() => {
                if guarded {
                    rollback_to(tx, "vmnet_lease").await?;
                }
                // Either the address was taken (try the next one) or this instance got a lease
                // in a concurrent transaction (return it).
                if let Some(held) = same_pool_lease(tx, pool_id, instance_id).await? {
                    return Ok(Some(held));
                }
            }
            Err(e) => {
                if guarded {
                    rollback_to(tx, "vmnet_lease").await?;
                }
                return Err(db_err(e));
            }
        }
    }
    Err(IpamError::Contended(format!(
        "pool {pool_id}: {LEASE_ATTEMPTS} addresses in a row were taken by concurrent placements; try again"
    )))
}

/// The `CAPACITY_UNAVAILABLE` error of an exhausted range.
pub(crate) fn exhausted(pool_id: &str) -> IpamError {
    IpamError::Exhausted(format!("Pool {pool_id} has no free IP address"))
}

async fn same_pool_lease(
    tx: &mut Tx,
    pool_id: &str,
    instance_id: &str,
) -> Result<Option<Ipv4Addr>, IpamError> {
    match lease_of(tx, instance_id).await? {
        Some(l) => held_in(pool_id, &l).map(Some),
        None => Ok(None),
    }
}

/// The address of an IPv4 lease the instance already holds: the same address when it is in
/// `pool_id`, `CONFLICT` when it is in another pool.
fn held_in(pool_id: &str, l: &Lease) -> Result<Ipv4Addr, IpamError> {
    match l.address {
        IpAddr::V4(a) if l.pool_id == pool_id => Ok(a),
        IpAddr::V6(a) => Err(IpamError::Corrupt(format!(
            "IPv6 address {a} among IPv4 leases"
        ))),
        IpAddr::V4(_) => Err(held_elsewhere(l)),
    }
}

/// The `CONFLICT` of an instance that holds a lease in another pool.
pub(crate) fn held_elsewhere(l: &Lease) -> IpamError {
    IpamError::Conflict(format!(
        "instance {} already holds lease {} in pool {}",
        l.instance_id, l.address, l.pool_id
    ))
}

async fn insert_lease(
    tx: &mut Tx,
    pool_id: &str,
    n: i64,
    instance_id: &str,
) -> Result<(), sqlx::Error> {
    match tx {
        Tx::Sqlite(t) => {
            sqlx::query(
                "INSERT INTO ip_leases (pool_id, address, address_num, instance_id) VALUES ($1, $2, $3, $4)",
            )
            .bind(pool_id)
            .bind(addr(n).map_err(|e| sqlx::Error::Protocol(e.to_string()))?.to_string())
            .bind(n)
            .bind(instance_id)
            .execute(&mut **t)
            .await?;
        }
        Tx::Postgres(t) => {
            sqlx::query(
                "INSERT INTO ip_leases (pool_id, address, instance_id) VALUES ($1, '0.0.0.0'::inet + $2::bigint, $3)",
            )
            .bind(pool_id)
            .bind(n)
            .bind(instance_id)
            .execute(&mut **t)
            .await?;
        }
    }
    Ok(())
}

/// Returns the IPv4 lease of `instance_id` and gives the address back to the free addresses of
/// the pool's IPv4 range that leases it (unless no current range does: it lies outside every
/// range after a replacement, or is a gateway). `Ok(None)` when the instance holds no IPv4 lease.
/// [`crate::release6`] returns the IPv6 lease; deleting an instance returns both.
///
/// # Errors
/// `INVALID_INPUT` for a bad id; `UNAVAILABLE` on a database failure.
pub async fn release(tx: &mut Tx, instance_id: &str) -> Result<Option<Lease>, IpamError> {
    validate_id("instance_id", instance_id)?;
    let sql = match tx {
        Tx::Sqlite(_) => {
            "DELETE FROM ip_leases WHERE instance_id = $1 RETURNING pool_id, address_num"
        }
        Tx::Postgres(_) => {
            "DELETE FROM ip_leases WHERE instance_id = $1 RETURNING pool_id, address - '0.0.0.0'::inet"
        }
    };
    let row: Option<(String, i64)> = on_tx!(tx, t => sqlx::query_as(sql).bind(instance_id).fetch_optional(&mut **t).await.map_err(db_err)?);
    let Some((pool_id, n)) = row else {
        return Ok(None);
    };
    let address = addr(n)?;
    let ranges = ranges_of(tx, &pool_id, Some(Family::Ipv4), true).await?;
    if let Some(b) = ranges
        .iter()
        .filter_map(crate::pool_ranges::Stored::bounds)
        .find(|b| b.leases(n))
    {
        free::give_back(tx, &pool_id, b.seq, n).await?;
    }
    Ok(Some(Lease {
        pool_id,
        address: IpAddr::V4(address),
        instance_id: instance_id.to_owned(),
    }))
}

/// The IPv4 lease an instance holds, if any.
///
/// # Errors
/// `INVALID_INPUT` for a bad id; `UNAVAILABLE` on a database failure.
pub async fn lease_of(tx: &mut Tx, instance_id: &str) -> Result<Option<Lease>, IpamError> {
    validate_id("instance_id", instance_id)?;
    let sql = match tx {
        Tx::Sqlite(_) => "SELECT pool_id, address FROM ip_leases WHERE instance_id = $1",
        Tx::Postgres(_) => {
            "SELECT pool_id, host(address) AS address FROM ip_leases WHERE instance_id = $1"
        }
    };
    let row: Option<(String, String)> = on_tx!(tx, t => sqlx::query_as(sql).bind(instance_id).fetch_optional(&mut **t).await.map_err(db_err)?);
    let Some((pool_id, a)) = row else {
        return Ok(None);
    };
    Ok(Some(Lease {
        pool_id,
        address: IpAddr::V4(parse_stored("address", &a)?),
        instance_id: instance_id.to_owned(),
    }))
}

/// The leases of a pool: the IPv4 leases ordered by address, then the IPv6 leases ordered by
/// address.
///
/// # Errors
/// `INVALID_INPUT` for a bad id; `NOT_FOUND` for an unknown pool; `UNAVAILABLE` on a database failure.
pub async fn list_leases(tx: &mut Tx, pool_id: &str) -> Result<Vec<Lease>, IpamError> {
    validate_id("pool_id", pool_id)?;
    require_pool(tx, pool_id).await?;
    let sql = match tx {
        Tx::Sqlite(_) => {
            "SELECT address, instance_id FROM ip_leases WHERE pool_id = $1 ORDER BY address_num"
        }
        Tx::Postgres(_) => {
            "SELECT host(l.address) AS address, l.instance_id FROM ip_leases l WHERE l.pool_id = $1 ORDER BY l.address"
        }
    };
    let rows: Vec<(String, String)> = on_tx!(tx, t => sqlx::query_as(sql).bind(pool_id).fetch_all(&mut **t).await.map_err(db_err)?);
    let mut out: Vec<Lease> = rows
        .into_iter()
        .map(|(a, instance_id)| {
            Ok(Lease {
                pool_id: pool_id.to_owned(),
                address: IpAddr::V4(parse_stored("address", &a)?),
                instance_id,
            })
        })
        .collect::<Result<_, IpamError>>()?;
    out.extend(crate::leases6::list_leases6(tx, pool_id).await?);
    Ok(out)
}

/// Inserts leases for `addresses` of `pool_id` in bulk (instance ids `<prefix><n>`) and rebuilds
/// the pool's free-address index. For benchmarks and tests that need a full pool fast; the
/// addresses are not checked against the range.
///
/// # Errors
/// `NOT_FOUND` for an unknown pool; `UNAVAILABLE` on a database failure (including an address
/// already leased).
pub async fn bulk_insert_leases(
    tx: &mut Tx,
    pool_id: &str,
    addresses: &[Ipv4Addr],
    prefix: &str,
) -> Result<(), IpamError> {
    require_pool(tx, pool_id).await?;
    for (c, chunk) in addresses.chunks(1000).enumerate() {
        let base = c * 1000;
        match tx {
            Tx::Sqlite(t) => {
                let mut qb = sqlx::QueryBuilder::new(
                    "INSERT INTO ip_leases (pool_id, address, address_num, instance_id) ",
                );
                qb.push_values(chunk.iter().enumerate(), |mut b, (i, a)| {
                    b.push_bind(pool_id)
                        .push_bind(a.to_string())
                        .push_bind(num(*a))
                        .push_bind(format!("{prefix}{}", base + i));
                });
                qb.build().execute(&mut **t).await.map_err(db_err)?;
            }
            Tx::Postgres(t) => {
                let mut qb = sqlx::QueryBuilder::new(
                    "INSERT INTO ip_leases (pool_id, address, instance_id) ",
                );
                qb.push_values(chunk.iter().enumerate(), |mut b, (i, a)| {
                    b.push_bind(pool_id)
                        .push_bind(a.to_string())
                        .push_unseparated("::inet")
                        .push_bind(format!("{prefix}{}", base + i));
                });
                qb.build().execute(&mut **t).await.map_err(db_err)?;
            }
        }
    }
    let ranges = ranges_of(tx, pool_id, Some(Family::Ipv4), true).await?;
    for b in ranges.iter().filter_map(crate::pool_ranges::Stored::bounds) {
        free::rebuild(tx, pool_id, b).await?;
    }
    Ok(())
}
