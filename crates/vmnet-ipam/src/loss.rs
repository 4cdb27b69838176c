//! Host loss (spec: "How leases work"): `lose_host` marks the host lost and returns each
//! affected instance's leases (both families) with its claim. Instances with `recreate_on_host_loss` are placed on
//! another ready host with a new lowest-free lease; when that fails they move to `error` with an
//! `Unschedulable` condition. The others move to `lost` with a `HostLost` condition. Either way
//! the addresses host status reports added to the instance are cleared (they came from the lost
//! machine; see [`crate::reports`]).
//!
//! Locks (see [`crate::locks`]): the lost host and every ready host first, in id order, then
//! the instances on the lost host in id order, then their leases in address order, and only
//! then the re-placements, whose host claims are already held. So a host loss never waits for a
//! host while holding a free interval, which is what deadlocked it against concurrent creates.

use crate::error::IpamError;
use serde::{Deserialize, Serialize};
use vmnet_model::ids::validate_id;
use vmnet_model::pool::{Condition, Instance, InstanceState};

use crate::addresses::clear_reported;
use crate::db::{Tx, atomically, db_err, on_tx, release_savepoint, rollback_to, savepoint};
use crate::instances::{instance_row, instance_sql};
use crate::leases::release;
use crate::leases6::release6;
use crate::locks::{lock_hosts_for_loss, lock_instances_on};
use crate::placement::{Want, get_host, get_instance, place};

/// What a host loss did: the affected instances as they are afterwards (ordered by id).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostLoss {
    /// The lost host.
    pub host_id: String,
    /// Every instance that was on it, after recreation (`running` elsewhere), `error`
    /// (`Unschedulable`) or `lost`.
    pub instances: Vec<Instance>,
}

/// Marks a host lost: every instance on it returns its lease with its claim; those with
/// `recreate_on_host_loss` are placed again on another host with a new lowest-free lease (or move
/// to `error` with an `Unschedulable` condition), the others move to `lost`.
///
/// # Errors
/// `INVALID_INPUT` for a bad id; `NOT_FOUND` for an unknown host; `UNAVAILABLE` on a database
/// failure (then nothing was changed).
pub async fn lose_host(tx: &mut Tx, host_id: &str) -> Result<HostLoss, IpamError> {
    validate_id("host_id", host_id)?;
    atomically!(tx, "vmnet_lose", lose_inner(tx, host_id).await)
}

async fn set_state(
    tx: &mut Tx,
    instance_id: &str,
    state: InstanceState,
    cond: &[Condition],
) -> Result<(), IpamError> {
    let cond = serde_json::to_string(cond).map_err(|source| IpamError::Json {
        what: "condition".into(),
        source,
    })?;
    on_tx!(tx, t => sqlx::query("UPDATE instances SET host_id = NULL, state = $2, conditions = $3 WHERE instance_id = $1")
        .bind(instance_id)
        .bind(state.as_str())
        .bind(&cond)
        .execute(&mut **t)
        .await
        .map_err(db_err)?.rows_affected());
    Ok(())
}

async fn lose_inner(tx: &mut Tx, host_id: &str) -> Result<HostLoss, IpamError> {
    lock_hosts_for_loss(tx, host_id).await?;
    get_host(tx, host_id).await?;
    on_tx!(tx, t => sqlx::query("UPDATE hosts SET state = 'lost', used_vcpus = 0, used_memory_mib = 0 WHERE host_id = $1")
        .bind(host_id)
        .execute(&mut **t)
        .await
        .map_err(db_err)?.rows_affected());
    lock_instances_on(tx, host_id).await?;
    let sql = instance_sql(tx, "WHERE i.host_id = $1 ORDER BY i.instance_id");
    let affected: Vec<Instance> = on_tx!(tx, t => sqlx::query(sql)
        .bind(host_id)
        .fetch_all(&mut **t)
        .await
        .map_err(db_err)?
        .iter()
        .map(instance_row)
        .collect::<Result<_, _>>()?);
    let lost = [Condition {
        kind: "HostLost".into(),
        message: format!("host {host_id} was lost"),
    }];
    // Leases in address order (free intervals are locked in ascending order).
    let mut by_address: Vec<&Instance> = affected.iter().filter(|i| i.address.is_some()).collect();
    by_address.sort_by_key(|i| (i.pool_id.as_str(), i.address));
    for inst in by_address {
        release(tx, &inst.instance_id).await?;
    }
    // Then the IPv6 leases, in address order too (IPv4 intervals before IPv6 ones).
    let mut by_address6: Vec<&Instance> =
        affected.iter().filter(|i| i.address6.is_some()).collect();
    by_address6.sort_by_key(|i| (i.pool_id.as_str(), i.address6));
    for inst in by_address6 {
        release6(tx, &inst.instance_id).await?;
    }
    for inst in &affected {
        set_state(tx, &inst.instance_id, InstanceState::Lost, &lost).await?;
        // After the row update, which (on PostgreSQL) waits for a concurrent status report
        // holding the row, so that report's addresses are cleared too.
        clear_reported(tx, &inst.instance_id).await?;
    }
    let mut out = Vec::with_capacity(affected.len());
    for inst in affected {
        if inst.recreate_on_host_loss {
            let want = Want {
                instance_id: &inst.instance_id,
                pool_id: &inst.pool_id,
                vcpus: inst.vcpus,
                memory_mib: inst.memory_mib,
            };
            savepoint(tx, "vmnet_replace").await?;
            match place(tx, &want, None).await {
                Ok(()) => release_savepoint(tx, "vmnet_replace").await?,
                Err(IpamError::Exhausted(message)) => {
                    rollback_to(tx, "vmnet_replace").await?;
                    let c = [Condition {
                        kind: "Unschedulable".into(),
                        message,
                    }];
                    set_state(tx, &inst.instance_id, InstanceState::Error, &c).await?;
                }
                Err(e) => {
                    rollback_to(tx, "vmnet_replace").await?;
                    return Err(e);
                }
            }
        }
        out.push(get_instance(tx, &inst.instance_id).await?);
    }
    Ok(HostLoss {
        host_id: host_id.to_owned(),
        instances: out,
    })
}
