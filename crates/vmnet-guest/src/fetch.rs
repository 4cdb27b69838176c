//! Reading the metadata service over HTTP/1.1 keep-alive: one connection kept open and reused
//! for every request (a new one only when the service closed it or a request on it failed), a
//! session token (MMDS version 2) fetched once and reused until a minute before it expires (or
//! until the service refuses it), bodies capped at [`MAX_BODY_BYTES`].
//!
//! A poll is one request: `GET /latest/meta-data` with `Accept: application/json` returns the
//! whole folder (`mesh-ipv6`, `host-routes`, …) as one JSON object, so a guest polling every
//! 250 ms makes 4 requests a second over one connection.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;
use hyper::client::conn::http1::SendRequest;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;

use crate::doc::MAX_VALUE_BYTES;

/// The token lifetime asked for, seconds.
pub const TOKEN_TTL_SECS: u64 = 21_600;
/// How long before its expiry a token is renewed, seconds.
pub const TOKEN_RENEW_BEFORE_SECS: u64 = 60;
/// How long one request may take, connect included.
pub const REQUEST_TIMEOUT: Duration = Duration::from_millis(1000);
/// The largest body read: twice the document cap, since JSON escapes each newline of a value
/// as two bytes.
pub const MAX_BODY_BYTES: usize = 2 * MAX_VALUE_BYTES;

/// Where the document comes from; faked in tests.
pub trait Fetch {
    /// The JSON form of the folder at `path` (e.g. `/latest/meta-data`), as text.
    ///
    /// # Errors
    /// A message for a failed connection, a status other than 200, a body over the cap or cut
    /// short.
    fn fetch(&mut self, path: &str) -> impl Future<Output = Result<String, String>>;
}

/// The metadata service at an address.
#[derive(Debug)]
pub struct Mmds {
    addr: SocketAddr,
    token: Option<(String, Instant)>,
    conn: Option<SendRequest<Empty<Bytes>>>,
    /// Connections opened so far (the first one included).
    pub connects: u64,
}

impl Mmds {
    /// A client of the service at `addr` (normally `169.254.169.254:80`).
    #[must_use]
    pub fn new(addr: SocketAddr) -> Self {
        Self {
            addr,
            token: None,
            conn: None,
            connects: 0,
        }
    }

    /// The open connection, or a new one.
    async fn connection(&mut self) -> Result<&mut SendRequest<Empty<Bytes>>, String> {
        if let Some(c) = self.conn.take()
            && !c.is_closed()
        {
            return Ok(self.conn.insert(c));
        }
        let stream = tokio::net::TcpStream::connect(self.addr)
            .await
            .map_err(|e| format!("connect {}: {e}", self.addr))?;
        let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        tokio::spawn(conn);
        self.connects += 1;
        Ok(self.conn.insert(send))
    }

    /// One request on the kept connection (or a new one), no retry.
    async fn once(
        &mut self,
        method: &Method,
        path: &str,
        headers: &[(&str, &str)],
    ) -> Result<(StatusCode, Bytes), String> {
        let host = self.addr.ip().to_string();
        let send = self.connection().await?;
        send.ready()
            .await
            .map_err(|e| format!("{method} {path}: {e}"))?;
        let mut b = Request::builder()
            .method(method.clone())
            .uri(path)
            .header("host", host);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let req = b
            .body(Empty::<Bytes>::new())
            .map_err(|e| format!("request: {e}"))?;
        let resp = send
            .send_request(req)
            .await
            .map_err(|e| format!("{method} {path}: {e}"))?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), MAX_BODY_BYTES)
            .collect()
            .await
            .map_err(|e| {
                format!("{path}: body larger than {MAX_BODY_BYTES} bytes or cut short: {e}")
            })?
            .to_bytes();
        Ok((status, body))
    }

    /// One request; when it fails on a connection opened earlier (the service closed it, e.g.
    /// at the end of its lifetime), once more on a new connection.
    async fn request(
        &mut self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
    ) -> Result<(StatusCode, Bytes), String> {
        let reused = self.conn.as_ref().is_some_and(|c| !c.is_closed());
        let first = tokio::time::timeout(REQUEST_TIMEOUT, self.once(&method, path, headers))
            .await
            .unwrap_or_else(|_| Err(format!("{path}: no answer within {REQUEST_TIMEOUT:?}")));
        match first {
            Ok(r) => Ok(r),
            Err(e) => {
                self.conn = None;
                if !reused {
                    return Err(e);
                }
                let again =
                    tokio::time::timeout(REQUEST_TIMEOUT, self.once(&method, path, headers))
                        .await
                        .unwrap_or_else(|_| {
                            Err(format!("{path}: no answer within {REQUEST_TIMEOUT:?}"))
                        });
                if again.is_err() {
                    self.conn = None;
                }
                again
            }
        }
    }

    async fn renew_token(&mut self) -> Result<(), String> {
        let ttl = TOKEN_TTL_SECS.to_string();
        let (status, body) = self
            .request(
                Method::PUT,
                "/latest/api/token",
                &[("x-metadata-token-ttl-seconds", &ttl)],
            )
            .await?;
        if status != StatusCode::OK {
            return Err(format!("token: {status}"));
        }
        let t = String::from_utf8(body.to_vec()).map_err(|_| "token: not UTF-8".to_owned())?;
        let until = Instant::now() + Duration::from_secs(TOKEN_TTL_SECS - TOKEN_RENEW_BEFORE_SECS);
        self.token = Some((t, until));
        Ok(())
    }
}

impl Fetch for Mmds {
    async fn fetch(&mut self, path: &str) -> Result<String, String> {
        if self
            .token
            .as_ref()
            .is_none_or(|(_, until)| Instant::now() >= *until)
        {
            self.renew_token().await?;
        }
        let mut retried = false;
        loop {
            let token = self
                .token
                .as_ref()
                .map(|(t, _)| t.clone())
                .unwrap_or_default();
            let (status, body) = self
                .request(
                    Method::GET,
                    path,
                    &[("x-metadata-token", &token), ("accept", "application/json")],
                )
                .await?;
            match status {
                StatusCode::OK => {
                    return String::from_utf8(body.to_vec())
                        .map_err(|_| format!("{path}: not UTF-8"));
                }
                // The service restarted or the token expired early: one new token, once.
                StatusCode::UNAUTHORIZED if !retried => {
                    retried = true;
                    self.renew_token().await?;
                }
                s => return Err(format!("{path}: {s}")),
            }
        }
    }
}
