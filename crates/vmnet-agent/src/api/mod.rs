//! The HTTP API: routes, the documented error body, request and response types.
//!
//! Every route is registered through [`Routes::add`], which also records it, so [`routes`] is
//! the exact list the router serves; the API tests compare it with `openapi.json` both ways.
//! Request bodies are limited to [`error::BODY_LIMIT_BYTES`]; every error answers the documented
//! body (see [`error`]).

pub mod error;
pub mod events;
pub mod ipam;
pub mod mesh;
pub mod nics;
pub mod ops;
pub mod types;
pub mod vms;

use std::sync::{Arc, LazyLock};

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::Method;
use axum::routing::{MethodRouter, delete, get, post, put};

use crate::agent::Agent;

/// The OpenAPI document of this API (`crates/vmnet-agent/openapi.json`).
pub const OPENAPI_JSON: &str = include_str!("../../openapi.json");

/// A router under construction that records each (method, path) it serves.
struct Routes {
    router: Router<Arc<Agent>>,
    list: Vec<(Method, &'static str)>,
}

impl Routes {
    fn add(
        mut self,
        method: Method,
        path: &'static str,
        handler: MethodRouter<Arc<Agent>>,
    ) -> Self {
        self.list.push((method, path));
        self.router = self.router.route(path, handler);
        self
    }
}

fn build() -> Routes {
    let r = Routes {
        router: Router::new(),
        list: Vec::new(),
    };
    r.add(Method::GET, "/metrics", get(ops::metrics))
        .add(Method::GET, "/healthz", get(ops::healthz))
        .add(Method::GET, "/readyz", get(ops::readyz))
        .add(Method::GET, "/v1/status", get(vms::status))
        .add(Method::GET, "/v1/vms", get(vms::list_vms))
        .add(Method::PUT, "/v1/vms/{id}", put(vms::put_vm))
        .add(Method::GET, "/v1/vms/{id}", get(vms::get_vm))
        .add(Method::DELETE, "/v1/vms/{id}", delete(vms::delete_vm))
        .add(Method::GET, "/v1/vms/{id}/activity", get(vms::vm_activity))
        .add(Method::GET, "/v1/activity", get(vms::activity))
        .add(Method::GET, "/v1/events", get(events::events))
        .add(
            Method::POST,
            "/v1/sync",
            post(mesh::sync).layer(DefaultBodyLimit::max(mesh::SYNC_BODY_LIMIT_BYTES)),
        )
        .add(Method::GET, "/v1/mesh", get(mesh::get_mesh))
        .add(Method::POST, "/v1/mesh/vms/sync", post(mesh::vm_sync))
        .add(Method::GET, "/v1/pools", get(ipam::list_pools))
        .add(Method::GET, "/v1/pools/{id}", get(ipam::get_pool))
        .add(Method::PUT, "/v1/pools/{id}/range", put(ipam::set_range))
        .add(Method::GET, "/v1/pools/{id}/ranges", get(ipam::list_ranges))
        .add(Method::POST, "/v1/pools/{id}/ranges", post(ipam::add_range))
        .add(
            Method::DELETE,
            "/v1/pools/{id}/ranges/{address}/{prefix_len}",
            delete(ipam::remove_range),
        )
        .add(
            Method::PUT,
            "/v1/pools/{id}/provider",
            put(ipam::set_provider),
        )
        .add(Method::GET, "/v1/pools/{id}/leases", get(ipam::list_leases))
        .add(Method::GET, "/v1/hosts", get(ipam::list_hosts))
        .add(Method::GET, "/v1/hosts/{id}", get(ipam::get_host))
        .add(Method::PUT, "/v1/hosts/{id}", put(ipam::put_host))
        .add(Method::POST, "/v1/hosts/{id}/lose", post(ipam::lose_host))
        .add(
            Method::POST,
            "/v1/hosts/{id}/status",
            post(ipam::report_host_status),
        )
        .add(Method::GET, "/v1/instances", get(ipam::list_instances))
        .add(Method::POST, "/v1/instances", post(ipam::create_instance))
        .add(Method::PUT, "/v1/instances", put(ipam::create_instance))
        .add(Method::GET, "/v1/instances/{id}", get(ipam::get_instance))
        .add(Method::GET, "/v1/instances/{id}/nics", get(nics::get_nics))
        .add(
            Method::DELETE,
            "/v1/instances/{id}",
            delete(ipam::delete_instance),
        )
}

/// Every (method, path template) the router serves, in registration order.
#[must_use]
pub fn routes() -> Vec<(Method, &'static str)> {
    build().list
}

/// The route table, built once for [`allowed_methods`].
static ROUTES: LazyLock<Vec<(Method, &'static str)>> = LazyLock::new(routes);

/// The path template (e.g. `/v1/vms/{id}`) that `path` matches and the methods served on it
/// (in the order GET, POST, PUT, DELETE), or `None` when no route has this path. A `{param}`
/// segment matches any non-empty segment.
#[must_use]
pub fn allowed_methods(path: &str) -> Option<(&'static str, Vec<Method>)> {
    let matches = |template: &str| {
        let (mut t, mut p) = (template.split('/'), path.split('/'));
        loop {
            match (t.next(), p.next()) {
                (None, None) => return true,
                (Some(ts), Some(ps)) if ts.starts_with('{') && ts.ends_with('}') => {
                    if ps.is_empty() {
                        return false;
                    }
                }
                (Some(ts), Some(ps)) if ts == ps => {}
                _ => return false,
            }
        }
    };
    let template = ROUTES.iter().map(|(_, t)| *t).find(|t| matches(t))?;
    let mut methods: Vec<Method> = ROUTES
        .iter()
        .filter(|(_, t)| *t == template)
        .map(|(m, _)| m.clone())
        .collect();
    let rank = |m: &Method| {
        [Method::GET, Method::POST, Method::PUT, Method::DELETE]
            .iter()
            .position(|x| x == m)
            .unwrap_or(usize::MAX)
    };
    methods.sort_by_key(rank);
    methods.dedup();
    Some((template, methods))
}

/// The routes that read a query string (path templates); every other route refuses one.
const QUERY_ROUTES: [&str; 2] = ["/v1/activity", "/v1/events"];

/// Refuses a query string on a matched route that takes none, with `INVALID_INPUT` naming its
/// first parameter, so that a misspelt filter (`GET /v1/vms?tenant=1`) is not silently ignored
/// and answered as if it had matched. An empty query (`/v1/vms?`) is no parameter.
async fn no_query(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    let template = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map(|m| m.as_str().to_owned());
    if let Some(q) = req.uri().query().filter(|q| !q.is_empty())
        && !template
            .as_deref()
            .is_some_and(|t| QUERY_ROUTES.contains(&t))
    {
        // Decoded as `GET /v1/activity` decodes its own (`application/x-www-form-urlencoded`).
        let name = form_urlencoded::parse(q.as_bytes())
            .next()
            .map_or_else(|| q.to_owned(), |(k, _)| k.into_owned());
        let path = req.uri().path();
        return error::ApiError(vmnet_model::Error::invalid(format!(
            "query parameter {name:?} is unknown: {path} takes no query parameters"
        )))
        .into_response();
    }
    next.run(req).await
}

/// The API router over `agent`: every route, the body limit, the refusal of query strings on
/// routes that take none, the unknown-route fallback (404, or 405 with `Allow` for a wrong
/// method on a served path) and the error-body safety net.
pub fn router(agent: Arc<Agent>) -> Router {
    build()
        .router
        .route_layer(axum::middleware::from_fn(no_query))
        .fallback(error::no_route)
        .method_not_allowed_fallback(error::no_route)
        .layer(DefaultBodyLimit::max(error::BODY_LIMIT_BYTES))
        .layer(axum::middleware::from_fn(error::ensure_error_body))
        .with_state(agent)
}
