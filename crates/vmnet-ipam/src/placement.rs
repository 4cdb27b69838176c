//! Placement, minimal but real: hosts with capacity, instances that claim it and take their lease
//! in the same transaction, and host loss (spec: "How leases work").
//!
//! * `create_instance` claims vCPUs and memory on a host and takes the lease; if either fails
//!   (no host with room, range exhausted) everything it wrote is undone and the caller gets the
//!   error (`CAPACITY_UNAVAILABLE`), host claims included.
//! * `delete_instance` returns the lease and the claim.
//! * `lose_host` ([`crate::loss`]) marks the host lost and re-places or loses its instances.
//! * Every placement (creation, re-placement after a host loss) gives the instance a new
//!   `allocation_id` ([`Instance::allocation_id`]); the network policy and the sandbox flag are
//!   the instance's own and survive re-placement unchanged.

use crate::error::IpamError;
use sqlx::Row;
use vmnet_model::ids::validate_id;
use vmnet_model::pool::{Host, HostState, Instance, NewInstance};

use crate::db::{Tx, atomically, db_err, on_tx};
pub use crate::instances::{get_instance, list_instances};
use crate::leases::{lease, release};
use crate::leases6::{lease6, release6};
use crate::locks::lock_placed_instance;
use crate::ranges::require_pool;

fn to_u32(field: &str, v: i64) -> Result<u32, IpamError> {
    u32::try_from(v).map_err(|_| IpamError::Corrupt(format!("stored {field} {v} is out of range")))
}

/// Adds a host with its capacity.
///
/// # Errors
/// `INVALID_INPUT` for a bad id or zero capacity; `CONFLICT` when the host exists;
/// `UNAVAILABLE` on a database failure.
pub async fn add_host(
    tx: &mut Tx,
    host_id: &str,
    vcpus: u32,
    memory_mib: u32,
) -> Result<Host, IpamError> {
    validate_id("host_id", host_id)?;
    if vcpus == 0 {
        return Err(IpamError::invalid(format!(
            "host {host_id}: vcpus must be at least 1"
        )));
    }
    if memory_mib == 0 {
        return Err(IpamError::invalid(format!(
            "host {host_id}: memory_mib must be at least 1"
        )));
    }
    let n = on_tx!(tx, t => sqlx::query(
        "INSERT INTO hosts (host_id, vcpus, memory_mib) VALUES ($1, $2, $3) ON CONFLICT (host_id) DO NOTHING")
        .bind(host_id)
        .bind(i64::from(vcpus))
        .bind(i64::from(memory_mib))
        .execute(&mut **t)
        .await
        .map_err(db_err)?
        .rows_affected());
    if n == 0 {
        return Err(IpamError::Conflict(format!(
            "host {host_id} already exists"
        )));
    }
    get_host(tx, host_id).await
}

const HOST_COLS: &str =
    "SELECT host_id, vcpus, memory_mib, used_vcpus, used_memory_mib, state FROM hosts";

fn host_row<R: Row>(r: &R) -> Result<Host, IpamError>
where
    for<'a> &'a str: sqlx::ColumnIndex<R>,
    for<'a> i64: sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
    for<'a> String: sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
{
    let state: String = r.try_get("state").map_err(db_err)?;
    Ok(Host {
        host_id: r.try_get("host_id").map_err(db_err)?,
        vcpus: to_u32("vcpus", r.try_get("vcpus").map_err(db_err)?)?,
        memory_mib: to_u32("memory_mib", r.try_get("memory_mib").map_err(db_err)?)?,
        used_vcpus: to_u32("used_vcpus", r.try_get("used_vcpus").map_err(db_err)?)?,
        used_memory_mib: to_u32(
            "used_memory_mib",
            r.try_get("used_memory_mib").map_err(db_err)?,
        )?,
        state: if state == "lost" {
            HostState::Lost
        } else {
            HostState::Ready
        },
    })
}

/// A host.
///
/// # Errors
/// `INVALID_INPUT` for a bad id; `NOT_FOUND` for an unknown host; `UNAVAILABLE` on a database failure.
pub async fn get_host(tx: &mut Tx, host_id: &str) -> Result<Host, IpamError> {
    validate_id("host_id", host_id)?;
    let sql = sqlx::AssertSqlSafe(format!("{HOST_COLS} WHERE host_id = $1"));
    let row = on_tx!(tx, t => match sqlx::query(sql).bind(host_id).fetch_optional(&mut **t).await.map_err(db_err)? {
        Some(r) => Some(host_row(&r)?),
        None => None,
    });
    row.ok_or_else(|| IpamError::not_found(format!("host {host_id}")))
}

/// Every host, ordered by id.
///
/// # Errors
/// `UNAVAILABLE` on a database failure.
pub async fn list_hosts(tx: &mut Tx) -> Result<Vec<Host>, IpamError> {
    let sql = sqlx::AssertSqlSafe(format!("{HOST_COLS} ORDER BY host_id"));
    on_tx!(tx, t => sqlx::query(sql).fetch_all(&mut **t).await.map_err(db_err)?.iter().map(host_row).collect())
}

/// Creates an instance: claims its vCPUs and memory on a host (the given one, or the first ready
/// host by id with room) and takes its lease, all in the caller's transaction. On any error
/// nothing is left written.
///
/// Idempotent: when the instance exists and the request describes it
/// ([`NewInstance::mismatch`]), as a retried create whose first reply was lost does, the
/// existing instance is returned as it is and nothing is written (no second claim or lease).
///
/// In a provider pool the instance is its machine ([`NewInstance::machine`], required there and
/// refused elsewhere): it is stored without a host, a claim or a lease (see
/// [`crate::providers`]).
///
/// # Errors
/// `INVALID_INPUT` naming the field (a missing, misfit or misplaced `machine`, a `host_id` in a
/// provider pool); `NOT_FOUND` for an unknown pool or host; `CONFLICT` for a machine another
/// instance of the pool is, or for an
/// existing instance the request does not describe, naming the first differing field
/// (`instance vm1 already exists with vcpus 1 (this request: 2)`); `CAPACITY_UNAVAILABLE` when
/// no host has room or `Pool <id> has no free IP address`; `UNAVAILABLE` on a database failure.
pub async fn create_instance(tx: &mut Tx, req: &NewInstance) -> Result<Instance, IpamError> {
    ensure_instance(tx, req).await.map(|o| o.instance)
}

/// What [`ensure_instance`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ensured {
    /// The instance, as created or as it already was.
    pub instance: Instance,
    /// Whether this call created it.
    pub created: bool,
}

/// Like [`create_instance`], and says whether the instance was created.
///
/// # Errors
/// As [`create_instance`].
pub async fn ensure_instance(tx: &mut Tx, req: &NewInstance) -> Result<Ensured, IpamError> {
    req.validate()?;
    atomically!(tx, "vmnet_create", create_inner(tx, req).await)
}

async fn create_inner(tx: &mut Tx, req: &NewInstance) -> Result<Ensured, IpamError> {
    require_pool(tx, &req.pool_id).await?;
    let provider = crate::providers::provider_of(tx, &req.pool_id).await?;
    let id = &req.instance_id;
    match (&provider, &req.machine) {
        (Some(p), Some(m)) => {
            m.validate(id, p.provider)?;
            if req.host_id.is_some() {
                return Err(IpamError::invalid(format!(
                    "instance {id}: host_id: an instance of provider pool {} is a machine at {}, not placed on a host",
                    req.pool_id, p.provider
                )));
            }
        }
        (Some(p), None) => {
            return Err(IpamError::invalid(format!(
                "instance {id}: machine is required for an instance of provider pool {} ({})",
                req.pool_id, p.provider
            )));
        }
        (None, Some(_)) => {
            return Err(IpamError::invalid(format!(
                "instance {id}: machine is only for instances of a provider pool; pool {} is hosted",
                req.pool_id
            )));
        }
        (None, None) => {}
    }
    if let Some(h) = &req.host_id {
        get_host(tx, h).await?;
    }
    let n = on_tx!(tx, t => sqlx::query(
        "INSERT INTO instances (instance_id, pool_id, vcpus, memory_mib, recreate_on_host_loss, \
         network_policy, sandbox, state) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, 'running') ON CONFLICT (instance_id) DO NOTHING")
        .bind(&req.instance_id)
        .bind(&req.pool_id)
        .bind(i64::from(req.vcpus))
        .bind(i64::from(req.memory_mib))
        .bind(req.recreate_on_host_loss)
        .bind(req.network_policy.as_str())
        .bind(req.sandbox)
        .execute(&mut **t)
        .await
        .map_err(db_err)?
        .rows_affected());
    if n == 0 {
        // The id exists (on PostgreSQL the insert waited for a concurrent creator to commit).
        // The same request again (a retry whose first reply was lost) gets the instance as it
        // is; any other request with this id conflicts with it.
        let instance = get_instance(tx, &req.instance_id).await?;
        return match req.mismatch(&instance) {
            None => Ok(Ensured {
                instance,
                created: false,
            }),
            Some(why) => Err(IpamError::Conflict(format!(
                "instance {} already exists with {why}",
                req.instance_id
            ))),
        };
    }
    if let (Some(_), Some(m)) = (&provider, &req.machine) {
        // A machine at the provider: no host, no claim, no lease; its id is its allocation id.
        crate::providers::insert_machine(tx, &req.pool_id, id, m).await?;
        on_tx!(tx, t => sqlx::query("UPDATE instances SET allocation_id = $1 WHERE instance_id = $1")
            .bind(id)
            .execute(&mut **t)
            .await
            .map_err(db_err)?
            .rows_affected());
        return Ok(Ensured {
            instance: get_instance(tx, id).await?,
            created: true,
        });
    }
    let want = Want {
        instance_id: &req.instance_id,
        pool_id: &req.pool_id,
        vcpus: req.vcpus,
        memory_mib: req.memory_mib,
    };
    place(tx, &want, req.host_id.as_deref()).await?;
    Ok(Ensured {
        instance: get_instance(tx, &req.instance_id).await?,
        created: true,
    })
}

/// What a placement needs to know about the instance.
pub(crate) struct Want<'a> {
    pub(crate) instance_id: &'a str,
    pub(crate) pool_id: &'a str,
    pub(crate) vcpus: u32,
    pub(crate) memory_mib: u32,
}

impl Want<'_> {
    fn no_room(&self) -> String {
        format!(
            "instance {} ({} vCPUs, {} MiB)",
            self.instance_id, self.vcpus, self.memory_mib
        )
    }
}

/// Claims capacity (on `host` or the first ready host with room) and takes the lease; marks the
/// instance running there. Callers undo on error (savepoint).
pub(crate) async fn place(
    tx: &mut Tx,
    want: &Want<'_>,
    host: Option<&str>,
) -> Result<(), IpamError> {
    let host_id = match host {
        Some(h) => {
            if !claim(tx, h, want).await? {
                if get_host(tx, h).await?.state == HostState::Lost {
                    return Err(IpamError::Exhausted(format!("host {h} is lost")));
                }
                return Err(IpamError::Exhausted(format!(
                    "host {h} has no room for {}",
                    want.no_room()
                )));
            }
            h.to_owned()
        }
        None => {
            let candidates: Vec<String> = on_tx!(tx, t => sqlx::query_scalar(
                "SELECT host_id FROM hosts WHERE state = 'ready' AND used_vcpus + $1 <= vcpus \
                 AND used_memory_mib + $2 <= memory_mib ORDER BY host_id")
                .bind(i64::from(want.vcpus))
                .bind(i64::from(want.memory_mib))
                .fetch_all(&mut **t)
                .await
                .map_err(db_err)?);
            let mut chosen = None;
            for h in candidates {
                if claim(tx, &h, want).await? {
                    chosen = Some(h);
                    break;
                }
            }
            chosen.ok_or_else(|| {
                IpamError::Exhausted(format!("no host has room for {}", want.no_room()))
            })?
        }
    };
    let allocation_id = Instance::allocation_id_for(want.instance_id, next_allocation(tx).await?);
    on_tx!(tx, t => sqlx::query(
        "UPDATE instances SET host_id = $2, state = 'running', conditions = '[]', allocation_id = $3 \
         WHERE instance_id = $1")
        .bind(want.instance_id)
        .bind(&host_id)
        .bind(&allocation_id)
        .execute(&mut **t)
        .await
        .map_err(db_err)?.rows_affected());
    // Both families in this transaction: IPv4 first, then IPv6 (the order of the free-interval
    // locks, see crate::locks).
    lease(tx, want.pool_id, want.instance_id).await?;
    lease6(tx, want.pool_id, want.instance_id).await?;
    Ok(())
}

/// The next placement number, store-wide, never repeated: a sequence on PostgreSQL (no row lock,
/// so concurrent placements neither serialize nor deadlock on it; a rolled-back placement leaves
/// a gap), a counter row on SQLite (whose writers are serialized anyway; rolled back with the
/// placement).
async fn next_allocation(tx: &mut Tx) -> Result<u64, IpamError> {
    let n: i64 = match tx {
        Tx::Sqlite(t) => sqlx::query_scalar(
            "UPDATE allocation_counter SET next = next + 1 WHERE id = 1 RETURNING next - 1",
        )
        .fetch_one(&mut **t)
        .await
        .map_err(db_err)?,
        Tx::Postgres(t) => sqlx::query_scalar("SELECT nextval('allocation_seq')")
            .fetch_one(&mut **t)
            .await
            .map_err(db_err)?,
    };
    u64::try_from(n).map_err(|_| IpamError::Corrupt(format!("allocation counter {n} is negative")))
}

/// Claims the request on a ready host if it has room; false otherwise. Row-level: concurrent
/// claims on PostgreSQL serialize on the host row and re-check the room.
async fn claim(tx: &mut Tx, host_id: &str, want: &Want<'_>) -> Result<bool, IpamError> {
    let n = on_tx!(tx, t => sqlx::query(
        "UPDATE hosts SET used_vcpus = used_vcpus + $2, used_memory_mib = used_memory_mib + $3 \
         WHERE host_id = $1 AND state = 'ready' AND used_vcpus + $2 <= vcpus AND used_memory_mib + $3 <= memory_mib")
        .bind(host_id)
        .bind(i64::from(want.vcpus))
        .bind(i64::from(want.memory_mib))
        .execute(&mut **t)
        .await
        .map_err(db_err)?
        .rows_affected());
    Ok(n == 1)
}

/// Returns an instance's claim to its host (a lost host holds no claims).
async fn unclaim(tx: &mut Tx, inst: &Instance) -> Result<(), IpamError> {
    let Some(h) = &inst.host_id else {
        return Ok(());
    };
    on_tx!(tx, t => sqlx::query(
        "UPDATE hosts SET used_vcpus = used_vcpus - $2, used_memory_mib = used_memory_mib - $3 \
         WHERE host_id = $1 AND state = 'ready'")
        .bind(h)
        .bind(i64::from(inst.vcpus))
        .bind(i64::from(inst.memory_mib))
        .execute(&mut **t)
        .await
        .map_err(db_err)?.rows_affected());
    Ok(())
}

/// Deletes an instance, returning its leases (both families) and its claim. Returns the instance as it was.
/// Locks its host, then the instance (see [`crate::locks`] for the order every transaction
/// follows).
///
/// # Errors
/// `INVALID_INPUT` for a bad id; `NOT_FOUND` for an unknown instance; `UNAVAILABLE` on a database failure.
pub async fn delete_instance(tx: &mut Tx, instance_id: &str) -> Result<Instance, IpamError> {
    validate_id("instance_id", instance_id)?;
    atomically!(tx, "vmnet_delete", delete_inner(tx, instance_id).await)
}

async fn delete_inner(tx: &mut Tx, instance_id: &str) -> Result<Instance, IpamError> {
    // Lock order (crate::locks): the host, the instance, then the claim before the lease.
    lock_placed_instance(tx, instance_id).await?;
    let inst = get_instance(tx, instance_id).await?;
    unclaim(tx, &inst).await?;
    release(tx, instance_id).await?;
    release6(tx, instance_id).await?;
    on_tx!(tx, t => sqlx::query("DELETE FROM instances WHERE instance_id = $1")
        .bind(instance_id)
        .execute(&mut **t)
        .await
        .map_err(db_err)?.rows_affected());
    Ok(inst)
}
