//! IPv6 leases: the lowest free address of the first IPv6 range of a pool with room for an
//! instance, and returning it (issue 48). At most one per instance (`ip6_leases.instance_id` is
//! unique), beside its IPv4 lease ([`crate::leases`]); a placement takes both in its
//! transaction, and deleting the instance or losing its host returns both.

use std::net::{IpAddr, Ipv6Addr};

use vmnet_model::ids::validate_id;
use vmnet_model::pool::{Family, Lease};

use crate::db::{Tx, db_err, on_tx, release_savepoint, rollback_to, savepoint};
use crate::error::IpamError;
use crate::free6;
use crate::leases::{LEASE_ATTEMPTS, held_elsewhere};
use crate::pool_ranges::{Stored, ranges_of};
use crate::ranges::require_pool;
use crate::stored::{bytes6, parse_stored};

/// The `CAPACITY_UNAVAILABLE` error of a pool whose IPv6 ranges are exhausted.
pub(crate) fn exhausted6(pool_id: &str) -> IpamError {
    IpamError::Exhausted(format!("Pool {pool_id} has no free IPv6 address"))
}

/// Leases the lowest free address of `pool_id`'s first IPv6 range with room (then the next
/// IPv6 range) to `instance_id`, in the caller's transaction. As [`crate::lease`] for IPv4: the
/// same address again for an instance holding one in this pool, `Ok(None)` for a pool without
/// IPv6 ranges, and a conflicting insert retried on the next free address.
///
/// # Errors
/// `INVALID_INPUT` for a bad id; `NOT_FOUND` for an unknown pool; `CONFLICT` when the instance
/// holds an IPv6 lease in another pool; `CAPACITY_UNAVAILABLE` `Pool <id> has no free IPv6
/// address` when every IPv6 range is exhausted; `UNAVAILABLE` on a database failure or after 8
/// conflicting attempts.
pub async fn lease6(
    tx: &mut Tx,
    pool_id: &str,
    instance_id: &str,
) -> Result<Option<Ipv6Addr>, IpamError> {
    validate_id("pool_id", pool_id)?;
    validate_id("instance_id", instance_id)?;
    if let Some(held) = held(tx, pool_id, instance_id).await? {
        return Ok(Some(held));
    }
    if ranges_of(tx, pool_id, Some(Family::Ipv6), true)
        .await?
        .is_empty()
    {
        require_pool(tx, pool_id).await?;
        return Ok(None);
    }
    let guarded = matches!(tx, Tx::Postgres(_));
    for _ in 0..LEASE_ATTEMPTS {
        let Some((_, n)) = free6::take_lowest6(tx, pool_id).await? else {
            return Err(exhausted6(pool_id));
        };
        let a = Ipv6Addr::from(n);
        if guarded {
            savepoint(tx, "vmnet_lease6").await?;
        }
        match insert(tx, pool_id, a, instance_id).await {
            Ok(()) => {
                if guarded {
                    release_savepoint(tx, "vmnet_lease6").await?;
                }
                return Ok(Some(a));
            }
            Err(sqlx::Error::Database(e)) if e.is_unique_violation() => {
                if guarded {
                    rollback_to(tx, "vmnet_lease6").await?;
                }
                if let Some(held) = held(tx, pool_id, instance_id).await? {
                    return Ok(Some(held));
                }
            }
            Err(e) => {
                if guarded {
                    rollback_to(tx, "vmnet_lease6").await?;
                }
                return Err(db_err(e));
            }
        }
    }
    Err(IpamError::Contended(format!(
        "pool {pool_id}: {LEASE_ATTEMPTS} IPv6 addresses in a row were taken by concurrent placements; try again"
    )))
}

/// The IPv6 address the instance holds in `pool_id`; `CONFLICT` when it holds one elsewhere.
async fn held(
    tx: &mut Tx,
    pool_id: &str,
    instance_id: &str,
) -> Result<Option<Ipv6Addr>, IpamError> {
    match lease6_of(tx, instance_id).await? {
        Some(l) if l.pool_id == pool_id => match l.address {
            IpAddr::V6(a) => Ok(Some(a)),
            IpAddr::V4(a) => Err(IpamError::Corrupt(format!(
                "IPv4 address {a} among IPv6 leases"
            ))),
        },
        Some(l) => Err(held_elsewhere(&l)),
        None => Ok(None),
    }
}

async fn insert(
    tx: &mut Tx,
    pool_id: &str,
    a: Ipv6Addr,
    instance_id: &str,
) -> Result<(), sqlx::Error> {
    match tx {
        Tx::Sqlite(t) => {
            sqlx::query(
                "INSERT INTO ip6_leases (pool_id, address, address_bytes, instance_id) \
                 VALUES ($1, $2, $3, $4)",
            )
            .bind(pool_id)
            .bind(a.to_string())
            .bind(bytes6(u128::from(a)))
            .bind(instance_id)
            .execute(&mut **t)
            .await?;
        }
        Tx::Postgres(t) => {
            sqlx::query(
                "INSERT INTO ip6_leases (pool_id, address, instance_id) VALUES ($1, $2::inet, $3)",
            )
            .bind(pool_id)
            .bind(a.to_string())
            .bind(instance_id)
            .execute(&mut **t)
            .await?;
        }
    }
    Ok(())
}

/// Returns the IPv6 lease of `instance_id` and gives the address back to the free addresses of
/// the pool's IPv6 range that leases it (unless none does any more). `Ok(None)` when the
/// instance holds no IPv6 lease.
///
/// # Errors
/// `INVALID_INPUT` for a bad id; `UNAVAILABLE` on a database failure.
pub async fn release6(tx: &mut Tx, instance_id: &str) -> Result<Option<Lease>, IpamError> {
    validate_id("instance_id", instance_id)?;
    let sql = match tx {
        Tx::Sqlite(_) => "DELETE FROM ip6_leases WHERE instance_id = $1 RETURNING pool_id, address",
        Tx::Postgres(_) => {
            "DELETE FROM ip6_leases WHERE instance_id = $1 RETURNING pool_id, host(address)"
        }
    };
    let row: Option<(String, String)> = on_tx!(tx, t => sqlx::query_as(sql).bind(instance_id).fetch_optional(&mut **t).await.map_err(db_err)?);
    let Some((pool_id, a)) = row else {
        return Ok(None);
    };
    let a: Ipv6Addr = parse_stored("IPv6 lease", &a)?;
    let n = u128::from(a);
    let ranges = ranges_of(tx, &pool_id, Some(Family::Ipv6), true).await?;
    if let Some(b) = ranges
        .iter()
        .filter_map(Stored::bounds6)
        .find(|b| b.leases(n))
    {
        free6::give_back6(tx, &pool_id, b.seq, n).await?;
    }
    Ok(Some(Lease {
        pool_id,
        address: IpAddr::V6(a),
        instance_id: instance_id.to_owned(),
    }))
}

/// The IPv6 lease an instance holds, if any.
///
/// # Errors
/// `INVALID_INPUT` for a bad id; `UNAVAILABLE` on a database failure.
pub async fn lease6_of(tx: &mut Tx, instance_id: &str) -> Result<Option<Lease>, IpamError> {
    validate_id("instance_id", instance_id)?;
    let sql = match tx {
        Tx::Sqlite(_) => "SELECT pool_id, address FROM ip6_leases WHERE instance_id = $1",
        Tx::Postgres(_) => "SELECT pool_id, host(address) FROM ip6_leases WHERE instance_id = $1",
    };
    let row: Option<(String, String)> = on_tx!(tx, t => sqlx::query_as(sql).bind(instance_id).fetch_optional(&mut **t).await.map_err(db_err)?);
    row.map(|(pool_id, a)| {
        Ok(Lease {
            pool_id,
            address: IpAddr::V6(parse_stored("IPv6 lease", &a)?),
            instance_id: instance_id.to_owned(),
        })
    })
    .transpose()
}

/// The IPv6 leases of a pool ordered by address (the caller checked the pool).
pub(crate) async fn list_leases6(tx: &mut Tx, pool_id: &str) -> Result<Vec<Lease>, IpamError> {
    let sql = match tx {
        Tx::Sqlite(_) => {
            "SELECT address, instance_id FROM ip6_leases WHERE pool_id = $1 ORDER BY address_bytes"
        }
        Tx::Postgres(_) => {
            "SELECT host(address), instance_id FROM ip6_leases WHERE pool_id = $1 ORDER BY address"
        }
    };
    let rows: Vec<(String, String)> = on_tx!(tx, t => sqlx::query_as(sql).bind(pool_id).fetch_all(&mut **t).await.map_err(db_err)?);
    rows.into_iter()
        .map(|(a, instance_id)| {
            Ok(Lease {
                pool_id: pool_id.to_owned(),
                address: IpAddr::V6(parse_stored("IPv6 lease", &a)?),
                instance_id,
            })
        })
        .collect()
}

/// Inserts IPv6 leases for `addresses` of `pool_id` in bulk (instance ids `<prefix><n>`) and
/// rebuilds the free index of the pool's IPv6 ranges. For benchmarks and tests that need a full
/// range fast; the addresses are not checked against the ranges.
///
/// # Errors
/// `NOT_FOUND` for an unknown pool; `UNAVAILABLE` on a database failure (including an address
/// already leased).
pub async fn bulk_insert_leases6(
    tx: &mut Tx,
    pool_id: &str,
    addresses: &[Ipv6Addr],
    prefix: &str,
) -> Result<(), IpamError> {
    require_pool(tx, pool_id).await?;
    for (c, chunk) in addresses.chunks(1000).enumerate() {
        let base = c * 1000;
        match tx {
            Tx::Sqlite(t) => {
                let mut qb = sqlx::QueryBuilder::new(
                    "INSERT INTO ip6_leases (pool_id, address, address_bytes, instance_id) ",
                );
                qb.push_values(chunk.iter().enumerate(), |mut b, (i, a)| {
                    b.push_bind(pool_id)
                        .push_bind(a.to_string())
                        .push_bind(bytes6(u128::from(*a)))
                        .push_bind(format!("{prefix}{}", base + i));
                });
                qb.build().execute(&mut **t).await.map_err(db_err)?;
            }
            Tx::Postgres(t) => {
                let mut qb = sqlx::QueryBuilder::new(
                    "INSERT INTO ip6_leases (pool_id, address, instance_id) ",
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
    let ranges = ranges_of(tx, pool_id, Some(Family::Ipv6), true).await?;
    for b in ranges.iter().filter_map(Stored::bounds6) {
        free6::rebuild6(tx, pool_id, b).await?;
    }
    Ok(())
}
