//! The mesh routes: `POST /v1/sync` (the complete managed peer set and the whitelist) and
//! `GET /v1/mesh`, and `POST /v1/mesh/vms/sync` (this host's VM registrations written again).

use std::sync::Arc;

use axum::Json;
use axum::extract::State;

use super::error::{ApiError, JsonBytes};
use crate::agent::Agent;
use crate::mesh::view::{MeshView, SyncOutcome, VmSyncOutcome};

/// The largest `POST /v1/sync` body: room for 10,000 peers and their whitelist, so that a sync
/// of 10,001 peers is refused by its count with `INVALID_INPUT`, not by its size.
pub const SYNC_BODY_LIMIT_BYTES: usize = 8 * 1024 * 1024;

/// `POST /v1/sync`: validate the whole body, then apply it to wg0 and record it.
pub async fn sync(
    State(a): State<Arc<Agent>>,
    JsonBytes(body): JsonBytes,
) -> Result<Json<SyncOutcome>, ApiError> {
    let mesh = a.mesh()?;
    Ok(Json(mesh.sync(a.db(), &body).await?))
}

/// `GET /v1/mesh`: this host's key, port, mesh address and MTU, and every peer on wg0.
pub async fn get_mesh(State(a): State<Arc<Agent>>) -> Result<Json<MeshView>, ApiError> {
    let mesh = a.mesh()?;
    Ok(Json(mesh.view(a.db()).await?))
}

/// `POST /v1/mesh/vms/sync`: register this host's complete VM state again.
pub async fn vm_sync(State(a): State<Arc<Agent>>) -> Result<Json<VmSyncOutcome>, ApiError> {
    let r = a.mesh_vm_sync().await?;
    Ok(Json(VmSyncOutcome {
        written: r.written,
        removed: r.removed,
    }))
}
