//! Who sends a poll's HTTP requests and parses the answers: [`Fetcher`]. The agent's poller
//! hands every job to the unprivileged metadata worker ([`crate::worker`]), which runs
//! [`Direct`] (the Hetzner Cloud and Proxmox VE clients) away from the root process; the
//! worker's answer comes back as data the agent checks before it writes anything.

use futures::future::BoxFuture;
use secrecy::{ExposeSecret, SecretString};
use vmnet_model::pool::{Machine, Provider};

use super::http::{Api, HttpSettings};
use super::{PollError, PollReport};

/// One poll's work for the fetcher: the pool's provider and API, the ready `Authorization`
/// header value, the machines, and how to send the requests.
pub struct FetchJob {
    /// The provider.
    pub provider: Provider,
    /// The pool's API base URL (checked against the agent's rules before the job is made).
    pub api_url: String,
    /// The `Authorization` header value (`Bearer …`, `PVEAPIToken=…`). Redacted in `Debug`,
    /// zeroed when dropped.
    pub authorization: SecretString,
    /// The pool's machines, `(instance id, machine)`.
    pub machines: Vec<(String, Machine)>,
    /// Timeouts, 429 retries, concurrency.
    pub http: HttpSettings,
}

impl std::fmt::Debug for FetchJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FetchJob")
            .field("provider", &self.provider)
            .field("api_url", &self.api_url)
            .field("authorization", &"..")
            .field("machines", &self.machines.len())
            .finish_non_exhaustive()
    }
}

/// A failed poll: the error and the HTTP requests it sent.
pub type FetchError = (PollError, u64);

/// Performs one poll's requests.
pub trait Fetcher: Send + Sync + std::fmt::Debug {
    /// Sends `job`'s requests and parses the answers.
    ///
    /// # Errors
    /// The poll's failure and the requests it sent.
    fn fetch(&self, job: FetchJob) -> BoxFuture<'_, Result<PollReport, FetchError>>;
}

/// The provider clients in this process (the worker's own fetcher; tests use it too).
#[derive(Debug, Clone)]
pub struct Direct {
    client: reqwest::Client,
}

impl Direct {
    /// A fetcher with one HTTP client built for `settings` (rustls, no redirects, no proxy).
    ///
    /// # Errors
    /// [`PollError::Unreachable`] when the client cannot be built.
    pub fn new(settings: &HttpSettings) -> Result<Self, PollError> {
        Ok(Self {
            client: Api::client(settings)?,
        })
    }
}

impl Fetcher for Direct {
    fn fetch(&self, job: FetchJob) -> BoxFuture<'_, Result<PollReport, FetchError>> {
        Box::pin(async move {
            let api = Api::new(
                self.client.clone(),
                job.authorization.expose_secret(),
                "of the pool",
                job.http.clone(),
            )
            .map_err(|e| (e, 0))?;
            let r = match job.provider {
                Provider::HetznerCloud => {
                    super::hetzner::poll(&api, &job.api_url, &job.machines).await
                }
                Provider::ProxmoxVe => {
                    super::proxmox::poll(&api, &job.api_url, &job.machines).await
                }
            };
            r.map_err(|e| (e, api.requests()))
        })
    }
}
