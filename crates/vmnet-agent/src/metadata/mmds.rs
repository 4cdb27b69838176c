//! The MMDS request semantics (Firecracker's metadata service), as a pure function from a
//! request to a response for one VM.
//!
//! - `GET <path>`: the value at `path` in the VM's document (`//` collapsed, a trailing `/`
//!   ignored, the query ignored). In plain text (the default) a string leaf is its value and an
//!   object its keys, one per line, objects with a trailing `/`; any other leaf is `501`. With
//!   `Accept: application/json` the value as JSON. An unknown path is `404 Resource not found:
//!   <path>.`.
//! - `PUT /latest/api/token` with `X-metadata-token-ttl-seconds: N` (a plain decimal in
//!   1..=21600; the `X-aws-ec2-metadata-token-ttl-seconds` alias too): a new session token
//!   (text), the granted TTL answered in the header the request named. Missing TTL `400`, bad
//!   TTL (` 5`, `05`, `+5`, out of range) `400`, a `PUT` carrying `X-Forwarded-For` `400` (as Firecracker, so a proxy on
//!   the guest cannot fetch tokens for others), a `PUT` elsewhere `404`.
//! - Version 2: a `GET` without `X-metadata-token` (or `X-aws-ec2-metadata-token`) is `401`, with
//!   an unknown or expired one `401`. Version 1: a `GET` without a token is answered; one that
//!   carries a token must carry a valid one (`401` otherwise), so a guest moving to tokens
//!   works unchanged when the host later switches the VM to version 2.
//! - Any other method: `405` with `Allow: GET, PUT`.
//! - Over the VM's request rate ([`super::limits`]): `429`, before anything else is looked at.

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Method, Response, StatusCode};
use serde_json::Value;
use vmnet_model::vm::metadata::MetadataVersion;

use super::answers::Document;
use super::tokens::{Tokens, parse_ttl};

/// The path that hands out session tokens.
pub const TOKEN_PATH: &str = "/latest/api/token";
/// The token headers a `GET` may carry.
pub const TOKEN_HEADERS: [&str; 2] = ["x-metadata-token", "x-aws-ec2-metadata-token"];
/// The TTL headers of a token `PUT`.
pub const TTL_HEADERS: [&str; 2] = [
    "x-metadata-token-ttl-seconds",
    "x-aws-ec2-metadata-token-ttl-seconds",
];

/// [`TOKEN_HEADERS`] as header names (looked up without parsing a name per request).
static TOKEN_NAMES: [HeaderName; 2] = [
    HeaderName::from_static(TOKEN_HEADERS[0]),
    HeaderName::from_static(TOKEN_HEADERS[1]),
];
/// [`TTL_HEADERS`] as header names.
static TTL_NAMES: [HeaderName; 2] = [
    HeaderName::from_static(TTL_HEADERS[0]),
    HeaderName::from_static(TTL_HEADERS[1]),
];
static FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// A response of the service.
pub type MmdsResponse = Response<Full<Bytes>>;

/// A `text/plain` response (a `&'static str` body is not copied).
pub(super) fn text(status: StatusCode, body: impl Into<Bytes>) -> MmdsResponse {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    r
}

/// A `200` `application/json` response.
pub(super) fn json(body: Bytes) -> MmdsResponse {
    let mut r = Response::new(Full::new(body));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// The `501` of a plain-text `GET` of a leaf that is not a string.
pub(super) fn unsupported() -> MmdsResponse {
    text(
        StatusCode::NOT_IMPLEMENTED,
        "Cannot retrieve value. The value has an unsupported type.",
    )
}

fn first<'a>(h: &'a HeaderMap, names: &[HeaderName]) -> Option<&'a str> {
    names
        .iter()
        .find_map(|n| h.get(n))
        .map(|v| v.to_str().unwrap_or(""))
}

/// Collapses `//` runs and drops one trailing `/` (not of the root).
pub(super) fn sanitize(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    for c in path.chars() {
        if c == '/' && out.ends_with('/') {
            continue;
        }
        out.push(c);
    }
    if out.len() > 1 && out.ends_with('/') {
        out.pop();
    }
    out
}

/// The plain-text (IMDS) form of a value, `None` for a leaf that is not a string.
pub(super) fn imds(v: &Value) -> Option<String> {
    match v {
        Value::Object(m) => Some(
            m.iter()
                .map(|(k, v)| {
                    if v.is_object() {
                        format!("{k}/")
                    } else {
                        k.clone()
                    }
                })
                .collect::<Vec<_>>()
                .join("\n"),
        ),
        Value::String(s) => Some(s.clone()),
        _ => None,
    }
}

pub(super) fn wants_json(h: &HeaderMap) -> bool {
    h.get_all(header::ACCEPT)
        .iter()
        .any(|v| v.to_str().is_ok_and(|s| s.contains("application/json")))
}

/// The answer to an authorised `GET path` of `doc`, looked up and serialised now.
pub(super) fn get(doc: &Value, path: &str, headers: &HeaderMap) -> MmdsResponse {
    let clean = sanitize(path);
    let pointer = if clean == "/" { "" } else { clean.as_str() };
    let Some(v) = doc.pointer(pointer) else {
        return text(
            StatusCode::NOT_FOUND,
            format!("Resource not found: {path}."),
        );
    };
    if wants_json(headers) {
        return json(v.to_string().into());
    }
    match imds(v) {
        Some(body) => text(StatusCode::OK, body),
        None => unsupported(),
    }
}

fn put(tokens: &Tokens, path: &str, headers: &HeaderMap, now: u64) -> MmdsResponse {
    if headers.contains_key(&FORWARDED_FOR) {
        return text(
            StatusCode::BAD_REQUEST,
            "Invalid header. Reason: Unsupported header name. Key: X-Forwarded-For",
        );
    }
    if sanitize(path) != TOKEN_PATH {
        return text(
            StatusCode::NOT_FOUND,
            format!("Resource not found: {path}."),
        );
    }
    let Some((name, ttl)) = TTL_NAMES
        .iter()
        .find_map(|n| headers.get(n).map(|v| (n, v.to_str().unwrap_or(""))))
    else {
        return text(
            StatusCode::BAD_REQUEST,
            "Token time to live value not found. Use `X-metadata-token-ttl-seconds` header to specify the token's lifetime.",
        );
    };
    let ttl = match parse_ttl(ttl) {
        Ok(t) => t,
        Err(m) => return text(StatusCode::BAD_REQUEST, m),
    };
    match tokens.issue(ttl, now) {
        Ok(t) => {
            // IMDSv2 clients read the granted lifetime back, under the name they asked with.
            let mut r = text(StatusCode::OK, t);
            r.headers_mut().insert(name.clone(), HeaderValue::from(ttl));
            r
        }
        Err(m) => text(StatusCode::INTERNAL_SERVER_ERROR, m),
    }
}

/// What [`respond`] looks at in a request.
#[derive(Debug, Clone, Copy)]
pub struct Asked<'a> {
    /// The method.
    pub method: &'a Method,
    /// The URI's path (without the query).
    pub path: &'a str,
    /// The headers.
    pub headers: &'a HeaderMap,
    /// When it arrived: seconds of the boot-time clock ([`super::tokens::boot_secs`]).
    pub now: u64,
}

/// Answers one request of a VM whose document is `doc`, speaking `version`, with its tokens
/// `tokens`; `allowed` is the verdict of the VM's rate limit for this request. A `GET`
/// serialises its answer now; [`respond_document`] answers the same from pre-serialised ones.
pub fn respond(
    doc: &Value,
    version: MetadataVersion,
    tokens: &Tokens,
    allowed: bool,
    asked: Asked<'_>,
) -> MmdsResponse {
    answer(version, tokens, allowed, asked, |p, h| get(doc, p, h))
}

/// [`respond`] for a [`Document`]: a `GET` of a node it holds is a lookup of its
/// pre-serialised answer (the same status, headers and body).
pub fn respond_document(
    doc: &Document,
    version: MetadataVersion,
    tokens: &Tokens,
    allowed: bool,
    asked: Asked<'_>,
) -> MmdsResponse {
    answer(version, tokens, allowed, asked, |p, h| doc.get(p, h))
}

fn answer(
    version: MetadataVersion,
    tokens: &Tokens,
    allowed: bool,
    asked: Asked<'_>,
    get: impl FnOnce(&str, &HeaderMap) -> MmdsResponse,
) -> MmdsResponse {
    let Asked {
        method,
        path,
        headers,
        now,
    } = asked;
    if !allowed {
        return text(
            StatusCode::TOO_MANY_REQUESTS,
            "Too many requests: the metadata service limits each VM's request rate.",
        );
    }
    match *method {
        Method::GET => {
            match (first(headers, &TOKEN_NAMES), version) {
                (Some(t), _) if tokens.valid(t, now) => {}
                (Some(_), _) => return text(StatusCode::UNAUTHORIZED, "MMDS token not valid."),
                (None, MetadataVersion::V1) => {}
                (None, MetadataVersion::V2) => {
                    return text(
                        StatusCode::UNAUTHORIZED,
                        "No MMDS token provided. Use `X-metadata-token` header to specify the session token.",
                    );
                }
            }
            get(path, headers)
        }
        Method::PUT => put(tokens, path, headers, now),
        _ => {
            let mut r = text(StatusCode::METHOD_NOT_ALLOWED, "Not allowed HTTP method.");
            r.headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static("GET, PUT"));
            r
        }
    }
}

#[cfg(test)]
#[path = "mmds_tests.rs"]
mod tests;
