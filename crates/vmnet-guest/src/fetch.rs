//! Reading values from the metadata service over HTTP/1.1: one connection per request
//! (`Connection: close`), a session token (MMDS version 2) fetched first and renewed before it
//! expires or when refused, bodies capped at [`MAX_VALUE_BYTES`].

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;

use crate::doc::MAX_VALUE_BYTES;

/// The token lifetime asked for, seconds.
pub const TOKEN_TTL_SECS: u64 = 21_600;
/// How long one request may take, connect included.
pub const REQUEST_TIMEOUT: Duration = Duration::from_millis(1000);

/// Where values come from; faked in tests.
pub trait Fetch {
    /// The value at `path` (e.g. `/latest/meta-data/mesh-ipv6`).
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
}

impl Mmds {
    /// A client of the service at `addr` (normally `169.254.169.254:80`).
    #[must_use]
    pub fn new(addr: SocketAddr) -> Self {
        Self { addr, token: None }
    }

    async fn request(
        &self,
        method: Method,
        path: &str,
        header: Option<(&str, &str)>,
    ) -> Result<(StatusCode, Bytes), String> {
        let work = async {
            let stream = tokio::net::TcpStream::connect(self.addr)
                .await
                .map_err(|e| format!("connect {}: {e}", self.addr))?;
            let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .map_err(|e| format!("handshake: {e}"))?;
            tokio::spawn(conn);
            let mut b = Request::builder()
                .method(method)
                .uri(path)
                .header("host", self.addr.ip().to_string())
                .header("connection", "close");
            if let Some((k, v)) = header {
                b = b.header(k, v);
            }
            let req = b
                .body(Empty::<Bytes>::new())
                .map_err(|e| format!("request: {e}"))?;
            let resp = send
                .send_request(req)
                .await
                .map_err(|e| format!("GET {path}: {e}"))?;
            let status = resp.status();
            let body = Limited::new(resp.into_body(), MAX_VALUE_BYTES)
                .collect()
                .await
                .map_err(|e| {
                    format!("{path}: body larger than {MAX_VALUE_BYTES} bytes or cut short: {e}")
                })?
                .to_bytes();
            Ok((status, body))
        };
        tokio::time::timeout(REQUEST_TIMEOUT, work)
            .await
            .map_err(|_| format!("{path}: no answer within {REQUEST_TIMEOUT:?}"))?
    }

    async fn renew_token(&mut self) -> Result<(), String> {
        let ttl = TOKEN_TTL_SECS.to_string();
        let (status, body) = self
            .request(
                Method::PUT,
                "/latest/api/token",
                Some(("x-metadata-token-ttl-seconds", &ttl)),
            )
            .await?;
        if status != StatusCode::OK {
            return Err(format!("token: {status}"));
        }
        let t = String::from_utf8(body.to_vec()).map_err(|_| "token: not UTF-8".to_owned())?;
        // Renew a minute before it expires.
        let until = Instant::now() + Duration::from_secs(TOKEN_TTL_SECS - 60);
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
                .request(Method::GET, path, Some(("x-metadata-token", &token)))
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
