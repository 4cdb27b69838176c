//! A client for the agent's API over its unix socket (HTTP/1.1, hyper 1).
//!
//! Every call returns the decoded JSON body on 2xx, or the [`vmnet_model::Error`] from the
//! documented error body otherwise, so callers (the CLI, the sandbox, tests) print or match on
//! the same `CODE: message` the API sent.
//!
//! The event stream is read line by line as it arrives ([`Client::events_lines`]).
//!
//! A command that makes one call and exits calls the `*_blocking` methods ([`blocking`]), which
//! need no async runtime.
//!
//! # Limitations
//! One connection per request (the CLI makes a handful of calls); no TLS, no TCP.

use std::path::{Path, PathBuf};

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::net::UnixStream;
use vmnet_model::Error;

use crate::api::error::ErrorBody;
use crate::events::Event;

pub mod blocking;

/// A client bound to the agent's unix socket path.
#[derive(Debug, Clone)]
pub struct Client {
    socket: PathBuf,
    timeout: std::time::Duration,
}

/// Percent-encodes one path segment (everything but RFC 3986 unreserved characters).
#[must_use]
pub fn segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Aborts a connection task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The error of a non-2xx answer: the documented body's, or `INTERNAL` naming what came.
/// The longest one request waits for the agent's whole answer (an event stream: for its
/// head). Longer than the agent's own default bound on a VM change (`--kernel-deadline-secs`,
/// 30 s), so a live agent answers first; a stopped or hung one does not keep a caller forever.
pub const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// The error of a `method` request the agent did not answer within `bound`; a request that
/// changes something adds that the change may still complete.
fn no_answer(sock: &str, method: &Method, path: &str, bound: std::time::Duration) -> Error {
    let change = if method == Method::GET {
        ""
    } else {
        "; the change it was asked for may still complete: read it back"
    };
    Error::unavailable(format!(
        "agent at {sock}: no answer to {path} within {bound:?} (is it stopped or \
         overloaded?{change})"
    ))
}

/// The JSON body of a request to `path`.
fn encode_body(path: &str, body: &(impl Serialize + ?Sized)) -> Result<Vec<u8>, Error> {
    serde_json::to_vec(body)
        .map_err(|e| Error::internal(format!("cannot encode request for {path}: {e}")))
}

/// A 2xx reply's body decoded into `T` (an empty body is `null`, for `()`).
fn decode_reply<T: DeserializeOwned>(path: &str, bytes: &[u8]) -> Result<T, Error> {
    let bytes = if bytes.is_empty() { b"null" } else { bytes };
    serde_json::from_slice(bytes)
        .map_err(|e| Error::internal(format!("agent reply for {path} does not decode: {e}")))
}

/// The largest reply body a client reads (a list of the most VMs a host holds is a few MiB):
/// a peer that sends more is an error, never the client's memory.
pub const REPLY_LIMIT_BYTES: usize = 64 * 1024 * 1024;

/// The longest line of the event stream a client holds (an event is a few hundred bytes).
pub const EVENT_LINE_LIMIT_BYTES: usize = 1024 * 1024;

/// The error of an exchange that failed once connected: `what` failed with `e`, and the
/// likely cause where hyper's error tells it.
fn exchange_failed(sock: &str, what: &str, e: &hyper::Error) -> Error {
    let cause = if e.is_canceled() || e.is_incomplete_message() || e.is_closed() {
        " (the agent closed the connection before its whole answer: at its connection limit, \
         restarting or stopped)"
    } else {
        ""
    };
    Error::unavailable(format!("agent at {sock}: {what}: {e}{cause}"))
}

/// The error of a reply body that could not be read whole (too large, or cut short).
fn reply_failed(sock: &str, e: &(dyn std::error::Error + 'static)) -> Error {
    if e.is::<http_body_util::LengthLimitError>() {
        return Error::unavailable(format!(
            "agent at {sock}: the reply is larger than {REPLY_LIMIT_BYTES} bytes"
        ));
    }
    match e.downcast_ref::<hyper::Error>() {
        Some(h) => exchange_failed(sock, "reading the reply failed", h),
        None => Error::unavailable(format!("agent at {sock}: reading the reply failed: {e}")),
    }
}

/// The error of a request that cannot be made of `path` (too long for a request line): the
/// caller's input, named by its first characters.
fn unbuildable(path: &str, e: &impl std::fmt::Display) -> Error {
    let shown: String = path.chars().take(80).collect();
    let more = if shown.len() < path.len() { "…" } else { "" };
    Error::invalid(format!(
        "cannot make a request of {shown}{more} ({} bytes): {e}",
        path.len()
    ))
}

/// The error of a connection to the agent's socket that failed, with the likely cause where
/// the error tells it.
fn unreachable_agent(sock: &str, e: &std::io::Error) -> Error {
    use std::io::ErrorKind;
    let hint = match e.kind() {
        ErrorKind::NotFound | ErrorKind::ConnectionRefused => " (is `vmnet serve` running?)",
        // A unix socket's queue of connections not yet accepted is full.
        ErrorKind::WouldBlock => {
            " (its queue of new connections is full: is it stopped or overloaded?)"
        }
        ErrorKind::PermissionDenied => " (the API socket is for root and `--socket-group` only)",
        _ => "",
    };
    Error::unavailable(format!("cannot reach the agent at {sock}: {e}{hint}"))
}

fn decode_error(status: StatusCode, path: &str, bytes: &[u8]) -> Error {
    match serde_json::from_slice::<ErrorBody>(bytes) {
        Ok(b) => b.error,
        Err(_) => Error::internal(format!(
            "agent answered {status} for {path} with an undocumented body: {}",
            String::from_utf8_lossy(bytes)
        )),
    }
}

impl Client {
    /// A client for the agent listening on `socket`.
    #[must_use]
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Self {
            socket: socket.into(),
            timeout: REQUEST_TIMEOUT,
        }
    }

    /// The same client with another bound on each request than [`REQUEST_TIMEOUT`].
    #[must_use]
    pub fn with_timeout(mut self, timeout: std::time::Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The socket path this client talks to.
    #[must_use]
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Sends one request with an optional JSON body and returns the status and raw body.
    ///
    /// # Errors
    /// `UNAVAILABLE` when the socket cannot be reached or the exchange fails.
    pub async fn send_raw(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(StatusCode, Bytes), Error> {
        let sock = self.socket.display().to_string();
        let unanswered = no_answer(&sock, &method, path, self.timeout);
        let exchange = async {
            let (status, body, conn_task) = self.open(method, path, body).await?;
            let _abort = AbortOnDrop(conn_task);
            let bytes = http_body_util::Limited::new(body, REPLY_LIMIT_BYTES)
                .collect()
                .await
                .map_err(|e| reply_failed(&sock, &*e))?
                .to_bytes();
            Ok((status, bytes))
        };
        tokio::time::timeout(self.timeout, exchange)
            .await
            .unwrap_or(Err(unanswered))
    }

    /// Sends one request; returns the status, the body as it arrives, and the connection's task
    /// (abort it when done).
    async fn open(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(StatusCode, Incoming, tokio::task::JoinHandle<()>), Error> {
        let sock = self.socket.display().to_string();
        let stream = UnixStream::connect(&self.socket)
            .await
            .map_err(|e| unreachable_agent(&sock, &e))?;
        let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| exchange_failed(&sock, "handshake failed", &e))?;
        let conn_task = tokio::spawn(async move {
            let _ = conn.await;
        });
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header("host", "vmnet-agent");
        let payload = match body {
            Some(b) => {
                req = req.header("content-type", "application/json");
                Bytes::from(b)
            }
            None => Bytes::new(),
        };
        let req = req
            .body(Full::new(payload))
            .map_err(|e| unbuildable(path, &e))?;
        let resp = tx
            .send_request(req)
            .await
            .map_err(|e| exchange_failed(&sock, &format!("request {path} failed"), &e))?;
        Ok((resp.status(), resp.into_body(), conn_task))
    }

    /// `GET /v1/events?{query}`: calls `line` with each line of the stream as it arrives
    /// (without its newline) until the stream ends or `line` returns `false`.
    ///
    /// # Errors
    /// The API's documented error (a bad filter is `INVALID_INPUT`); `UNAVAILABLE` when the
    /// agent cannot be reached or the stream breaks off mid-line.
    pub async fn events_lines(
        &self,
        query: &str,
        mut line: impl FnMut(&str) -> bool,
    ) -> Result<(), Error> {
        let path = format!("/v1/events?{query}");
        let sock = self.socket.display().to_string();
        // The stream itself may stay quiet for as long as nothing happens; its head may not.
        let (status, mut body, conn_task) =
            tokio::time::timeout(self.timeout, self.open(Method::GET, &path, None))
                .await
                .unwrap_or_else(|_| Err(no_answer(&sock, &Method::GET, &path, self.timeout)))?;
        let _abort = AbortOnDrop(conn_task);
        if !status.is_success() {
            let bytes = http_body_util::Limited::new(body, REPLY_LIMIT_BYTES)
                .collect()
                .await
                .map_err(|e| reply_failed(&sock, &*e))?
                .to_bytes();
            return Err(decode_error(status, &path, &bytes));
        }
        let mut pending: Vec<u8> = Vec::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| {
                Error::unavailable(format!("{path}: the event stream broke off: {e}"))
            })?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            // Only the new bytes are searched for line ends.
            let mut from = pending.len();
            pending.extend_from_slice(&data);
            while let Some(n) = pending[from..].iter().position(|b| *b == b'\n') {
                let end = from + n;
                let text = String::from_utf8_lossy(&pending[..end]).into_owned();
                pending.drain(..=end);
                from = 0;
                if !line(&text) {
                    return Ok(());
                }
            }
            if pending.len() > EVENT_LINE_LIMIT_BYTES {
                return Err(Error::unavailable(format!(
                    "agent at {sock}: {path}: a line of the event stream is longer than \
                     {EVENT_LINE_LIMIT_BYTES} bytes"
                )));
            }
        }
        if !pending.is_empty() {
            return Err(Error::unavailable(format!(
                "{path}: the event stream ended in the middle of a line"
            )));
        }
        Ok(())
    }

    /// The kept events matching `query` (`GET /v1/events?{query}`, without `follow`).
    ///
    /// # Errors
    /// As [`Client::events_lines`]; `INTERNAL` when a line does not decode.
    pub async fn recent_events(&self, query: &str) -> Result<Vec<Event>, Error> {
        let mut out = Vec::new();
        let mut bad = None;
        self.events_lines(query, |l| match serde_json::from_str(l) {
            Ok(e) => {
                out.push(e);
                true
            }
            Err(e) => {
                bad = Some(format!("an event does not decode ({e}): {l}"));
                false
            }
        })
        .await?;
        match bad {
            Some(b) => Err(Error::internal(b)),
            None => Ok(out),
        }
    }

    /// Sends a request and decodes a 2xx JSON reply into `T` (use `()` for an empty reply).
    ///
    /// # Errors
    /// The API's documented error on a non-2xx status; `UNAVAILABLE` when the agent cannot be
    /// reached; `INTERNAL` when a reply does not decode.
    pub async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&(impl Serialize + ?Sized)>,
    ) -> Result<T, Error> {
        let body = body.map(|b| encode_body(path, b)).transpose()?;
        let (status, bytes) = self.send_raw(method, path, body).await?;
        if !status.is_success() {
            return Err(decode_error(status, path, &bytes));
        }
        decode_reply(path, &bytes)
    }

    /// `GET path`.
    ///
    /// # Errors
    /// As [`Client::call`].
    pub async fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T, Error> {
        self.call(Method::GET, path, None::<&()>).await
    }

    /// `PUT path` with a JSON body.
    ///
    /// # Errors
    /// As [`Client::call`].
    pub async fn put<T: DeserializeOwned>(
        &self,
        path: &str,
        body: &(impl Serialize + ?Sized),
    ) -> Result<T, Error> {
        self.call(Method::PUT, path, Some(body)).await
    }

    /// `POST path` with a JSON body (or none).
    ///
    /// # Errors
    /// As [`Client::call`].
    pub async fn post<T: DeserializeOwned>(
        &self,
        path: &str,
        body: Option<&(impl Serialize + ?Sized)>,
    ) -> Result<T, Error> {
        self.call(Method::POST, path, body).await
    }

    /// `DELETE path`.
    ///
    /// # Errors
    /// As [`Client::call`].
    pub async fn delete<T: DeserializeOwned>(&self, path: &str) -> Result<T, Error> {
        self.call(Method::DELETE, path, None::<&()>).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_are_escaped() {
        assert_eq!(segment("vm-7"), "vm-7");
        assert_eq!(segment("a/b c"), "a%2Fb%20c");
        assert_eq!(segment("x;rm -rf"), "x%3Brm%20-rf");
    }
}
