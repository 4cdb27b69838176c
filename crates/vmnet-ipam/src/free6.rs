//! The IPv6 free-address index: per pool and range, the free addresses as disjoint intervals
//! `ip6_free(pool_id, range_seq, first, last)` of 16-byte big-endian values, which sort like the
//! addresses on both stores (SQLite compares BLOBs with `memcmp`, PostgreSQL compares `bytea`
//! bytewise). A /64 has 2^64 addresses, more than a 64-bit integer column holds, and a range is
//! never enumerated: a fresh range is one interval, each lease or release touches at most three
//! rows, and the lowest free address of the first range with room is one index seek on
//! `(pool_id, range_seq, first)`, whatever the size or fill of the range. The arithmetic (`+ 1`,
//! `- 1`) happens here, in `u128`, not in SQL.
//!
//! Invariant: the intervals of a range are exactly `first_host..=last_host` minus the gateway
//! minus the leased addresses (like [`crate::free`] for IPv4).

use std::net::Ipv6Addr;

use sqlx::QueryBuilder;

use crate::db::{Tx, db_err, on_tx};
use crate::error::IpamError;
use crate::free::{LOCK_ROUNDS, any_left, gaps};
use crate::stored::{bytes6, num6, parse_stored};

/// The leasable bounds of one IPv6 range as numbers, with its position in the pool's list.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bounds6 {
    /// The range's position (`ip6_free.range_seq`).
    pub(crate) seq: i64,
    /// `first_host`.
    pub(crate) lo: u128,
    /// `last_host`.
    pub(crate) hi: u128,
    /// The gateway (never leased).
    pub(crate) gw: u128,
}

impl Bounds6 {
    /// Whether `n` is leasable in this range.
    pub(crate) fn leases(&self, n: u128) -> bool {
        (self.lo..=self.hi).contains(&n) && n != self.gw
    }
}

/// Drops the intervals of one range.
pub(crate) async fn clear6(tx: &mut Tx, pool: &str, seq: i64) -> Result<(), IpamError> {
    on_tx!(tx, t => sqlx::query("DELETE FROM ip6_free WHERE pool_id = $1 AND range_seq = $2")
        .bind(pool)
        .bind(seq)
        .execute(&mut **t)
        .await
        .map_err(db_err)?
        .rows_affected());
    Ok(())
}

/// Rebuilds the intervals of one range of `pool` from its bounds, its gateway and the current
/// leases (those inside the range: one row each, never the range's addresses).
pub(crate) async fn rebuild6(tx: &mut Tx, pool: &str, b: Bounds6) -> Result<(), IpamError> {
    clear6(tx, pool, b.seq).await?;
    let mut taken: Vec<u128> = match tx {
        Tx::Sqlite(t) => {
            let rows: Vec<Vec<u8>> = sqlx::query_scalar(
                "SELECT address_bytes FROM ip6_leases WHERE pool_id = $1 \
                 AND address_bytes BETWEEN $2 AND $3",
            )
            .bind(pool)
            .bind(bytes6(b.lo))
            .bind(bytes6(b.hi))
            .fetch_all(&mut **t)
            .await
            .map_err(db_err)?;
            rows.iter().map(|r| num6(r)).collect::<Result<_, _>>()?
        }
        Tx::Postgres(t) => {
            let rows: Vec<String> = sqlx::query_scalar(
                "SELECT host(address) FROM ip6_leases WHERE pool_id = $1 \
                 AND address BETWEEN $2::inet AND $3::inet",
            )
            .bind(pool)
            .bind(Ipv6Addr::from(b.lo).to_string())
            .bind(Ipv6Addr::from(b.hi).to_string())
            .fetch_all(&mut **t)
            .await
            .map_err(db_err)?;
            rows.iter()
                .map(|r| parse_stored::<Ipv6Addr>("IPv6 lease", r).map(u128::from))
                .collect::<Result<_, _>>()?
        }
    };
    if (b.lo..=b.hi).contains(&b.gw) {
        taken.push(b.gw);
    }
    taken.sort_unstable();
    taken.dedup();
    let intervals = gaps(b.lo, b.hi, &taken);
    for chunk in intervals.chunks(1000) {
        on_tx!(tx, t => {
            let mut qb =
                QueryBuilder::new("INSERT INTO ip6_free (pool_id, range_seq, first, last) ");
            qb.push_values(chunk, |mut q, (f, l)| {
                q.push_bind(pool)
                    .push_bind(b.seq)
                    .push_bind(bytes6(*f))
                    .push_bind(bytes6(*l));
            });
            qb.build().execute(&mut **t).await.map_err(db_err)?.rows_affected()
        });
    }
    Ok(())
}

/// Takes the lowest free address of the first IPv6 range of `pool` with room out of the index:
/// `(range_seq, address)`, or `None` when every range is exhausted. Locking on PostgreSQL as in
/// [`crate::free::take_lowest`].
pub(crate) async fn take_lowest6(
    tx: &mut Tx,
    pool: &str,
) -> Result<Option<(i64, u128)>, IpamError> {
    const SKIP: &str = "SELECT range_seq, first, last FROM ip6_free WHERE pool_id = $1 \
                        ORDER BY range_seq, first LIMIT 1 FOR UPDATE SKIP LOCKED";
    const QUEUE: &str = "SELECT range_seq, first, last FROM ip6_free WHERE pool_id = $1 \
                         ORDER BY range_seq, first LIMIT 1 FOR UPDATE";
    let row: Option<(i64, Vec<u8>, Vec<u8>)> = match tx {
        // Writers are serialized: read the lowest interval, then shrink or delete it.
        Tx::Sqlite(t) => sqlx::query_as(
            "SELECT range_seq, first, last FROM ip6_free WHERE pool_id = $1 \
             ORDER BY range_seq, first LIMIT 1",
        )
        .bind(pool)
        .fetch_optional(&mut **t)
        .await
        .map_err(db_err)?,
        Tx::Postgres(t) => {
            let mut row = None;
            for _ in 0..LOCK_ROUNDS {
                row = match sqlx::query_as(SKIP)
                    .bind(pool)
                    .fetch_optional(&mut **t)
                    .await
                    .map_err(db_err)?
                {
                    Some(r) => Some(r),
                    None => sqlx::query_as(QUEUE)
                        .bind(pool)
                        .fetch_optional(&mut **t)
                        .await
                        .map_err(db_err)?,
                };
                if row.is_some() || !any_left(t, "ip6_free", pool).await? {
                    break;
                }
            }
            row
        }
    };
    let Some((seq, first, last)) = row else {
        return Ok(None);
    };
    let (first_n, last_n) = (num6(&first)?, num6(&last)?);
    if first_n == last_n {
        on_tx!(tx, t => sqlx::query("DELETE FROM ip6_free WHERE pool_id = $1 AND first = $2")
            .bind(pool)
            .bind(&first)
            .execute(&mut **t)
            .await
            .map_err(db_err)?
            .rows_affected());
    } else {
        on_tx!(tx, t => sqlx::query("UPDATE ip6_free SET first = $3 WHERE pool_id = $1 AND first = $2")
            .bind(pool)
            .bind(&first)
            .bind(bytes6(first_n + 1))
            .execute(&mut **t)
            .await
            .map_err(db_err)?
            .rows_affected());
    }
    Ok(Some((seq, first_n)))
}

/// Puts `a` back into the index of range `seq` of `pool`, merged with that range's intervals
/// just below and above it. The caller checked that `a` is leasable in that range and was
/// leased (so it is neither the lowest nor the highest 128-bit value: those are never usable).
pub(crate) async fn give_back6(
    tx: &mut Tx,
    pool: &str,
    seq: i64,
    a: u128,
) -> Result<(), IpamError> {
    let (below, here, above) = (
        bytes6(a.saturating_sub(1)),
        bytes6(a),
        bytes6(a.saturating_add(1)),
    );
    let lower: Option<Vec<u8>> = on_tx!(tx, t => sqlx::query_scalar(
        "UPDATE ip6_free SET last = $2 WHERE pool_id = $1 AND last = $3 AND range_seq = $4 \
         RETURNING first")
        .bind(pool)
        .bind(&here)
        .bind(&below)
        .bind(seq)
        .fetch_optional(&mut **t)
        .await
        .map_err(db_err)?);
    if let Some(lower_first) = lower {
        let upper: Option<Vec<u8>> = on_tx!(tx, t => sqlx::query_scalar(
            "DELETE FROM ip6_free WHERE pool_id = $1 AND first = $2 AND range_seq = $3 \
             RETURNING last")
            .bind(pool)
            .bind(&above)
            .bind(seq)
            .fetch_optional(&mut **t)
            .await
            .map_err(db_err)?);
        if let Some(upper_last) = upper {
            on_tx!(tx, t => sqlx::query("UPDATE ip6_free SET last = $3 WHERE pool_id = $1 AND first = $2")
                .bind(pool)
                .bind(&lower_first)
                .bind(&upper_last)
                .execute(&mut **t)
                .await
                .map_err(db_err)?
                .rows_affected());
        }
        return Ok(());
    }
    let grown = on_tx!(tx, t => sqlx::query(
        "UPDATE ip6_free SET first = $2 WHERE pool_id = $1 AND first = $3 AND range_seq = $4")
        .bind(pool)
        .bind(&here)
        .bind(&above)
        .bind(seq)
        .execute(&mut **t)
        .await
        .map_err(db_err)?
        .rows_affected());
    if grown == 0 {
        on_tx!(tx, t => sqlx::query(
            "INSERT INTO ip6_free (pool_id, range_seq, first, last) VALUES ($1, $2, $3, $3)")
            .bind(pool)
            .bind(seq)
            .bind(&here)
            .execute(&mut **t)
            .await
            .map_err(db_err)?
            .rows_affected());
    }
    Ok(())
}
