//! IPAM routes: pools and their ranges, hosts, instances, leases. Each request runs in one
//! store transaction that commits only when the operation succeeded (so a failed placement leaves
//! nothing behind: host claims and the lease roll back together). In pool mode a committed
//! change to ranges, instances or hosts converges this host's NICs before the answer
//! ([`Agent::converge_pool`]).

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use vmnet_ipam::{Db, IpamError, Tx};
use vmnet_model::pool::{
    AddRange, Host, Instance, IpRange, Lease, NewInstance, Pool, SetIpPool, SetProviderPool,
    StatusReport, StatusReportOutcome,
};

use super::error::{ApiBody, ApiError, ApiJson};
use super::types::{HostCapacity, NewRange, PoolProvider, PoolRange as RangeBody};
use crate::agent::Agent;
use vmnet_model::pool::PoolRange;

/// Runs `$body` (an expression using `$tx: &mut Tx`) in a transaction on `$db`; commits on `Ok`,
/// rolls back on `Err`, and runs it again when it failed on a deadlock or serialization conflict
/// ([`vmnet_ipam::transaction!`]; the caller never sees the database's own message).
macro_rules! in_tx {
    ($db:expr, $tx:ident => $body:expr) => {
        vmnet_ipam::transaction!($db, $tx => $body)
    };
}

fn db(a: &Agent) -> &Db {
    a.db()
}

/// `GET /v1/pools`: every pool with its range (if set) and lease count.
pub async fn list_pools(State(a): State<Arc<Agent>>) -> Result<Json<Vec<Pool>>, ApiError> {
    let pools: Result<Vec<Pool>, IpamError> =
        in_tx!(db(&a), tx => vmnet_ipam::list_pools(tx).await);
    Ok(Json(pools?))
}

/// `GET /v1/pools/{id}`: one pool.
pub async fn get_pool(
    State(a): State<Arc<Agent>>,
    Path(id): Path<String>,
) -> Result<Json<Pool>, ApiError> {
    let pool: Result<Pool, IpamError> = in_tx!(db(&a), tx => vmnet_ipam::get_pool(tx, &id).await);
    Ok(Json(pool?))
}

/// `PUT /v1/pools/{id}/range`: set (or replace) the pool's range; existing leases stay.
pub async fn set_range(
    State(a): State<Arc<Agent>>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<RangeBody>,
) -> Result<Json<IpRange>, ApiError> {
    let req = SetIpPool {
        pool_id: id,
        cidr: body.cidr,
        gateway: body.gateway,
        first_host: body.first_host,
        last_host: body.last_host,
        dns: body.dns.unwrap_or_default(),
    };
    let range: Result<IpRange, IpamError> =
        in_tx!(db(&a), tx => vmnet_ipam::set_ip_pool(tx, req.clone()).await);
    let range = range?;
    a.converge_pool().await;
    Ok(Json(range))
}

/// `GET /v1/pools/{id}/ranges`: the pool's ranges in order (the first IPv4 range, then the
/// added ones).
pub async fn list_ranges(
    State(a): State<Arc<Agent>>,
    Path(id): Path<String>,
) -> Result<Json<Vec<PoolRange>>, ApiError> {
    let list: Result<Vec<PoolRange>, IpamError> =
        in_tx!(db(&a), tx => vmnet_ipam::list_ranges(tx, &id).await);
    Ok(Json(list?))
}

/// `POST /v1/pools/{id}/ranges`: append a range (IPv4 after the first, or IPv6) to the pool's
/// list; `201 Created` with the range, its defaults filled in.
pub async fn add_range(
    State(a): State<Arc<Agent>>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<NewRange>,
) -> Result<(StatusCode, Json<PoolRange>), ApiError> {
    let req = AddRange {
        pool_id: id,
        cidr: body.cidr,
        gateway: body.gateway,
        first_host: body.first_host,
        last_host: body.last_host,
    };
    let range: Result<PoolRange, IpamError> =
        in_tx!(db(&a), tx => vmnet_ipam::add_range(tx, &req).await);
    let range = range?;
    a.converge_pool().await;
    Ok((StatusCode::CREATED, Json(range)))
}

/// `DELETE /v1/pools/{id}/ranges/{address}/{prefix_len}`: remove the added range whose cidr the
/// path spells (`/v1/pools/p1/ranges/2001:db8::/64`); answers it.
pub async fn remove_range(
    State(a): State<Arc<Agent>>,
    Path((id, address, prefix_len)): Path<(String, String, String)>,
) -> Result<Json<PoolRange>, ApiError> {
    let cidr = format!("{address}/{prefix_len}");
    let range: Result<PoolRange, IpamError> =
        in_tx!(db(&a), tx => vmnet_ipam::remove_range(tx, &id, &cidr).await);
    let range = range?;
    a.converge_pool().await;
    Ok(Json(range))
}

/// `PUT /v1/pools/{id}/provider`: make the pool a provider pool, or replace its settings
/// (creates the pool if new); answers the pool. A `credentials.file` outside the agent's
/// credentials directory or an `api_url` that is not `https://` (without
/// `--allow-plain-http-providers`) is `400 INVALID_INPUT` naming the field. A pool with a
/// range, or with hosted instances, is `409 CONFLICT`. The agent's poller (`vmnet serve --poll-providers`) picks the settings up
/// at its next round.
pub async fn set_provider(
    State(a): State<Arc<Agent>>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<PoolProvider>,
) -> Result<Json<Pool>, ApiError> {
    let req = SetProviderPool {
        pool_id: id,
        provider: body.provider,
        api_url: body.api_url,
        credentials: body.credentials,
        poll_interval_secs: body.poll_interval_secs,
    };
    // The agent's own rules (credentials directory, https) at the edge, before the store.
    a.provider_rules().check(&req.validate()?)?;
    let pool: Result<Pool, IpamError> = in_tx!(db(&a), tx => async {
        vmnet_ipam::set_provider_pool(tx, &req).await?;
        vmnet_ipam::get_pool(tx, &req.pool_id).await
    }.await);
    Ok(Json(pool?))
}

/// `GET /v1/pools/{id}/leases`: the pool's leases, IPv4 then IPv6, each ordered by address.
pub async fn list_leases(
    State(a): State<Arc<Agent>>,
    Path(id): Path<String>,
) -> Result<Json<Vec<Lease>>, ApiError> {
    let leases: Result<Vec<Lease>, IpamError> =
        in_tx!(db(&a), tx => vmnet_ipam::list_leases(tx, &id).await);
    Ok(Json(leases?))
}

/// `GET /v1/hosts`: every host.
pub async fn list_hosts(State(a): State<Arc<Agent>>) -> Result<Json<Vec<Host>>, ApiError> {
    let hosts: Result<Vec<Host>, IpamError> =
        in_tx!(db(&a), tx => vmnet_ipam::list_hosts(tx).await);
    Ok(Json(hosts?))
}

/// `GET /v1/hosts/{id}`: one host.
pub async fn get_host(
    State(a): State<Arc<Agent>>,
    Path(id): Path<String>,
) -> Result<Json<Host>, ApiError> {
    let host: Result<Host, IpamError> = in_tx!(db(&a), tx => vmnet_ipam::get_host(tx, &id).await);
    Ok(Json(host?))
}

/// `PUT /v1/hosts/{id}`: add a host with its capacity. Putting the same capacity again is a
/// no-op; a different capacity for an existing host is `CONFLICT` (capacity changes are not
/// supported).
pub async fn put_host(
    State(a): State<Arc<Agent>>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<HostCapacity>,
) -> Result<Json<Host>, ApiError> {
    let host: Result<Host, IpamError> = in_tx!(db(&a), tx => put_host_tx(tx, &id, &body).await);
    Ok(Json(host?))
}

async fn put_host_tx(tx: &mut Tx, id: &str, body: &HostCapacity) -> Result<Host, IpamError> {
    match vmnet_ipam::get_host(tx, id).await {
        Ok(h) if h.vcpus == body.vcpus && h.memory_mib == body.memory_mib => Ok(h),
        Ok(h) => Err(IpamError::Conflict(format!(
            "host {id} exists with {} vCPUs and {} MiB; changing its capacity is not supported",
            h.vcpus, h.memory_mib
        ))),
        Err(IpamError::NotFound { .. }) => {
            vmnet_ipam::add_host(tx, id, body.vcpus, body.memory_mib).await
        }
        Err(e) => Err(e),
    }
}

/// `POST /v1/hosts/{id}/lose`: the host is lost; its instances return their leases and are
/// re-placed (`recreate_on_host_loss`) or marked lost.
pub async fn lose_host(
    State(a): State<Arc<Agent>>,
    Path(id): Path<String>,
) -> Result<Json<vmnet_ipam::HostLoss>, ApiError> {
    let loss: Result<vmnet_ipam::HostLoss, IpamError> =
        in_tx!(db(&a), tx => vmnet_ipam::lose_host(tx, &id).await);
    let loss = loss?;
    a.converge_pool().await;
    Ok(Json(loss))
}

/// JSON errors of a range body name the pool (`pool: unknown field …`), as for the first range.
impl ApiBody for NewRange {
    const OBJECT: &'static str = "pool";
}

/// JSON errors of a status report body name it `status report` (e.g. `status report: unknown
/// field \`extra\``).
impl ApiBody for StatusReport {
    const OBJECT: &'static str = "status report";
}

/// `POST /v1/hosts/{id}/status`: a host status report (spec: "Addresses on an instance", hosted
/// pools). For each reported instance placed on the host, the reported addresses it does not list
/// yet are appended to its `addresses`; entries for unknown instances and instances on another
/// host are skipped and listed in the answer. A malformed report is `INVALID_INPUT` naming the
/// instance and field and changes nothing; an unknown host is `NOT_FOUND`. Reported addresses do
/// not reach the host's NICs, so nothing is converged.
pub async fn report_host_status(
    State(a): State<Arc<Agent>>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<StatusReport>,
) -> Result<Json<StatusReportOutcome>, ApiError> {
    let out: Result<StatusReportOutcome, IpamError> =
        in_tx!(db(&a), tx => vmnet_ipam::report_host_status(tx, &id, &body).await);
    Ok(Json(out?))
}

/// `POST /v1/instances` (also `PUT`): place an instance and take its lease, in one transaction;
/// `201 Created`. Idempotent: the same request for an existing instance (a retry whose reply
/// was lost) answers the instance as it is with `200 OK` and changes nothing; a different
/// request with that id is `409 CONFLICT` naming the differing field.
pub async fn create_instance(
    State(a): State<Arc<Agent>>,
    ApiJson(body): ApiJson<NewInstance>,
) -> Result<(StatusCode, Json<Instance>), ApiError> {
    let out: Result<vmnet_ipam::Ensured, IpamError> =
        in_tx!(db(&a), tx => vmnet_ipam::ensure_instance(tx, &body).await);
    let out = out?;
    a.converge_pool().await;
    let status = if out.created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(out.instance)))
}

/// `GET /v1/instances`: every instance.
pub async fn list_instances(State(a): State<Arc<Agent>>) -> Result<Json<Vec<Instance>>, ApiError> {
    let list: Result<Vec<Instance>, IpamError> =
        in_tx!(db(&a), tx => vmnet_ipam::list_instances(tx).await);
    Ok(Json(list?))
}

/// `GET /v1/instances/{id}`: one instance.
pub async fn get_instance(
    State(a): State<Arc<Agent>>,
    Path(id): Path<String>,
) -> Result<Json<Instance>, ApiError> {
    let inst: Result<Instance, IpamError> =
        in_tx!(db(&a), tx => vmnet_ipam::get_instance(tx, &id).await);
    Ok(Json(inst?))
}

/// `DELETE /v1/instances/{id}`: delete an instance, returning its claim and its lease; answers
/// the instance as it was.
pub async fn delete_instance(
    State(a): State<Arc<Agent>>,
    Path(id): Path<String>,
) -> Result<Json<Instance>, ApiError> {
    let inst: Result<Instance, IpamError> =
        in_tx!(db(&a), tx => vmnet_ipam::delete_instance(tx, &id).await);
    let inst = inst?;
    a.converge_pool().await;
    Ok(Json(inst))
}

/// JSON errors of a provider body name it `pool` (e.g. `pool: unknown field \`token\``).
impl ApiBody for PoolProvider {
    const OBJECT: &'static str = "pool";
}
