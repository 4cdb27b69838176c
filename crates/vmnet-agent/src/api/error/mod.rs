//! The one error body of the API and the mapping of every failure into it.
//!
//! Every non-2xx response carries `{"error": {"code": "...", "message": "..."}}`, where `code` is
//! a documented [`ErrorCode`] and the HTTP status is [`ErrorCode::http_status`] (400, 404, 409,
//! 503, 500). That holds for our own errors, for axum's extractor rejections (malformed JSON, a
//! wrong content type, a body over [`BODY_LIMIT_BYTES`], a bad path parameter) and for unknown
//! routes or methods: [`ensure_error_body`] rewrites any error response that is not already in
//! the documented shape.
//!
//! # Design
//! This module is the API's edge: the one place where the error enums of the layers below become
//! documented codes. [`ipam_code`] maps every [`IpamError`] variant and [`ns_code`] every
//! namespace driver [`NsError`] (the CLI uses the same functions for its exit codes);
//! [`firewall_code`] the pool firewall's [`FirewallError`], [`pool_code`] the pool-mode
//! instance steps' [`PoolHostError`], and [`from_wg`] a WireGuard [`WgError`]; a model
//! [`ValidationError`] is always `INVALID_INPUT`. The
//! message is the error with its causes ([`chain`]), except that a database failure answers only
//! our own sentence (the database's words name internals; they are logged).
//!
//! Rejections are mapped in two places: [`ApiJson`] turns a JSON rejection into
//! `INVALID_INPUT` naming the object ([`ApiBody::OBJECT`]) and the field path that serde reports
//! (axum decodes through `serde_path_to_error`), without axum's own wording; and the [`ensure_error_body`] middleware is the safety net for everything else, so no code
//! path can leak a plain-text error.

use axum::body::Body;
use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Request};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use vmnet_ipam::IpamError;
use vmnet_kernel::ns::NsError;
use vmnet_kernel::pool::firewall::FirewallError;
use vmnet_kernel::pool::host::PoolHostError;
use vmnet_kernel::wg::WgError;
use vmnet_model::error::chain;
use vmnet_model::{Error, ErrorCode, ValidationError};
use vmnet_plan::pool::seed::SeedError;

use crate::server::ServerError;

/// The largest request body the API accepts, in bytes (64 KiB). A larger body is refused with
/// 400 `INVALID_INPUT`.
pub const BODY_LIMIT_BYTES: usize = 64 * 1024;

/// The error body: `{"error": {"code": "INVALID_INPUT", "message": "..."}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ErrorBody {
    /// The error: its documented code and a message naming the object and field.
    pub error: Error,
}

/// An error answered by the API: a [`vmnet_model::Error`] rendered as [`ErrorBody`] with the
/// status of its code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError(pub Error);

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        Self(e)
    }
}

impl From<IpamError> for ApiError {
    fn from(e: IpamError) -> Self {
        Self(from_ipam(e))
    }
}

impl From<ValidationError> for ApiError {
    fn from(e: ValidationError) -> Self {
        Self(e.into())
    }
}

/// The documented code of an IPAM or store failure: the one mapping of [`IpamError`], used by
/// the API and the CLI.
#[must_use]
pub fn ipam_code(e: &IpamError) -> ErrorCode {
    match e {
        IpamError::Invalid(_) | IpamError::UnknownScheme { .. } | IpamError::Url { .. } => {
            ErrorCode::InvalidInput
        }
        IpamError::NotFound { .. } => ErrorCode::NotFound,
        IpamError::Conflict(_) => ErrorCode::Conflict,
        IpamError::Exhausted(_) => ErrorCode::CapacityUnavailable,
        IpamError::Contended(_)
        | IpamError::Busy
        | IpamError::Database { .. }
        | IpamError::Connect(_)
        | IpamError::Migrate(_)
        | IpamError::Io { .. } => ErrorCode::Unavailable,
        IpamError::Corrupt(_) | IpamError::Json { .. } => ErrorCode::Internal,
        // `IpamError` is not `#[non_exhaustive]`; a new variant fails to compile here first.
    }
}

/// The message a caller gets for an IPAM or store failure: the error and its causes, except a
/// database failure's driver error (logged where it happened, never answered).
#[must_use]
pub fn ipam_message(e: &IpamError) -> String {
    match e {
        IpamError::Database { .. } => e.to_string(),
        _ => chain(e),
    }
}

/// The documented code of a namespace driver failure: `INVALID_INPUT` when the settings or
/// the plan do not fit the driver, else `UNAVAILABLE` (the kernel refused or lost an object; a
/// retry or the next reconcile pass may succeed).
#[must_use]
pub fn ns_code(e: &NsError) -> ErrorCode {
    match e {
        NsError::Invalid(_) => ErrorCode::InvalidInput,
        NsError::Netns(_)
        | NsError::Netlink { .. }
        | NsError::Tap { .. }
        | NsError::Sysctl { .. }
        | NsError::Nft { .. }
        | NsError::Missing(_)
        | NsError::Many(_)
        | NsError::Activity(_)
        | NsError::Guard(_)
        | NsError::NoRuntime => ErrorCode::Unavailable,
        // `NsError` is not `#[non_exhaustive]`; a new variant fails to compile here first.
    }
}

/// A namespace driver failure as the wire error: [`ns_code`] and the error with its causes.
#[must_use]
pub fn from_ns(e: &NsError) -> Error {
    Error::new(ns_code(e), chain(e))
}

/// The documented code of a listening or serving failure (the CLI's `vmnet serve`): a live agent
/// on the socket is `CONFLICT`, an unknown `--socket-group` `INVALID_INPUT`, an I/O failure
/// `UNAVAILABLE`.
#[must_use]
pub fn server_code(e: &ServerError) -> ErrorCode {
    match e {
        ServerError::InUse(_) => ErrorCode::Conflict,
        ServerError::BadGroup(_) => ErrorCode::InvalidInput,
        ServerError::Io { .. } => ErrorCode::Unavailable,
    }
}

/// A listening or serving failure as the wire error: [`server_code`] and the error with its
/// cause.
#[must_use]
#[allow(clippy::needless_pass_by_value)] // by value so that `.map_err(from_server)` works
pub fn from_server(e: ServerError) -> Error {
    Error::new(server_code(&e), chain(&e))
}

/// A seed failure as the wire error: an instance that does not validate is `INVALID_INPUT`, a
/// document that does not encode `INTERNAL`.
#[must_use]
#[allow(clippy::needless_pass_by_value)] // by value so that `.map_err(from_seed)` works
pub fn from_seed(e: SeedError) -> Error {
    let code = match &e {
        SeedError::Invalid(_) => ErrorCode::InvalidInput,
        SeedError::Encode { .. } => ErrorCode::Internal,
    };
    Error::new(code, chain(&e))
}

/// The documented code of a pool firewall failure: an instance that does not validate is
/// `INVALID_INPUT`, one whose taps have rules already `CONFLICT`; nft, the root helper or the
/// read-back failing is `UNAVAILABLE` (the previous rules are kept).
#[must_use]
pub fn firewall_code(e: &FirewallError) -> ErrorCode {
    match e {
        FirewallError::Plan(_) => ErrorCode::InvalidInput,
        FirewallError::Duplicate(_) => ErrorCode::Conflict,
        FirewallError::Nft(_) | FirewallError::Helper(_) | FirewallError::ReadBack(_) => {
            ErrorCode::Unavailable
        }
    }
}

/// A pool firewall failure as the wire error: [`firewall_code`]; the message is the error with
/// its causes, prefixed `pool firewall: ` when nft, the helper or the read-back failed.
#[must_use]
pub fn from_firewall(e: &FirewallError) -> Error {
    let code = firewall_code(e);
    match e {
        FirewallError::Plan(_) | FirewallError::Duplicate(_) => Error::new(code, chain(e)),
        _ => Error::new(code, format!("pool firewall: {}", chain(e))),
    }
}

/// The documented code of a failure to start, update or stop an instance in pool mode: an
/// instance that does not validate is `INVALID_INPUT`, a rule failure as [`firewall_code`], a
/// failed task `INTERNAL`, and a tap or tap guard failure `UNAVAILABLE`.
#[must_use]
pub fn pool_code(e: &PoolHostError) -> ErrorCode {
    match e {
        PoolHostError::Invalid(_) => ErrorCode::InvalidInput,
        PoolHostError::Firewall(f) => firewall_code(f),
        PoolHostError::FirewallTask(_) | PoolHostError::GuardTask { .. } => ErrorCode::Internal,
        PoolHostError::Tap(_) | PoolHostError::Guard { .. } => ErrorCode::Unavailable,
        PoolHostError::Instance { source, .. } => pool_code(source),
    }
}

/// A pool-mode instance failure as the wire error: [`pool_code`] and the error with its causes
/// (a rule failure worded as [`from_firewall`]).
#[must_use]
pub fn from_pool(e: &PoolHostError) -> Error {
    match e {
        PoolHostError::Firewall(f) => from_firewall(f),
        PoolHostError::Instance { id, source } => {
            let inner = from_pool(source);
            Error::new(inner.code, format!("instance {id}: {}", inner.message))
        }
        _ => Error::new(pool_code(e), chain(e)),
    }
}

/// A WireGuard failure as the wire error: always `UNAVAILABLE` (the kernel, the UAPI socket or
/// netlink failed), the message being the error itself.
#[must_use]
#[allow(clippy::needless_pass_by_value)] // by value so that `.map_err(from_wg)` works
pub fn from_wg(e: WgError) -> Error {
    Error::unavailable(e.to_string())
}

/// An IPAM or store failure as the wire error: [`ipam_code`] and [`ipam_message`].
#[must_use]
#[allow(clippy::needless_pass_by_value)] // by value so that `.map_err(from_ipam)` works
pub fn from_ipam(e: IpamError) -> Error {
    Error::new(ipam_code(&e), ipam_message(&e))
}

/// The HTTP status of an error code.
#[must_use]
pub fn status_of(code: ErrorCode) -> StatusCode {
    StatusCode::from_u16(code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = status_of(self.0.code);
        let body = serde_json::to_vec(&ErrorBody { error: self.0 }).unwrap_or_else(|_| {
            br#"{"error":{"code":"INTERNAL","message":"cannot encode error"}}"#.to_vec()
        });
        let mut resp = (status, body).into_response();
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        resp.headers_mut()
            .insert(MARKER, HeaderValue::from_static("1"));
        resp
    }
}

/// An internal header that marks a response already in the documented error shape; removed by
/// [`ensure_error_body`] before the response leaves the server.
const MARKER: &str = "x-vmnet-error-body";

/// A JSON request body type and the object its errors name (`instance`, `pool`, `host`).
pub trait ApiBody {
    /// The object named first in every error about this body, e.g. `instance`.
    const OBJECT: &'static str;
}

impl ApiBody for vmnet_model::pool::NewInstance {
    const OBJECT: &'static str = "instance";
}

impl ApiBody for super::types::PoolRange {
    const OBJECT: &'static str = "pool";
}

impl ApiBody for super::types::HostCapacity {
    const OBJECT: &'static str = "host";
}

/// Maps an axum JSON rejection to `INVALID_INPUT` with a message that names `object` and, where
/// serde gives one, the field path, e.g. `instance: vcpus: invalid type: string "x", expected
/// u32` or `instance: missing field `pool_id``. Malformed JSON keeps its position
/// (`instance: request body is not valid JSON: expected value at line 1 column 2`).
#[must_use]
pub fn json_rejection(object: &str, r: &JsonRejection) -> Error {
    match r {
        JsonRejection::MissingJsonContentType(_) => {
            Error::invalid("request body: expected Content-Type: application/json")
        }
        JsonRejection::BytesRejection(_) if r.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            too_large()
        }
        JsonRejection::JsonDataError(_) => {
            let text = r.body_text();
            let detail = after_axum_prefix(&text);
            Error::invalid(format!("{object}: {}", without_position(detail)))
        }
        JsonRejection::JsonSyntaxError(_) => {
            let text = r.body_text();
            Error::invalid(format!(
                "{object}: request body is not valid JSON: {}",
                after_axum_prefix(&text)
            ))
        }
        _ => Error::invalid(format!("request body: {}", r.body_text())),
    }
}

/// The serde part of an axum rejection text (`Failed to …: <serde's message>`).
fn after_axum_prefix(text: &str) -> &str {
    for prefix in [
        "Failed to deserialize the JSON body into the target type: ",
        "Failed to parse the request body as JSON: ",
    ] {
        if let Some(rest) = text.strip_prefix(prefix) {
            return rest;
        }
    }
    text
}

/// `msg` without serde_json's trailing ` at line N column M` (meaningless for a field error).
fn without_position(msg: &str) -> &str {
    match msg.rsplit_once(" at line ") {
        Some((head, pos))
            if pos.split_once(" column ").is_some_and(|(l, c)| {
                !l.is_empty()
                    && !c.is_empty()
                    && l.bytes().all(|b| b.is_ascii_digit())
                    && c.bytes().all(|b| b.is_ascii_digit())
            }) =>
        {
            head
        }
        _ => msg,
    }
}

fn too_large() -> Error {
    Error::invalid(format!(
        "request body: larger than the limit of {BODY_LIMIT_BYTES} bytes"
    ))
}

/// A JSON body extractor whose rejections are documented API errors (`INVALID_INPUT` naming
/// [`ApiBody::OBJECT`] and the field, see [`json_rejection`]).
#[derive(Debug, Clone)]
pub struct ApiJson<T>(pub T);

impl<T, S> FromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned + ApiBody,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match axum::Json::<T>::from_request(req, state).await {
            Ok(axum::Json(v)) => Ok(Self(v)),
            Err(r) => Err(ApiError(json_rejection(T::OBJECT, &r))),
        }
    }
}

/// A raw JSON body (checked content type, size limit applied) for callers that parse it with a
/// model parser, such as the VM config's own validating parser.
#[derive(Debug, Clone)]
pub struct JsonBytes(pub axum::body::Bytes);

impl<S> FromRequest<S> for JsonBytes
where
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let is_json = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .is_some_and(|m| {
                let m = m.trim().to_ascii_lowercase();
                m == "application/json" || (m.starts_with("application/") && m.ends_with("+json"))
            });
        if !is_json {
            return Err(ApiError(Error::invalid(
                "request body: expected Content-Type: application/json",
            )));
        }
        match axum::body::Bytes::from_request(req, state).await {
            Ok(b) => Ok(Self(b)),
            Err(r) if r.status() == StatusCode::PAYLOAD_TOO_LARGE => Err(ApiError(too_large())),
            Err(r) => Err(ApiError(Error::invalid(format!(
                "request body: {}",
                r.body_text()
            )))),
        }
    }
}

/// The fallback for unknown routes: 404 `NOT_FOUND` naming the method and path; a method not
/// served on an existing path is 405 `METHOD_NOT_ALLOWED` with an `Allow` header, e.g.
/// `method POST is not allowed on /v1/vms/{id}; allowed: GET, PUT, DELETE`.
pub async fn no_route(req: Request) -> Response {
    let path = req.uri().path();
    let Some((template, methods)) = super::allowed_methods(path) else {
        return ApiError(Error::not_found(format!(
            "no route {} {path}",
            req.method()
        )))
        .into_response();
    };
    let allowed = methods
        .iter()
        .map(Method::as_str)
        .collect::<Vec<_>>()
        .join(", ");
    let mut resp = ApiError(Error::new(
        ErrorCode::MethodNotAllowed,
        format!(
            "method {} is not allowed on {template}; allowed: {allowed}",
            req.method()
        ),
    ))
    .into_response();
    if let Ok(v) = HeaderValue::from_str(&allowed) {
        resp.headers_mut().insert(header::ALLOW, v);
    }
    resp
}

/// Middleware: every error response leaves in the documented shape. Responses built from
/// [`ApiError`] pass through; any other 4xx/5xx (an axum rejection, a 405, a panic-free layer
/// error) is replaced by the same status's error code and the original text as the message.
pub async fn ensure_error_body(req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let mut resp = next.run(req).await;
    if resp.headers_mut().remove(MARKER).is_some() {
        return resp;
    }
    let status = resp.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return resp;
    }
    let text = match axum::body::to_bytes(
        std::mem::replace(resp.body_mut(), Body::empty()),
        BODY_LIMIT_BYTES,
    )
    .await
    {
        Ok(b) => String::from_utf8_lossy(&b).trim().to_owned(),
        Err(_) => String::new(),
    };
    let err = match status {
        StatusCode::NOT_FOUND => Error::not_found(format!("no route {method} {path}")),
        StatusCode::METHOD_NOT_ALLOWED => Error::new(
            ErrorCode::MethodNotAllowed,
            format!("method {method} is not allowed on {path}"),
        ),
        StatusCode::PAYLOAD_TOO_LARGE => too_large(),
        s if s.is_client_error() => Error::invalid(if text.is_empty() {
            format!("request: {s}")
        } else {
            format!("request: {text}")
        }),
        StatusCode::SERVICE_UNAVAILABLE => Error::unavailable(text),
        _ => Error::internal(if text.is_empty() {
            status.to_string()
        } else {
            text
        }),
    };
    let mut out = ApiError(err).into_response();
    out.headers_mut().remove(MARKER);
    out
}

#[cfg(test)]
mod tests;
