//! The one order in which every transaction takes its row locks (PostgreSQL), and the helpers
//! that take them up front.
//!
//! # The order
//! 1. `hosts` rows, in ascending `host_id`;
//! 2. `instances` rows, in ascending `instance_id`;
//! 3. the `ip_pools` row of a pool, then its `ip_ranges` rows in list order (share locks;
//!    `set_ip_pool`, `add_range` and `remove_range` lock the `ip_pools` table against other range
//!    writes first, which placements' share locks do not wait for);
//! 4. `ip_free` intervals of that pool, then its `ip6_free` intervals, each in ascending address;
//! 5. `ip_leases`, `ip6_leases` and `instance_addresses` rows.
//!
//! A transaction may skip levels but never goes back to an earlier one. So:
//! * a placement (create, re-placement) claims its host, then leases IPv4 (ranges, then interval)
//!   and IPv6 (ranges, then interval); a lease's level-3 share locks come after the IPv4
//!   interval's for the IPv6 lease, and PostgreSQL's deadlock detection plus the retry cover that
//!   step back;
//! * `delete_instance` locks the instance's host, then the instance, then returns the claim
//!   before the lease ([`lock_placed_instance`]);
//! * `lose_host` locks the lost host and every ready host (the ones re-placement may claim) in
//!   id order before anything else, then the instances on the lost host in id order, and
//!   returns their IPv4 leases in address order, then their IPv6 leases in address order;
//! * a status report share-locks the reported instances in id order before it looks at them.
//!
//! A new instance row is the exception: `create_instance` inserts it before claiming a host. No
//! other transaction can see (and so lock) the row before it commits; one inserting the same id
//! waits for it while holding nothing else.
//!
//! Row locks are `FOR NO KEY UPDATE` (what an `UPDATE` of non-key columns takes), not
//! `FOR UPDATE`, so that foreign-key checks of concurrent inserts (`FOR KEY SHARE`) do not wait.
//! SQLite serializes writers (`BEGIN IMMEDIATE`), so every helper here is a no-op there.
//!
//! # Limitations
//! A host loss shuts out placements and deletes on every host until it commits (it holds every
//! ready host). Host losses are rare; correctness wins over their throughput.

use crate::error::IpamError;

use crate::db::{Tx, db_err};

/// Locks the rows of host `lost` and of every ready host, in id order (a host loss; see the
/// module docs).
pub(crate) async fn lock_hosts_for_loss(tx: &mut Tx, lost: &str) -> Result<(), IpamError> {
    if let Tx::Postgres(t) = tx {
        sqlx::query(
            "SELECT host_id FROM hosts WHERE host_id = $1 OR state = 'ready' \
             ORDER BY host_id FOR NO KEY UPDATE",
        )
        .bind(lost)
        .fetch_all(&mut **t)
        .await
        .map_err(db_err)?;
    }
    Ok(())
}

/// Locks the instances placed on `host_id`, in id order.
pub(crate) async fn lock_instances_on(tx: &mut Tx, host_id: &str) -> Result<(), IpamError> {
    if let Tx::Postgres(t) = tx {
        sqlx::query(
            "SELECT instance_id FROM instances WHERE host_id = $1 \
             ORDER BY instance_id FOR NO KEY UPDATE",
        )
        .bind(host_id)
        .fetch_all(&mut **t)
        .await
        .map_err(db_err)?;
    }
    Ok(())
}

/// Share-locks the instances with the given ids (those that exist), in id order.
pub(crate) async fn share_instances(tx: &mut Tx, ids: &[&str]) -> Result<(), IpamError> {
    if let Tx::Postgres(t) = tx {
        let mut ids: Vec<&str> = ids.to_vec();
        ids.sort_unstable();
        sqlx::query(
            "SELECT instance_id FROM instances WHERE instance_id = ANY($1) \
             ORDER BY instance_id FOR SHARE",
        )
        .bind(&ids)
        .fetch_all(&mut **t)
        .await
        .map_err(db_err)?;
    }
    Ok(())
}

/// How many times [`lock_placed_instance`] follows an instance that moved to another host
/// between reading its host and locking it.
const FOLLOW_MOVES: usize = 4;

/// Locks the host instance `instance_id` is placed on, then the instance, and returns its host
/// (`None`: placed nowhere). If a concurrent host loss moved the instance between the read and
/// the locks, the locks are given back (savepoint) and taken again for its new host.
///
/// # Errors
/// `NOT_FOUND` for an unknown instance; `UNAVAILABLE` when the instance kept moving or on a
/// database failure.
pub(crate) async fn lock_placed_instance(
    tx: &mut Tx,
    instance_id: &str,
) -> Result<Option<String>, IpamError> {
    let Tx::Postgres(_) = tx else {
        return host_of(tx, instance_id, false).await;
    };
    for _ in 0..FOLLOW_MOVES {
        crate::db::savepoint(tx, "vmnet_follow").await?;
        let seen = host_of(tx, instance_id, false).await?;
        if let (Some(h), Tx::Postgres(t)) = (&seen, &mut *tx) {
            sqlx::query("SELECT host_id FROM hosts WHERE host_id = $1 FOR NO KEY UPDATE")
                .bind(h)
                .fetch_optional(&mut **t)
                .await
                .map_err(db_err)?;
        }
        let now = host_of(tx, instance_id, true).await?;
        if now == seen {
            crate::db::release_savepoint(tx, "vmnet_follow").await?;
            return Ok(now);
        }
        crate::db::rollback_to(tx, "vmnet_follow").await?;
    }
    Err(IpamError::Contended(format!(
        "instance {instance_id} kept moving between hosts; try again"
    )))
}

/// The host of an instance (`NOT_FOUND` for an unknown one); with `lock`, the instance row is
/// locked (PostgreSQL).
async fn host_of(tx: &mut Tx, instance_id: &str, lock: bool) -> Result<Option<String>, IpamError> {
    let sql = match (&*tx, lock) {
        (Tx::Postgres(_), true) => {
            "SELECT host_id FROM instances WHERE instance_id = $1 FOR NO KEY UPDATE"
        }
        _ => "SELECT host_id FROM instances WHERE instance_id = $1",
    };
    let row: Option<(Option<String>,)> = crate::db::on_tx!(tx, t => sqlx::query_as(sql)
        .bind(instance_id)
        .fetch_optional(&mut **t)
        .await
        .map_err(db_err)?);
    row.map(|(h,)| h)
        .ok_or_else(|| IpamError::not_found(format!("instance {instance_id}")))
}
