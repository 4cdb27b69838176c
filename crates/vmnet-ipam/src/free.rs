//! The free-address index: per pool, the free addresses of its range as disjoint intervals
//! `ip_free(pool_id, first, last)` (integers), so the lowest free address is one index seek.
//!
//! Invariant: the intervals of a pool are exactly `first_host..=last_host` minus the gateway minus
//! the leased addresses. `set_ip_pool` rebuilds them; a lease shrinks the lowest one; a release
//! inserts the address back, merged with its neighbours.

use crate::error::IpamError;
use sqlx::QueryBuilder;
use vmnet_model::pool::IpRange;

use crate::db::{Tx, db_err, on_tx};
use crate::stored::num;

/// Rows per multi-row INSERT when rebuilding.
const CHUNK: usize = 1000;

/// Rebuilds the intervals of `range.pool_id` from the range, the gateway and the current leases.
pub(crate) async fn rebuild(tx: &mut Tx, range: &IpRange) -> Result<(), IpamError> {
    let pool = range.pool_id.as_str();
    let (lo, hi) = (num(range.first_host), num(range.last_host));
    on_tx!(tx, t => sqlx::query("DELETE FROM ip_free WHERE pool_id = $1")
        .bind(pool)
        .execute(&mut **t)
        .await
        .map_err(db_err)?
        .rows_affected());
    let mut taken: Vec<i64> = match tx {
        Tx::Sqlite(t) => sqlx::query_scalar(
            "SELECT address_num FROM ip_leases WHERE pool_id = $1 AND address_num BETWEEN $2 AND $3",
        )
        .bind(pool)
        .bind(lo)
        .bind(hi)
        .fetch_all(&mut **t)
        .await
        .map_err(db_err)?,
        Tx::Postgres(t) => sqlx::query_scalar(
            "SELECT address - '0.0.0.0'::inet FROM ip_leases WHERE pool_id = $1 \
             AND address - '0.0.0.0'::inet BETWEEN $2 AND $3",
        )
        .bind(pool)
        .bind(lo)
        .bind(hi)
        .fetch_all(&mut **t)
        .await
        .map_err(db_err)?,
    };
    let gw = num(range.gateway);
    if (lo..=hi).contains(&gw) {
        taken.push(gw);
    }
    taken.sort_unstable();
    taken.dedup();
    let intervals = gaps(lo, hi, &taken);
    for chunk in intervals.chunks(CHUNK) {
        on_tx!(tx, t => {
            let mut qb = QueryBuilder::new("INSERT INTO ip_free (pool_id, first, last) ");
            qb.push_values(chunk, |mut b, (f, l)| {
                b.push_bind(pool).push_bind(*f).push_bind(*l);
            });
            qb.build().execute(&mut **t).await.map_err(db_err)?.rows_affected()
        });
    }
    Ok(())
}

/// The intervals of `lo..=hi` not in `taken` (sorted, deduplicated, all within `lo..=hi`).
fn gaps(lo: i64, hi: i64, taken: &[i64]) -> Vec<(i64, i64)> {
    let mut out = Vec::with_capacity(taken.len() + 1);
    let mut next = lo;
    for &t in taken {
        if t > next {
            out.push((next, t - 1));
        }
        next = t + 1;
    }
    if next <= hi {
        out.push((next, hi));
    }
    out
}

/// Takes the lowest free address of `pool` out of the index and returns it, or `None` when the
/// range is exhausted. On PostgreSQL the interval row is locked first: the lowest one no other
/// placer holds (`FOR UPDATE SKIP LOCKED`), else the lowest one (`FOR UPDATE`, queueing behind
/// the holder and then taking the next address), so concurrent placers never fail on each other.
pub(crate) async fn take_lowest(tx: &mut Tx, pool: &str) -> Result<Option<i64>, IpamError> {
    let row: Option<(i64, i64)> = match tx {
        Tx::Sqlite(t) => {
            // Writers are serialized: shrink the lowest interval in one statement when it has
            // more than one address, else delete it (a one-address interval, or none left).
            let shrunk: Option<i64> = sqlx::query_scalar(
                "UPDATE ip_free SET first = first + 1 WHERE pool_id = $1 AND first = \
                 (SELECT MIN(first) FROM ip_free WHERE pool_id = $1) AND first < last \
                 RETURNING first - 1",
            )
            .bind(pool)
            .fetch_optional(&mut **t)
            .await
            .map_err(db_err)?;
            if shrunk.is_some() {
                return Ok(shrunk);
            }
            return sqlx::query_scalar(
                "DELETE FROM ip_free WHERE pool_id = $1 AND first = \
                 (SELECT MIN(first) FROM ip_free WHERE pool_id = $1) RETURNING first",
            )
            .bind(pool)
            .fetch_optional(&mut **t)
            .await
            .map_err(db_err);
        }
        Tx::Postgres(t) => {
            // First the lowest interval no other placer holds (they work on different holes in
            // parallel); if every interval is held (typically the one big interval of a sparse
            // pool), queue for the lowest one.
            let skip = sqlx::query_as(
                "SELECT first, last FROM ip_free WHERE pool_id = $1 \
                 ORDER BY first LIMIT 1 FOR UPDATE SKIP LOCKED",
            )
            .bind(pool)
            .fetch_optional(&mut **t)
            .await
            .map_err(db_err)?;
            match skip {
                Some(r) => Some(r),
                None => sqlx::query_as(
                    "SELECT first, last FROM ip_free WHERE pool_id = $1 \
                     ORDER BY first LIMIT 1 FOR UPDATE",
                )
                .bind(pool)
                .fetch_optional(&mut **t)
                .await
                .map_err(db_err)?,
            }
        }
    };
    let Some((first, last)) = row else {
        return Ok(None);
    };
    let sql = if first == last {
        "DELETE FROM ip_free WHERE pool_id = $1 AND first = $2"
    } else {
        "UPDATE ip_free SET first = first + 1 WHERE pool_id = $1 AND first = $2"
    };
    on_tx!(tx, t => sqlx::query(sql).bind(pool).bind(first).execute(&mut **t).await.map_err(db_err)?.rows_affected());
    Ok(Some(first))
}

/// Puts `a` back into the index of `pool`, merged with the intervals just below and above it.
/// The caller checked that `a` is leasable in the current range and was leased.
pub(crate) async fn give_back(tx: &mut Tx, pool: &str, a: i64) -> Result<(), IpamError> {
    let lower: Option<i64> = on_tx!(tx, t => sqlx::query_scalar(
        "UPDATE ip_free SET last = $2 WHERE pool_id = $1 AND last = $3 RETURNING first")
        .bind(pool)
        .bind(a)
        .bind(a - 1)
        .fetch_optional(&mut **t)
        .await
        .map_err(db_err)?);
    if let Some(lower_first) = lower {
        let upper: Option<i64> = on_tx!(tx, t => sqlx::query_scalar(
            "DELETE FROM ip_free WHERE pool_id = $1 AND first = $2 RETURNING last")
            .bind(pool)
            .bind(a + 1)
            .fetch_optional(&mut **t)
            .await
            .map_err(db_err)?);
        if let Some(upper_last) = upper {
            on_tx!(tx, t => sqlx::query("UPDATE ip_free SET last = $3 WHERE pool_id = $1 AND first = $2")
                .bind(pool)
                .bind(lower_first)
                .bind(upper_last)
                .execute(&mut **t)
                .await
                .map_err(db_err)?
                .rows_affected());
        }
        return Ok(());
    }
    let grown = on_tx!(tx, t => sqlx::query("UPDATE ip_free SET first = $2 WHERE pool_id = $1 AND first = $3")
        .bind(pool)
        .bind(a)
        .bind(a + 1)
        .execute(&mut **t)
        .await
        .map_err(db_err)?
        .rows_affected());
    if grown == 0 {
        on_tx!(tx, t => sqlx::query("INSERT INTO ip_free (pool_id, first, last) VALUES ($1, $2, $2)")
            .bind(pool)
            .bind(a)
            .execute(&mut **t)
            .await
            .map_err(db_err)?
            .rows_affected());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::gaps;

    #[test]
    fn gaps_cover_everything_but_taken() {
        assert_eq!(gaps(2, 6, &[]), vec![(2, 6)]);
        assert_eq!(gaps(2, 6, &[2, 4, 6]), vec![(3, 3), (5, 5)]);
        assert_eq!(gaps(2, 6, &[2, 3, 4, 5, 6]), vec![]);
        assert_eq!(gaps(2, 6, &[6]), vec![(2, 5)]);
    }
}
