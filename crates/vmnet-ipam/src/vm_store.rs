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
//!
//! A config's public addresses are kept in indexed columns too (migration 0140), written from
//! the config by every write here, so [`public_candidates`] reads only the rows that could
//! conflict with a PUT's addresses: its cost does not grow with the number of VMs.

use std::net::{Ipv4Addr, Ipv6Addr};

use ipnet::Ipv6Net;

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
    let cols = PublicCols::of(config);
    on_tx!(tx, c => sqlx::query(
        "INSERT INTO vm_configs (id, user_id, mesh, config, updated_at, public_v4, public_v6_lo, \
         public_v6_hi) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
         ON CONFLICT (id) DO UPDATE SET user_id = excluded.user_id, mesh = excluded.mesh, \
         config = excluded.config, updated_at = excluded.updated_at, \
         public_v4 = excluded.public_v4, public_v6_lo = excluded.public_v6_lo, \
         public_v6_hi = excluded.public_v6_hi",
    )
    .bind(id)
    .bind(i64::from(user_id))
    .bind(mesh)
    .bind(config)
    .bind(now_ms)
    .bind(&cols.v4)
    .bind(cols.v6.as_ref().map(|r| &r.0))
    .bind(cols.v6.as_ref().map(|r| &r.1))
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
    let cols = PublicCols::of(&row.config);
    on_tx!(tx, c => sqlx::query(
        "INSERT INTO vm_configs (id, user_id, mesh, config, applied, last_error, updated_at, \
         public_v4, public_v6_lo, public_v6_hi) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) \
         ON CONFLICT (id) DO UPDATE SET user_id = excluded.user_id, mesh = excluded.mesh, \
         config = excluded.config, applied = excluded.applied, last_error = excluded.last_error, \
         updated_at = excluded.updated_at, public_v4 = excluded.public_v4, \
         public_v6_lo = excluded.public_v6_lo, public_v6_hi = excluded.public_v6_hi",
    )
    .bind(&row.id)
    .bind(i64::from(row.user_id))
    .bind(&row.mesh)
    .bind(&row.config)
    .bind(&row.applied)
    .bind(&row.last_error)
    .bind(row.updated_at)
    .bind(&cols.v4)
    .bind(cols.v6.as_ref().map(|r| &r.0))
    .bind(cols.v6.as_ref().map(|r| &r.1))
    .execute(&mut **c)
    .await
    .map(|r| r.rows_affected()))
    .map_err(|e| write_err(e, &row.id, row.user_id, row.mesh.as_deref()))?;
    Ok(())
}

/// The id and desired config of every other VM that may hold `v4` or an address of `v6` (an
/// address as its /128, or a block), for the caller's exact check within the same transaction:
/// the VM with `v4`, the VMs whose IPv6 range starts inside `v6`'s, and the one whose range
/// starts last before it (stored ranges do not overlap, so no other can reach into `v6`), plus
/// rows written before migration 0140 that hold an IPv6 not yet in its columns. Index lookups
/// only: the cost does not grow with the number of stored VMs.
///
/// # Errors
/// `UNAVAILABLE` on a database failure.
pub async fn public_candidates(
    tx: &mut Tx,
    except_id: &str,
    v4: Option<Ipv4Addr>,
    v6: Option<Ipv6Net>,
) -> Result<Vec<(String, String)>, IpamError> {
    let mut out: Vec<(String, String)> = Vec::new();
    if let Some(a) = v4 {
        let rows: Vec<(String, String)> = on_tx!(tx, c => sqlx::query_as(
            "SELECT id, config FROM vm_configs WHERE public_v4 = $2 AND id <> $1")
            .bind(except_id)
            .bind(a.to_string())
            .fetch_all(&mut **c)
            .await)
        .map_err(db_err)?;
        out.extend(rows);
    }
    if let Some(n) = v6 {
        let (lo, hi) = v6_range(n);
        let inside: Vec<(String, String)> = on_tx!(tx, c => sqlx::query_as(
            "SELECT id, config FROM vm_configs WHERE public_v6_lo >= $2 AND public_v6_lo <= $3 \
             AND id <> $1")
            .bind(except_id)
            .bind(&lo)
            .bind(&hi)
            .fetch_all(&mut **c)
            .await)
        .map_err(db_err)?;
        let before: Vec<(String, String)> = on_tx!(tx, c => sqlx::query_as(
            "SELECT id, config FROM vm_configs WHERE public_v6_lo < $2 AND id <> $1 \
             ORDER BY public_v6_lo DESC LIMIT 1")
            .bind(except_id)
            .bind(&lo)
            .fetch_all(&mut **c)
            .await)
        .map_err(db_err)?;
        let legacy: Vec<(String, String)> = on_tx!(tx, c => sqlx::query_as(
            "SELECT id, config FROM vm_configs WHERE public_v6_lo IS NULL \
             AND config LIKE '%\"public_ipv6\"%' AND id <> $1")
            .bind(except_id)
            .fetch_all(&mut **c)
            .await)
        .map_err(db_err)?;
        out.extend(inside.into_iter().chain(before).chain(legacy));
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// The first and last address of `n` as 32 lowercase hex digits (text order is address
/// order), as the `public_v6_lo` and `public_v6_hi` columns hold them.
#[must_use]
pub fn v6_range(n: Ipv6Net) -> (String, String) {
    let hex = |a: Ipv6Addr| format!("{:032x}", u128::from(a));
    (hex(n.network()), hex(n.broadcast()))
}

/// The indexed public columns of a config (migration 0140), read from its JSON (the rest of
/// it skipped): empty when the fields are absent or do not parse.
#[derive(Debug, Default, PartialEq, Eq)]
struct PublicCols {
    v4: Option<String>,
    v6: Option<(String, String)>,
}

impl PublicCols {
    fn of(config: &str) -> Self {
        #[derive(serde::Deserialize)]
        struct Fields {
            public_ipv4: Option<String>,
            public_ipv6: Option<String>,
        }
        let Ok(f) = serde_json::from_str::<Fields>(config) else {
            return Self::default();
        };
        let v6 = f.public_ipv6.and_then(|s| {
            s.parse::<Ipv6Net>()
                .ok()
                .or_else(|| s.parse::<Ipv6Addr>().ok().map(Ipv6Net::from))
        });
        Self {
            v4: f
                .public_ipv4
                .and_then(|a| a.parse::<Ipv4Addr>().ok())
                .map(|a| a.to_string()),
            v6: v6.map(v6_range),
        }
    }
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

/// Where a stored VM stands ([`states`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmState {
    /// Its desired config is the one applied, without error.
    Applied,
    /// Its desired config is not applied yet (and its last apply did not fail).
    Pending,
    /// Its last apply failed.
    Failed,
}

/// Every stored VM's id, user id and state, ordered by id. The database compares the desired
/// and the applied config, so the configs themselves are not read (a metrics scrape reads
/// 1,000 VMs' states, not their JSON).
///
/// # Errors
/// `UNAVAILABLE` on a database failure; `INTERNAL` for a stored user id out of range.
pub async fn states(tx: &mut Tx) -> Result<Vec<(String, u32, VmState)>, IpamError> {
    let rows: Vec<(String, i64, i32)> = on_tx!(tx, c => sqlx::query_as(
        "SELECT id, user_id, CASE WHEN last_error IS NOT NULL THEN 2 \
         WHEN applied = config THEN 0 ELSE 1 END FROM vm_configs ORDER BY id"
    )
    .fetch_all(&mut **c)
    .await)
    .map_err(db_err)?;
    rows.into_iter()
        .map(|(id, uid, state)| {
            let uid = u32::try_from(uid).map_err(|_| {
                IpamError::Corrupt(format!("vm {id}: stored user_id {uid} is out of range"))
            })?;
            let state = match state {
                0 => VmState::Applied,
                2 => VmState::Failed,
                _ => VmState::Pending,
            };
            Ok((id, uid, state))
        })
        .collect()
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
    let cols = PublicCols::of(&b.config);
    on_tx!(tx, c => sqlx::query(
        "UPDATE vm_configs SET user_id = $2, mesh = $7, config = $3, applied = $4, last_error = $5, \
         updated_at = $6, public_v4 = $8, public_v6_lo = $9, public_v6_hi = $10 WHERE id = $1",
    )
    .bind(id)
    .bind(i64::from(b.user_id))
    .bind(&b.config)
    .bind(&b.applied)
    .bind(&b.last_error)
    .bind(b.updated_at)
    .bind(&b.mesh)
    .bind(&cols.v4)
    .bind(cols.v6.as_ref().map(|r| &r.0))
    .bind(cols.v6.as_ref().map(|r| &r.1))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_columns_come_from_the_config_and_order_as_addresses() {
        let c = PublicCols::of(
            r#"{"id":"a","firewall":{"enabled":false},"public_ipv4":"203.0.113.7","public_ipv6":"2001:db8:7::/56"}"#,
        );
        assert_eq!(c.v4.as_deref(), Some("203.0.113.7"));
        let (lo, hi) = c.v6.unwrap();
        assert_eq!(lo, "20010db8000700000000000000000000");
        assert_eq!(hi, "20010db8000700ffffffffffffffffff");
        let one = PublicCols::of(r#"{"public_ipv6":"2001:db8::9"}"#)
            .v6
            .unwrap();
        assert_eq!(one.0, one.1, "an address is its /128");
        assert!(
            v6_range("2001:db8::a/128".parse().unwrap()).0 > one.0,
            "hex order is address order"
        );
        assert_eq!(PublicCols::of("{}"), PublicCols::default());
        assert_eq!(PublicCols::of("not json"), PublicCols::default());
    }
}
