//! One GET against a provider's API: the pool's `Authorization` header, a per-request timeout,
//! `429 Too Many Requests` retried after `Retry-After`, and the body parsed into a typed struct
//! (serde; unknown fields are ignored, as both providers add fields within a version).
//!
//! # Retry-After
//! The header's seconds (`Retry-After: 3`) or HTTP date are honoured: the request is sent again
//! after that wait, up to [`HttpSettings::rate_limit_attempts`] attempts in all, as long as the
//! wait is at most [`HttpSettings::max_retry_wait`]. A longer wait, or a provider that keeps
//! answering 429, fails the poll with [`PollError::RateLimited`]; the poller then waits at least
//! that long before the pool's next poll. Without the header the wait is 1 second.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use reqwest::StatusCode;
use reqwest::header::{AUTHORIZATION, HeaderValue, RETRY_AFTER};
use serde::de::DeserializeOwned;

use super::PollError;

/// How requests are sent.
#[derive(Debug, Clone)]
pub struct HttpSettings {
    /// The timeout of one request, from sending it to the whole body read (default 10 s).
    pub request_timeout: Duration,
    /// The connect timeout (default 5 s).
    pub connect_timeout: Duration,
    /// Attempts of one request while the provider answers 429, the first included (default 3).
    pub rate_limit_attempts: u32,
    /// The longest `Retry-After` waited for within one poll (default 30 s).
    pub max_retry_wait: Duration,
    /// Requests of one poll in flight at once (Hetzner pages, Proxmox guest agents; default 4).
    pub concurrency: usize,
}

impl Default for HttpSettings {
    fn default() -> Self {
        Self {
            request_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            rate_limit_attempts: 3,
            max_retry_wait: Duration::from_secs(30),
            concurrency: 4,
        }
    }
}

/// A client for one poll: the HTTP client, the pool's `Authorization` header and a request
/// counter.
#[derive(Debug)]
pub struct Api {
    client: reqwest::Client,
    auth: HeaderValue,
    settings: HttpSettings,
    requests: AtomicU64,
}

impl Api {
    /// A client sending `authorization` (e.g. `Bearer …`) with every request. The header value
    /// is marked sensitive (never printed by the HTTP stack).
    ///
    /// # Errors
    /// [`PollError::Credentials`] when the value cannot be a header (a control character in
    /// the secret; `source` names where it came from); [`PollError::Unreachable`] when the
    /// HTTP client cannot be built (no TLS roots).
    pub fn new(
        client: reqwest::Client,
        authorization: &str,
        source: &str,
        settings: HttpSettings,
    ) -> Result<Self, PollError> {
        let mut auth = HeaderValue::from_str(authorization).map_err(|_| {
            PollError::Credentials(format!(
                "credentials {source} hold characters an HTTP header cannot carry"
            ))
        })?;
        auth.set_sensitive(true);
        Ok(Self {
            client,
            auth,
            settings,
            requests: AtomicU64::new(0),
        })
    }

    /// The HTTP client every poll shares: rustls with the Mozilla roots, the timeouts of
    /// `settings`, no redirects followed (the documented endpoints answer directly; a `3xx` is
    /// a [`PollError::Status`], and the token never follows a redirect elsewhere), no proxy.
    ///
    /// # Errors
    /// [`PollError::Unreachable`] when it cannot be built.
    pub fn client(settings: &HttpSettings) -> Result<reqwest::Client, PollError> {
        reqwest::Client::builder()
            .timeout(settings.request_timeout)
            .connect_timeout(settings.connect_timeout)
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .user_agent(concat!("vmnet/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| PollError::Unreachable {
                what: "the HTTP client".into(),
                why: vmnet_model::error::chain(&e),
            })
    }

    /// The settings.
    #[must_use]
    pub fn settings(&self) -> &HttpSettings {
        &self.settings
    }

    /// Requests sent so far (429 retries included).
    #[must_use]
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// GETs `url` and parses the body as `T`.
    ///
    /// # Errors
    /// Every [`PollError`] but `Credentials`: `Auth` for 401/403, `RateLimited` when 429
    /// persists, `Status` for other unsuccessful answers, `Timeout`, `Unreachable`, and
    /// `Malformed` when the body is not `T`'s JSON.
    pub async fn get<T: DeserializeOwned>(&self, url: &str) -> Result<T, PollError> {
        let what = format!("GET {url}");
        let mut attempt = 0;
        loop {
            attempt += 1;
            self.requests.fetch_add(1, Ordering::Relaxed);
            let sent = self
                .client
                .get(url)
                .header(AUTHORIZATION, self.auth.clone())
                .send()
                .await;
            let resp = sent.map_err(|e| self.transport(&what, e))?;
            let status = resp.status();
            if status == StatusCode::TOO_MANY_REQUESTS {
                let wait = retry_after(resp.headers().get(RETRY_AFTER));
                if attempt < self.settings.rate_limit_attempts
                    && wait <= self.settings.max_retry_wait
                {
                    tracing::debug!(%what, wait_ms = wait.as_millis(), "429: waiting as Retry-After asks");
                    tokio::time::sleep(wait).await;
                    continue;
                }
                return Err(PollError::RateLimited {
                    what,
                    retry_after_secs: wait.as_secs() + u64::from(wait.subsec_nanos() > 0),
                });
            }
            if matches!(status, StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN) {
                return Err(PollError::Auth {
                    what,
                    status: status.as_u16(),
                });
            }
            if !status.is_success() {
                return Err(PollError::Status {
                    what,
                    status: status.as_u16(),
                });
            }
            let body = resp.bytes().await.map_err(|e| self.transport(&what, e))?;
            return serde_json::from_slice(&body).map_err(|e| PollError::Malformed {
                what,
                why: e.to_string(),
            });
        }
    }

    fn transport(&self, what: &str, e: reqwest::Error) -> PollError {
        if e.is_timeout() {
            PollError::Timeout {
                what: what.to_owned(),
                timeout_ms: u64::try_from(self.settings.request_timeout.as_millis())
                    .unwrap_or(u64::MAX),
            }
        } else {
            // reqwest's words name the URL (no secret: api_url has no user part) and the cause.
            PollError::Unreachable {
                what: what.to_owned(),
                why: vmnet_model::error::chain(&e.without_url()),
            }
        }
    }
}

/// The wait a `Retry-After` header asks for: its seconds, or the time until its HTTP date; 1 s
/// when absent or unreadable.
fn retry_after(h: Option<&HeaderValue>) -> Duration {
    let Some(s) = h.and_then(|v| v.to_str().ok()).map(str::trim) else {
        return Duration::from_secs(1);
    };
    if let Ok(secs) = s.parse::<u64>() {
        return Duration::from_secs(secs);
    }
    match httpdate::parse_http_date(s) {
        Ok(t) => t
            .duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO),
        Err(_) => Duration::from_secs(1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_reads_seconds_and_dates() {
        let v = |s: &str| Some(HeaderValue::from_str(s).unwrap());
        assert_eq!(retry_after(None), Duration::from_secs(1));
        assert_eq!(retry_after(v("3").as_ref()), Duration::from_secs(3));
        assert_eq!(retry_after(v("soon").as_ref()), Duration::from_secs(1));
        assert_eq!(
            retry_after(v("Wed, 21 Oct 2015 07:28:00 GMT").as_ref()),
            Duration::ZERO
        );
        let later = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(120));
        let d = retry_after(v(&later).as_ref());
        assert!(
            d > Duration::from_secs(110) && d <= Duration::from_secs(120),
            "{d:?}"
        );
    }
}
