//! Desired VM network configs (namespace mode), stored in the same database as IPAM so that one
//! store holds all desired state (table `vm_configs`, migration 0100).
//!
//! Each row holds the desired config, the last config the kernel layer applied successfully and
//! the last apply error. The store is deliberately dumb: configs are JSON text, parsed and
//! validated by the agent (`vmnet_model::vm`). Every function takes the caller's transaction.
//! A change whose outcome is known is one write: [`get_if_free`] (reads) before touching the
//! kernel, then [`save`] of the whole row once the apply succeeded.
//!
//! `user_id` is unique across rows: two VMs with one user id would share every kernel name.
//! `mesh` (the config's `mesh_ipv6`, migration 0101) is unique across rows too: two VMs with one
//! mesh address would fight over the host route to it. Both are enforced by unique indexes, so
//! two concurrent writers cannot both win; the violation maps to `CONFLICT`.

use crate::error::IpamError;

use crate::db::{Tx, db_err, on_tx};

/// One stored VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmRow {
    /// The VM id.
    pub id: String,
    /// The VM user id (unique).
    pub user_id: u32,
    /// The VM's mesh address as canonical text (unique); `None` when the VM has none.
    pub mesh: Option<String>,
    /// The desired config, JSON.
    pub config: String,
    /// The last config applied successfully, JSON; `None` until one was.
    pub applied: Option<String>,
    /// The last apply error; `None` after a success.
    pub last_error: Option<String>,
    /// Milliseconds since the Unix epoch of the row's last change.
    pub updated_at: i64,
}

type Raw = (
    String,
    i64,
    Option<String>,
    String,
    Option<String>,
    Option<String>,
    i64,
);

fn from_raw(r: Raw) -> Result<VmRow, IpamError> {
    let user_id = u32::try_from(r.1).map_err(|_| {
        IpamError::Corrupt(format!(
            "vm {}: stored user_id {} is out of range",
            r.0, r.1
        ))
    })?;
    Ok(VmRow {
        id: r.0,
        user_id,
        mesh: r.2,
        config: r.3,
        applied: r.4,
        last_error: r.5,
        updated_at: r.6,
    })
}

macro_rules! select {
    ($tail:literal) => {
        concat!(
            "SELECT id, user_id, mesh, config, applied, last_error, updated_at FROM vm_configs ",
            $tail
        )
    };
}

/// The stored VM `id`, if any.
///
/// # Errors
/// `UNAVAILABLE` on a database failure.
pub async fn get(tx: &mut Tx, id: &str) -> Result<Option<VmRow>, IpamError> {
    let row: Option<Raw> =
        on_tx!(tx, c => sqlx::query_as(select!("WHERE id = $1")).bind(id).fetch_optional(&mut **c).await)
            .map_err(db_err)?;
    row.map(from_raw).transpose()
}

/// Every stored VM, ordered by id.
///
/// # Errors
/// `UNAVAILABLE` on a database failure.
pub async fn list(tx: &mut Tx) -> Result<Vec<VmRow>, IpamError> {
    let rows: Vec<Raw> =
        on_tx!(tx, c => sqlx::query_as(select!("ORDER BY id")).fetch_all(&mut **c).await)
            .map_err(db_err)?;
    rows.into_iter().map(from_raw).collect()
}

/// The stored VM `id` (if any), after checking that no VM other than `id` holds `user_id` or
/// `mesh` (canonical text; `None` when the VM has none); one query. Reads only: a caller checks
/// before it touches the kernel (applying a taken user id would take over the other VM's
/// objects) and writes once afterwards ([`save`]); the unique indexes still refuse a
/// concurrent writer that won in between.
///
/// # Errors
/// `CONFLICT` naming the holder (`vm a3: mesh_ipv6 fdaa:1::100 is already used by vm a1`);
/// `UNAVAILABLE` on a database failure.
pub async fn get_if_free(
    tx: &mut Tx,
    id: &str,
    user_id: u32,
    mesh: Option<&str>,
) -> Result<Option<VmRow>, IpamError> {
    let rows: Vec<Raw> =
        on_tx!(tx, c => sqlx::query_as(select!("WHERE id = $1 OR user_id = $2 OR mesh = $3"))
        .bind(id)
        .bind(i64::from(user_id))
        .bind(mesh)
        .fetch_all(&mut **c)
        .await)
        .map_err(db_err)?;
    let rows = rows
        .into_iter()
        .map(from_raw)
        .collect::<Result<Vec<_>, _>>()?;
    let others = || rows.iter().filter(|r| r.id != id);
    if let Some(other) = others().find(|r| r.user_id == user_id) {
        return Err(IpamError::Conflict(format!(
            "vm {id}: user_id {user_id} is already used by vm {}",
            other.id
        )));
    }
    if let Some(m) = mesh
        && let Some(other) = others().find(|r| r.mesh.as_deref() == Some(m))
    {
        return Err(IpamError::Conflict(format!(
            "vm {id}: mesh_ipv6 {m} is already used by vm {}",
            other.id
        )));
    }
    Ok(rows.into_iter().find(|r| r.id == id))
}

/// Maps a unique violation of the insert or update of VM `id` to `CONFLICT` naming the field.
fn write_err(e: sqlx::Error, id: &str, user_id: u32, mesh: Option<&str>) -> IpamError {
    match e {
        sqlx::Error::Database(e) if e.is_unique_violation() => {
            let on_mesh =
                e.constraint().is_some_and(|c| c.contains("mesh")) || e.message().contains("mesh");
            IpamError::Conflict(match mesh {
                Some(m) if on_mesh => {
                    format!("vm {id}: mesh_ipv6 {m} is already used by another vm")
                }
                _ => format!("vm {id}: user_id {user_id} is already used by another vm"),
            })
        }
        e => db_err(e),
    }
}

/// Stores `config` as the desired config of VM `id` (insert or replace) with its user id and
/// mesh address (`mesh`: canonical text, e.g. `fdaa:1::7`; `None` when the VM has none), keeping
/// the row's `applied` and `last_error`. Returns the row as it was before, so a caller can
/// restore it.
///
/// # Errors
/// `CONFLICT` when another VM holds `user_id` or `mesh`
/// (`vm a3: mesh_ipv6 fdaa:1::100 is already used by vm a1`); `UNAVAILABLE` on a database
/// failure.
pub async fn put(
    tx: &mut Tx,
    id: &str,
    user_id: u32,
    mesh: Option<&str>,
    config: &str,
    now_ms: i64,
) -> Result<Option<VmRow>, IpamError> {
    let before = get_if_free(tx, id, user_id, mesh).await?;
    on_tx!(tx, c => sqlx::query(
        "INSERT INTO vm_configs (id, user_id, mesh, config, updated_at) VALUES ($1, $2, $3, $4, $5) \
         ON CONFLICT (id) DO UPDATE SET user_id = excluded.user_id, mesh = excluded.mesh, \
         config = excluded.config, updated_at = excluded.updated_at",
    )
    .bind(id)
    .bind(i64::from(user_id))
    .bind(mesh)
    .bind(config)
    .bind(now_ms)
    .execute(&mut **c)
    .await
    .map(|r| r.rows_affected()))
    // A concurrent writer may have won between the check above and the insert.
    .map_err(|e| write_err(e, id, user_id, mesh))?;
    Ok(before)
}

/// Stores `row` as it is (insert or replace every column) in one statement: the one write of a
/// change whose outcome is known, e.g. a config applied successfully (`applied` = `config`,
/// no error). Call [`get_if_free`] first for a readable conflict message.
///
/// # Errors
/// `CONFLICT` when another VM holds the row's user id or mesh address; `UNAVAILABLE` on a
/// database failure.
pub async fn save(tx: &mut Tx, row: &VmRow) -> Result<(), IpamError> {
    on_tx!(tx, c => sqlx::query(
        "INSERT INTO vm_configs (id, user_id, mesh, config, applied, last_error, updated_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7) \
         ON CONFLICT (id) DO UPDATE SET user_id = excluded.user_id, mesh = excluded.mesh, \
         config = excluded.config, applied = excluded.applied, last_error = excluded.last_error, \
         updated_at = excluded.updated_at",
    )
    .bind(&row.id)
    .bind(i64::from(row.user_id))
    .bind(&row.mesh)
    .bind(&row.config)
    .bind(&row.applied)
    .bind(&row.last_error)
    .bind(row.updated_at)
    .execute(&mut **c)
    .await
    .map(|r| r.rows_affected()))
    .map_err(|e| write_err(e, &row.id, row.user_id, row.mesh.as_deref()))?;
    Ok(())
}

/// The id and desired config of every other VM whose config may hold a public address (its
/// JSON mentions `public_ipv`), for the caller's overlap check within the same transaction.
///
/// # Errors
/// `UNAVAILABLE` on a database failure.
pub async fn with_public(tx: &mut Tx, except_id: &str) -> Result<Vec<(String, String)>, IpamError> {
    on_tx!(tx, c => sqlx::query_as("SELECT id, config FROM vm_configs WHERE id <> $1 AND config LIKE '%public_ipv%' ORDER BY id")
        .bind(except_id)
        .fetch_all(&mut **c)
        .await)
    .map_err(db_err)
}

/// Every stored VM's id and mesh address (canonical IPv6 text), for the VMs that have one.
///
/// # Errors
/// `UNAVAILABLE` on a database failure.
pub async fn meshes(tx: &mut Tx) -> Result<Vec<(String, String)>, IpamError> {
    on_tx!(tx, c => sqlx::query_as("SELECT id, mesh FROM vm_configs WHERE mesh IS NOT NULL ORDER BY id")
        .fetch_all(&mut **c)
        .await)
    .map_err(db_err)
}

/// Records the outcome of an apply: the config that is now applied (`None` when nothing of the
/// VM is) and the error, if the apply failed.
///
/// # Errors
/// `NOT_FOUND` when the VM is not stored; `UNAVAILABLE` on a database failure.
pub async fn set_result(
    tx: &mut Tx,
    id: &str,
    applied: Option<&str>,
    last_error: Option<&str>,
    now_ms: i64,
) -> Result<(), IpamError> {
    let res = on_tx!(tx, c => sqlx::query("UPDATE vm_configs SET applied = $2, last_error = $3, updated_at = $4 WHERE id = $1")
        .bind(id)
        .bind(applied)
        .bind(last_error)
        .bind(now_ms)
        .execute(&mut **c)
        .await
        .map(|r| r.rows_affected()))
    .map_err(db_err)?;
    if res == 0 {
        return Err(IpamError::not_found(format!("vm {id}")));
    }
    Ok(())
}

/// Puts a row back exactly as it was (after a failed change), or deletes VM `id` when `before`
/// is `None` (it did not exist).
///
/// # Errors
/// `UNAVAILABLE` on a database failure.
pub async fn restore(tx: &mut Tx, id: &str, before: Option<&VmRow>) -> Result<(), IpamError> {
    let Some(b) = before else {
        delete(tx, id).await?;
        return Ok(());
    };
    on_tx!(tx, c => sqlx::query(
        "UPDATE vm_configs SET user_id = $2, mesh = $7, config = $3, applied = $4, last_error = $5, \
         updated_at = $6 WHERE id = $1",
    )
    .bind(id)
    .bind(i64::from(b.user_id))
    .bind(&b.config)
    .bind(&b.applied)
    .bind(&b.last_error)
    .bind(b.updated_at)
    .bind(&b.mesh)
    .execute(&mut **c)
    .await
    .map(|r| r.rows_affected()))
    .map_err(db_err)?;
    Ok(())
}

/// Deletes VM `id`; returns whether it existed.
///
/// # Errors
/// `UNAVAILABLE` on a database failure.
pub async fn delete(tx: &mut Tx, id: &str) -> Result<bool, IpamError> {
    let res = on_tx!(tx, c => sqlx::query("DELETE FROM vm_configs WHERE id = $1").bind(id).execute(&mut **c).await.map(|r| r.rows_affected()))
        .map_err(db_err)?;
    Ok(res > 0)
}
