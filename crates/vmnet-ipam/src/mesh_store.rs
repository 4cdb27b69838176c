//! The record of the mesh's WireGuard peers the agent applied to wg0, and the tenant-0
//! whitelist (tables `mesh_peers` and `mesh_whitelist`, migration 0110).
//!
//! Like [`crate::vm_store`] the store is dumb: keys, endpoints and addresses are text, validated
//! by the agent. Every function takes the caller's transaction and writes only the rows it is
//! given, so a sync that changes one peer among a thousand writes one row.

use crate::error::IpamError;

use crate::db::{Tx, db_err, on_tx};

/// One recorded peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeshPeerRow {
    /// Base64 public key.
    pub public_key: String,
    /// `address:port`, IPv6 in brackets.
    pub endpoint: String,
    /// Canonical IPv6 text.
    pub mesh_address: String,
    /// The peer left the managed set; its removal from wg0 is not confirmed yet.
    pub leaving: bool,
}

/// Every recorded peer, ordered by key.
///
/// # Errors
/// `UNAVAILABLE` on a database failure.
pub async fn list_peers(tx: &mut Tx) -> Result<Vec<MeshPeerRow>, IpamError> {
    let rows: Vec<(String, String, String, i64)> = on_tx!(tx, c => sqlx::query_as(
        "SELECT public_key, endpoint, mesh_address, leaving FROM mesh_peers ORDER BY public_key")
        .fetch_all(&mut **c).await)
    .map_err(db_err)?;
    Ok(rows
        .into_iter()
        .map(
            |(public_key, endpoint, mesh_address, leaving)| MeshPeerRow {
                public_key,
                endpoint,
                mesh_address,
                leaving: leaving != 0,
            },
        )
        .collect())
}

/// The public key of the recorded peer (leaving or not) whose mesh address is `mesh_address`
/// (canonical IPv6 text), if any.
///
/// # Errors
/// `UNAVAILABLE` on a database failure.
pub async fn peer_with_address(
    tx: &mut Tx,
    mesh_address: &str,
) -> Result<Option<String>, IpamError> {
    let row: Option<(String,)> = on_tx!(tx, c => sqlx::query_as(
        "SELECT public_key FROM mesh_peers WHERE mesh_address = $1 ORDER BY public_key LIMIT 1")
        .bind(mesh_address)
        .fetch_optional(&mut **c).await)
    .map_err(db_err)?;
    Ok(row.map(|(k,)| k))
}

/// Inserts or replaces `rows` (each keyed by its public key) with their `leaving` flag.
///
/// # Errors
/// `UNAVAILABLE` on a database failure.
pub async fn upsert_peers(tx: &mut Tx, rows: &[MeshPeerRow], now_ms: i64) -> Result<(), IpamError> {
    for r in rows {
        on_tx!(tx, c => sqlx::query(
            "INSERT INTO mesh_peers (public_key, endpoint, mesh_address, leaving, updated_at) \
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT (public_key) DO UPDATE SET \
             endpoint = excluded.endpoint, mesh_address = excluded.mesh_address, \
             leaving = excluded.leaving, updated_at = excluded.updated_at")
            .bind(&r.public_key)
            .bind(&r.endpoint)
            .bind(&r.mesh_address)
            .bind(i64::from(r.leaving))
            .bind(now_ms)
            .execute(&mut **c).await.map(|r| r.rows_affected()))
        .map_err(db_err)?;
    }
    Ok(())
}

/// Marks the peers `keys` as leaving.
///
/// # Errors
/// `UNAVAILABLE` on a database failure.
pub async fn mark_leaving(tx: &mut Tx, keys: &[String], now_ms: i64) -> Result<(), IpamError> {
    for k in keys {
        on_tx!(tx, c => sqlx::query(
            "UPDATE mesh_peers SET leaving = 1, updated_at = $2 WHERE public_key = $1")
            .bind(k)
            .bind(now_ms)
            .execute(&mut **c).await.map(|r| r.rows_affected()))
        .map_err(db_err)?;
    }
    Ok(())
}

/// Deletes the rows of `keys` that are still marked leaving (a key that came back in a later
/// sync keeps its row).
///
/// # Errors
/// `UNAVAILABLE` on a database failure.
pub async fn delete_leaving(tx: &mut Tx, keys: &[String]) -> Result<(), IpamError> {
    for k in keys {
        on_tx!(tx, c => sqlx::query("DELETE FROM mesh_peers WHERE public_key = $1 AND leaving = 1")
            .bind(k)
            .execute(&mut **c).await.map(|r| r.rows_affected()))
        .map_err(db_err)?;
    }
    Ok(())
}

/// The whitelist, sorted.
///
/// # Errors
/// `UNAVAILABLE` on a database failure.
pub async fn whitelist(tx: &mut Tx) -> Result<Vec<String>, IpamError> {
    let rows: Vec<(String,)> = on_tx!(tx, c => sqlx::query_as(
        "SELECT entry FROM mesh_whitelist ORDER BY entry").fetch_all(&mut **c).await)
    .map_err(db_err)?;
    Ok(rows.into_iter().map(|(e,)| e).collect())
}

/// Replaces the whitelist with `entries`, writing only the entries that differ.
///
/// # Errors
/// `UNAVAILABLE` on a database failure.
pub async fn set_whitelist(tx: &mut Tx, entries: &[String]) -> Result<(), IpamError> {
    let old = whitelist(tx).await?;
    for gone in old.iter().filter(|o| !entries.contains(o)) {
        on_tx!(tx, c => sqlx::query("DELETE FROM mesh_whitelist WHERE entry = $1")
            .bind(gone).execute(&mut **c).await.map(|r| r.rows_affected()))
        .map_err(db_err)?;
    }
    for new in entries.iter().filter(|e| !old.contains(e)) {
        on_tx!(tx, c => sqlx::query("INSERT INTO mesh_whitelist (entry) VALUES ($1)")
            .bind(new).execute(&mut **c).await.map(|r| r.rows_affected()))
        .map_err(db_err)?;
    }
    Ok(())
}
