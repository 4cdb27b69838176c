//! The IPv4 free-address index: per pool and range, the free addresses as disjoint intervals
//! `ip_free(pool_id, range_seq, first, last)` (integers), so the lowest free address of the
//! first range with room is one index seek on `(pool_id, range_seq, first)`.
//!
//! Invariant: the intervals of a range are exactly `first_host..=last_host` minus the gateway
//! minus the leased addresses. Writing a range rebuilds its intervals; a lease shrinks the lowest
//! one; a release inserts the address back, merged with its neighbours of the same range.
//! The IPv6 index is [`crate::free6`].

use crate::error::IpamError;
use sqlx::QueryBuilder;

use crate::db::{Tx, db_err, on_tx};

/// Rows per multi-row INSERT when rebuilding.
const CHUNK: usize = 1000;

/// The leasable bounds of one IPv4 range as integers, with its position in the pool's list.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bounds {
    /// The range's position (`ip_free.range_seq`; 0 for the first range).
    pub(crate) seq: i64,
    /// `first_host`.
    pub(crate) lo: i64,
    /// `last_host`.
    pub(crate) hi: i64,
    /// The gateway (never leased).
    pub(crate) gw: i64,
}

impl Bounds {
    /// Whether `n` is leasable in this range.
    pub(crate) fn leases(&self, n: i64) -> bool {
        (self.lo..=self.hi).contains(&n) && n != self.gw
    }
}

/// Drops the intervals of one range (it was removed, or is about to be rebuilt).
pub(crate) async fn clear(tx: &mut Tx, pool: &str, seq: i64) -> Result<(), IpamError> {
    on_tx!(tx, t => sqlx::query("DELETE FROM ip_free WHERE pool_id = $1 AND range_seq = $2")
        .bind(pool)
        .bind(seq)
        .execute(&mut **t)
        .await
        .map_err(db_err)?
        .rows_affected());
    Ok(())
}

/// Rebuilds the intervals of one range of `pool` from its bounds, its gateway and the current
/// leases.
pub(crate) async fn rebuild(tx: &mut Tx, pool: &str, b: Bounds) -> Result<(), IpamError> {
    let (lo, hi) = (b.lo, b.hi);
    on_tx!(tx, t => sqlx::query("DELETE FROM ip_free WHERE pool_id = $1 AND range_seq = $2")
        .bind(pool)
        .bind(b.seq)
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
    let gw = b.gw;
    if (lo..=hi).contains(&gw) {
        taken.push(gw);
    }
    taken.sort_unstable();
    taken.dedup();
    let intervals = gaps(lo, hi, &taken);
    for chunk in intervals.chunks(CHUNK) {
        on_tx!(tx, t => {
            let mut qb = QueryBuilder::new("INSERT INTO ip_free (pool_id, range_seq, first, last) ");
            qb.push_values(chunk, |mut q, (f, l)| {
                q.push_bind(pool).push_bind(b.seq).push_bind(*f).push_bind(*l);
            });
            qb.build().execute(&mut **t).await.map_err(db_err)?.rows_affected()
        });
    }
    Ok(())
}

/// The intervals of `lo..=hi` not in `taken` (sorted, deduplicated, all within `lo..=hi`).
pub(crate) fn gaps<T>(lo: T, hi: T, taken: &[T]) -> Vec<(T, T)>
where
    T: Copy + Ord + std::ops::Add<Output = T> + std::ops::Sub<Output = T> + From<u8>,
{
    let mut out = Vec::with_capacity(taken.len() + 1);
    let mut next = lo;
    let one = T::from(1);
    for &t in taken {
        if t > next {
            out.push((next, t - one));
        }
        // The last address of the family has no successor; nothing after it remains.
        if t == hi {
            return out;
        }
        next = t + one;
    }
    if next <= hi {
        out.push((next, hi));
    }
    out
}

/// Takes the lowest free address of the first range of `pool` with room out of the index and
/// returns it, or `None` when every range is exhausted. On PostgreSQL the interval row is locked first: the lowest one no other
/// placer holds (`FOR UPDATE SKIP LOCKED`), else the lowest one (`FOR UPDATE`, queueing behind
/// the holder and then taking the next address), so concurrent placers never fail on each other.
pub(crate) async fn take_lowest(tx: &mut Tx, pool: &str) -> Result<Option<i64>, IpamError> {
    let row: Option<(i64, i64)> = match tx {
        Tx::Sqlite(t) => {
            // Writers are serialized: shrink the lowest interval in one statement when it has
            // more than one address, else delete it (a one-address interval, or none left).
            let shrunk: Option<i64> = sqlx::query_scalar(
                "UPDATE ip_free SET first = first + 1 WHERE pool_id = $1 AND first = \
                 (SELECT first FROM ip_free WHERE pool_id = $1 ORDER BY range_seq, first LIMIT 1) \
                 AND first < last RETURNING first - 1",
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
                 (SELECT first FROM ip_free WHERE pool_id = $1 ORDER BY range_seq, first LIMIT 1) \
                 RETURNING first",
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
            let mut row = None;
            for _ in 0..LOCK_ROUNDS {
                let skip = sqlx::query_as(
                    "SELECT first, last FROM ip_free WHERE pool_id = $1 \
                     ORDER BY range_seq, first LIMIT 1 FOR UPDATE SKIP LOCKED",
                )
                .bind(pool)
                .fetch_optional(&mut **t)
                .await
                .map_err(db_err)?;
                row = match skip {
                    Some(r) => Some(r),
                    None => sqlx::query_as(
                        "SELECT first, last FROM ip_free WHERE pool_id = $1 \
                         ORDER BY range_seq, first LIMIT 1 FOR UPDATE",
                    )
                    .bind(pool)
                    .fetch_optional(&mut **t)
                    .await
                    .map_err(db_err)?,
                };
                // The queued-for interval may have been deleted by its holder (its last address
                // taken, or its range removed): look again while any interval is left.
                if row.is_some() || !any_left(t, "ip_free", pool).await? {
                    break;
                }
            }
            row
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

/// How often a PostgreSQL placer looks for an interval again after the one it queued for was
/// deleted under it.
pub(crate) const LOCK_ROUNDS: usize = 4;

/// Whether `table` (`ip_free` or `ip6_free`) still holds an interval of `pool`.
pub(crate) async fn any_left(
    t: &mut sqlx::Transaction<'static, sqlx::Postgres>,
    table: &'static str,
    pool: &str,
) -> Result<bool, IpamError> {
    let sql = sqlx::AssertSqlSafe(format!(
        "SELECT EXISTS (SELECT 1 FROM {table} WHERE pool_id = $1)"
    ));
    sqlx::query_scalar(sql)
        .bind(pool)
        .fetch_one(&mut **t)
        .await
        .map_err(db_err)
}

/// Puts `a` back into the index of range `seq` of `pool`, merged with the intervals of that range
/// just below and above it. The caller checked that `a` is leasable in that range and was leased.
pub(crate) async fn give_back(tx: &mut Tx, pool: &str, seq: i64, a: i64) -> Result<(), IpamError> {
    let lower: Option<i64> = on_tx!(tx, t => sqlx::query_scalar(
        "UPDATE ip_free SET last = $2 WHERE pool_id = $1 AND last = $3 AND range_seq = $4 RETURNING first")
        .bind(pool)
        .bind(a)
        .bind(a - 1)
        .bind(seq)
        .fetch_optional(&mut **t)
        .await
        .map_err(db_err)?);
    if let Some(lower_first) = lower {
        let upper: Option<i64> = on_tx!(tx, t => sqlx::query_scalar(
            "DELETE FROM ip_free WHERE pool_id = $1 AND first = $2 AND range_seq = $3 RETURNING last")
            .bind(pool)
            .bind(a + 1)
            .bind(seq)
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
    let grown = on_tx!(tx, t => sqlx::query("UPDATE ip_free SET first = $2 WHERE pool_id = $1 AND first = $3 AND range_seq = $4")
        .bind(pool)
        .bind(a)
        .bind(a + 1)
        .bind(seq)
        .execute(&mut **t)
        .await
        .map_err(db_err)?
        .rows_affected());
    if grown == 0 {
        on_tx!(tx, t => sqlx::query("INSERT INTO ip_free (pool_id, range_seq, first, last) VALUES ($1, $3, $2, $2)")
            .bind(pool)
            .bind(a)
            .bind(seq)
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
