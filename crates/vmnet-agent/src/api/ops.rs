//! The operator's routes: `GET /metrics` (Prometheus text format), `GET /healthz` (alive) and
//! `GET /readyz` (ready), served on the API socket and, alone, on `--metrics-listen`
//! ([`ops_router`]).

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use serde::Serialize;

use super::error::ApiError;
use crate::agent::Agent;

/// The body of a passing probe.
#[derive(Debug, Serialize)]
pub struct Probe {
    /// Always `ok`.
    pub status: &'static str,
}

/// `GET /metrics`: every metric in the Prometheus text format (version 0.0.4).
pub async fn metrics(State(a): State<Arc<Agent>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, crate::metrics::scrape::CONTENT_TYPE)],
        a.metrics_text().await,
    )
}

/// `GET /healthz`: 200 while every loop progressed within its deadline, else 503 naming the
/// stalled loops.
pub async fn healthz(State(a): State<Arc<Agent>>) -> Result<Json<Probe>, ApiError> {
    a.health()?;
    Ok(Json(Probe { status: "ok" }))
}

/// `GET /readyz`: 200 once alive, converged since start and the store answers, else 503 with
/// the reason.
pub async fn readyz(State(a): State<Arc<Agent>>) -> Result<Json<Probe>, ApiError> {
    a.readiness().await?;
    Ok(Json(Probe { status: "ok" }))
}

/// The router of `--metrics-listen`: these three routes only; any other path answers 404 and
/// another method 405, with the documented error body.
pub fn ops_router(agent: Arc<Agent>) -> axum::Router {
    axum::Router::new()
        .route("/metrics", axum::routing::get(metrics))
        .route("/healthz", axum::routing::get(healthz))
        .route("/readyz", axum::routing::get(readyz))
        .fallback(not_here)
        .method_not_allowed_fallback(not_here)
        .layer(axum::extract::DefaultBodyLimit::max(
            super::error::BODY_LIMIT_BYTES,
        ))
        .layer(axum::middleware::from_fn(super::error::ensure_error_body))
        .with_state(agent)
}

/// The fallback of [`ops_router`]: 404 for any path but the three, 405 (with `Allow: GET`)
/// for another method on one of them.
async fn not_here(req: axum::extract::Request) -> axum::response::Response {
    let path = req.uri().path();
    if ["/metrics", "/healthz", "/readyz"].contains(&path) {
        let mut resp = ApiError(vmnet_model::Error::new(
            vmnet_model::ErrorCode::MethodNotAllowed,
            format!(
                "method {} is not allowed on {path}; allowed: GET",
                req.method()
            ),
        ))
        .into_response();
        resp.headers_mut()
            .insert(header::ALLOW, axum::http::HeaderValue::from_static("GET"));
        return resp;
    }
    ApiError(vmnet_model::Error::not_found(format!(
        "no route {} {path}: this listener serves GET /metrics, /healthz and /readyz only",
        req.method()
    )))
    .into_response()
}
