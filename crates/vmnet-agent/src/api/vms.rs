//! VM routes (namespace mode) and the agent status.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, RawQuery, State};

use super::error::{ApiError, JsonBytes};
use crate::activity::{ActivityList, VmActivity};
use crate::agent::Agent;
use crate::status::{AgentStatus, VmView};

/// `PUT /v1/vms/{id}`: create or replace the VM's config and apply it.
pub async fn put_vm(
    State(a): State<Arc<Agent>>,
    Path(id): Path<String>,
    JsonBytes(body): JsonBytes,
) -> Result<Json<VmView>, ApiError> {
    Ok(Json(a.put_vm(&id, &body).await?))
}

/// `GET /v1/vms/{id}`: the VM's config and status.
pub async fn get_vm(
    State(a): State<Arc<Agent>>,
    Path(id): Path<String>,
) -> Result<Json<VmView>, ApiError> {
    Ok(Json(a.get_vm(&id).await?))
}

/// `GET /v1/vms`: every VM, ordered by id.
pub async fn list_vms(State(a): State<Arc<Agent>>) -> Result<Json<Vec<VmView>>, ApiError> {
    Ok(Json(a.list_vms().await?))
}

/// `DELETE /v1/vms/{id}`: remove the VM from the kernel and the store; answers it as it was.
pub async fn delete_vm(
    State(a): State<Arc<Agent>>,
    Path(id): Path<String>,
) -> Result<Json<VmView>, ApiError> {
    Ok(Json(a.delete_vm(&id).await?))
}

/// `GET /v1/status`: counts and the reconcile loop's record.
pub async fn status(State(a): State<Arc<Agent>>) -> Result<Json<AgentStatus>, ApiError> {
    Ok(Json(a.status().await?))
}

/// `GET /v1/vms/{id}/activity`: the VM's last packet activity, baseline and idle time.
pub async fn vm_activity(
    State(a): State<Arc<Agent>>,
    Path(id): Path<String>,
) -> Result<Json<VmActivity>, ApiError> {
    Ok(Json(a.vm_activity(&id).await?))
}

/// `GET /v1/activity[?idle_secs=N]`: every VM's activity, or those idle at least N seconds.
pub async fn activity(
    State(a): State<Arc<Agent>>,
    RawQuery(q): RawQuery,
) -> Result<Json<ActivityList>, ApiError> {
    let idle = crate::activity::parse_query(q.as_deref()).map_err(vmnet_model::Error::invalid)?;
    Ok(Json(a.activity(idle).await?))
}
