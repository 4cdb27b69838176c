//! The poller: every provider pool in the store polled every `poll_interval_secs`
//! (`vmnet serve --poll-providers`).
//!
//! # Design
//! - Each round (every [`PollerSettings::tick`]) reads the provider pools from the store, so a
//!   pool set through the API is polled from the next round on, and a pool that is gone is
//!   forgotten. A pool is polled when its next poll is due and no poll of it is running; pools
//!   are polled concurrently, each in its own task.
//! - One poll ([`Poller::poll_pool`]): read the pool's machines, read the secret, list the
//!   provider's machines (see [`super::hetzner`], [`super::proxmox`]), then write every machine's
//!   addresses in one transaction ([`vmnet_ipam::record_poll`]): replaced, never appended. A
//!   failed poll writes nothing but `stale` on every machine of the pool
//!   ([`vmnet_ipam::mark_pool_stale`]): the last good addresses stay, marked stale, and the
//!   failure shows in `GET /v1/status` (`provider_pools`, state `failing`, or `auth_failed` for
//!   unreadable or refused credentials) — never as an empty address list.
//! - After a poll the next is due one interval later; after `429` whose `Retry-After` is longer
//!   than the interval, that much later.
//!
//! # Limitations
//! - One poller per store: agents sharing a PostgreSQL store should run `--poll-providers` on
//!   one of them only, or each poll multiplies the provider's request count (the writes are the
//!   same and do no harm).
//! - The status lives in the agent's memory; it starts again at `pending` with every restart.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use secrecy::SecretString;
use vmnet_ipam::Db;
use vmnet_model::pool::{Provider, ProviderPool, ProviderRules};
use zeroize::Zeroizing;

use super::fetch::{FetchJob, Fetcher};
use super::http::HttpSettings;
use super::{PollError, PollReport, ProviderPoolState, ProviderPoolStatus, Secret};
use crate::status::now_ms;

/// How the poller works.
#[derive(Debug, Clone)]
pub struct PollerSettings {
    /// The requests (timeouts, 429 retries, concurrency).
    pub http: HttpSettings,
    /// How often the poller looks for due pools (default 1 s).
    pub tick: Duration,
}

impl Default for PollerSettings {
    fn default() -> Self {
        Self {
            http: HttpSettings::default(),
            tick: Duration::from_secs(1),
        }
    }
}

/// The most instance ids [`ProviderPoolStatus::missing`] lists.
pub const MAX_MISSING_SHOWN: usize = 20;

#[derive(Debug)]
struct Entry {
    status: ProviderPoolStatus,
    due: Option<Instant>,
    running: bool,
    /// Polls that failed (state `failing` or `auth_failed`) since the agent started.
    failures: u64,
}

/// One pool's poll counts since the agent started (the metrics).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PollCounts {
    /// The pool.
    pub pool_id: String,
    /// Its provider.
    pub provider: Provider,
    /// Polls finished.
    pub polls: u64,
    /// Polls that failed (every machine kept its last good addresses, marked stale).
    pub failures: u64,
}

/// The poller of one agent.
#[derive(Debug)]
pub struct Poller {
    db: Db,
    settings: PollerSettings,
    fetcher: Arc<dyn Fetcher>,
    rules: ProviderRules,
    pools: Mutex<BTreeMap<String, Entry>>,
    /// The agent's event bus, for failed polls ([`crate::agent::Agent::set_providers`]).
    pub(crate) events: std::sync::OnceLock<crate::events::Events>,
}

fn fresh(pool: &ProviderPool) -> ProviderPoolStatus {
    ProviderPoolStatus {
        pool_id: pool.pool_id.clone(),
        provider: pool.provider,
        state: ProviderPoolState::Pending,
        polls: 0,
        consecutive_failures: 0,
        last_poll_at_unix_ms: None,
        last_success_at_unix_ms: None,
        last_duration_ms: None,
        last_requests: 0,
        machines: 0,
        missing: Vec::new(),
        last_error_kind: None,
        last_error: None,
        next_poll_at_unix_ms: None,
    }
}

/// A Proxmox VE API token is `USER@REALM!TOKENID=SECRET`.
fn proxmox_token(s: &Secret, source: &str) -> Result<Zeroizing<String>, PollError> {
    let t = s.expose();
    let ok = t.split_once('!').is_some_and(|(user, rest)| {
        user.contains('@')
            && rest
                .split_once('=')
                .is_some_and(|(id, secret)| !id.is_empty() && !secret.is_empty())
    });
    if !ok {
        return Err(PollError::Credentials(format!(
            "credentials {source} are not a Proxmox VE API token (USER@REALM!TOKENID=SECRET)"
        )));
    }
    Ok(Zeroizing::new(format!("PVEAPIToken={t}")))
}

impl Poller {
    /// A poller over `db` whose requests `fetcher` sends (the metadata worker in the agent),
    /// reading secrets and checking pools under `rules`.
    #[must_use]
    pub fn new(
        db: Db,
        settings: PollerSettings,
        fetcher: Arc<dyn Fetcher>,
        rules: ProviderRules,
    ) -> Arc<Self> {
        Arc::new(Self {
            db,
            settings,
            fetcher,
            rules,
            pools: Mutex::new(BTreeMap::new()),
            events: std::sync::OnceLock::new(),
        })
    }

    /// Every polled pool's poll counts, by pool id.
    #[must_use]
    pub fn counts(&self) -> Vec<PollCounts> {
        self.pools
            .lock()
            .map(|m| {
                m.values()
                    .map(|e| PollCounts {
                        pool_id: e.status.pool_id.clone(),
                        provider: e.status.provider,
                        polls: e.status.polls,
                        failures: e.failures,
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Every polled pool's status, by pool id.
    #[must_use]
    pub fn status(&self) -> Vec<ProviderPoolStatus> {
        self.pools
            .lock()
            .map(|m| m.values().map(|e| e.status.clone()).collect())
            .unwrap_or_default()
    }

    /// Polls `pool` once and records the result (store and status); returns the status.
    pub async fn poll_pool(&self, pool: &ProviderPool) -> ProviderPoolStatus {
        let started = Instant::now();
        let machines = vmnet_ipam::transaction!(&self.db, tx => vmnet_ipam::provider_machines(tx, &pool.pool_id).await);
        let outcome = match machines {
            Ok(machines) => {
                let (n, r) = (machines.len(), self.fetch(pool, &machines).await);
                Ok((n, r))
            }
            Err(e) => Err(format!("store: {}", vmnet_model::error::chain(&e))),
        };
        let at = now_ms();
        let written = match &outcome {
            // A machine whose own call failed has no addresses in the report: it stays stale.
            Ok((_, Ok(report))) => {
                let results = &report.results;
                vmnet_ipam::transaction!(&self.db, tx => vmnet_ipam::record_poll(tx, &pool.pool_id, at, results).await).map(|_| ())
            }
            Ok((_, Err(_))) => vmnet_ipam::transaction!(&self.db, tx => vmnet_ipam::mark_pool_stale(tx, &pool.pool_id).await).map(|_| ()),
            Err(_) => Ok(()),
        };
        let elapsed = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        let mut guard = self
            .pools
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let entry = guard.entry(pool.pool_id.clone()).or_insert_with(|| Entry {
            status: fresh(pool),
            due: None,
            running: false,
            failures: 0,
        });
        let st = &mut entry.status;
        st.provider = pool.provider;
        st.polls += 1;
        st.last_poll_at_unix_ms = Some(at);
        st.last_duration_ms = Some(elapsed);
        let mut wait = Duration::from_secs(u64::from(pool.poll_interval_secs));
        let failure: Option<(ProviderPoolState, &'static str, String)> = match &outcome {
            Err(store) => Some((ProviderPoolState::Failing, "store", store.clone())),
            Ok((n, r)) => {
                st.machines = u64::try_from(*n).unwrap_or(u64::MAX);
                match r {
                    Ok(report) => {
                        st.last_requests = report.requests;
                        st.missing = report
                            .missing
                            .iter()
                            .take(MAX_MISSING_SHOWN)
                            .cloned()
                            .collect();
                        match report.errors.first() {
                            None => None,
                            Some((id, e)) => Some((
                                if e.is_auth() {
                                    ProviderPoolState::AuthFailed
                                } else {
                                    ProviderPoolState::Degraded
                                },
                                e.kind(),
                                format!(
                                    "{} of {} machines failed; instance {id}: {e}",
                                    report.errors.len(),
                                    n
                                ),
                            )),
                        }
                    }
                    Err((e, requests)) => {
                        st.last_requests = *requests;
                        if let PollError::RateLimited {
                            retry_after_secs, ..
                        } = e
                        {
                            wait = wait.max(Duration::from_secs(*retry_after_secs));
                        }
                        let state = if e.is_auth() {
                            ProviderPoolState::AuthFailed
                        } else {
                            ProviderPoolState::Failing
                        };
                        Some((state, e.kind(), e.to_string()))
                    }
                }
            }
        };
        let failure = match (failure, written) {
            (f, Ok(())) => f,
            (_, Err(e)) => Some((
                ProviderPoolState::Failing,
                "store",
                format!("store: {}", vmnet_model::error::chain(&e)),
            )),
        };
        match failure {
            None => {
                st.state = ProviderPoolState::Ok;
                st.consecutive_failures = 0;
                st.last_success_at_unix_ms = Some(at);
                st.last_error = None;
                st.last_error_kind = None;
            }
            Some((state, kind, message)) => {
                tracing::warn!(pool = %pool.pool_id, provider = %pool.provider, kind, error = %message, "provider poll failed; the last good addresses stay, marked stale");
                if let Some(ev) = self.events.get() {
                    let state = serde_json::to_value(state)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_owned))
                        .unwrap_or_default();
                    let body = crate::events::EventBody::ProviderPollFailed {
                        pool: pool.pool_id.clone(),
                        provider: pool.provider.to_string(),
                        state,
                        error_kind: kind.to_owned(),
                        error: message.clone(),
                    };
                    ev.publish(crate::events::Subject::host(), body);
                }
                if state == ProviderPoolState::Degraded {
                    st.consecutive_failures = 0;
                    st.last_success_at_unix_ms = Some(at);
                } else {
                    st.consecutive_failures += 1;
                    entry.failures += 1;
                }
                st.state = state;
                st.last_error_kind = Some(kind.to_owned());
                st.last_error = Some(message);
            }
        }
        entry.due = Some(Instant::now() + wait);
        let wait_ms = i64::try_from(wait.as_millis()).unwrap_or(i64::MAX);
        st.next_poll_at_unix_ms = Some(at.saturating_add(wait_ms));
        st.clone()
    }

    /// The provider calls of one poll; on failure the error and the requests sent. The pool is
    /// checked against the agent's rules, the secret read here (never by the fetcher), and the
    /// fetcher gets the ready header only.
    async fn fetch(
        &self,
        pool: &ProviderPool,
        machines: &[(String, vmnet_model::pool::Machine)],
    ) -> Result<PollReport, (PollError, u64)> {
        self.rules
            .check(pool)
            .map_err(|e| (PollError::Refused(e.to_string()), 0))?;
        let source = pool.credentials.to_string();
        let secret = Secret::read(&pool.credentials, &self.rules).map_err(|e| (e, 0))?;
        let auth = match pool.provider {
            Provider::HetznerCloud => Zeroizing::new(format!("Bearer {}", secret.expose())),
            Provider::ProxmoxVe => proxmox_token(&secret, &source).map_err(|e| (e, 0))?,
        };
        let authorization = SecretString::from(auth.as_str());
        if reqwest::header::HeaderValue::from_str(secrecy::ExposeSecret::expose_secret(
            &authorization,
        ))
        .is_err()
        {
            return Err((
                PollError::Credentials(format!(
                    "credentials {source} hold characters an HTTP header cannot carry"
                )),
                0,
            ));
        }
        let job = FetchJob {
            provider: pool.provider,
            api_url: pool.api_url.clone(),
            authorization,
            machines: machines.to_vec(),
            http: self.settings.http.clone(),
        };
        self.fetcher.fetch(job).await
    }

    /// One round: starts a poll of every due pool that is not being polled, and forgets pools
    /// that are no longer provider pools.
    pub async fn round(self: &Arc<Self>) {
        let pools = match vmnet_ipam::transaction!(&self.db, tx => vmnet_ipam::list_provider_pools(tx).await)
        {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %vmnet_model::error::chain(&e), "provider pools cannot be read from the store");
                return;
            }
        };
        let now = Instant::now();
        let mut start = Vec::new();
        {
            let mut guard = self
                .pools
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let ids: BTreeSet<&str> = pools.iter().map(|p| p.pool_id.as_str()).collect();
            guard.retain(|id, _| ids.contains(id.as_str()));
            for p in pools {
                let e = guard.entry(p.pool_id.clone()).or_insert_with(|| Entry {
                    status: fresh(&p),
                    due: None,
                    running: false,
                    failures: 0,
                });
                if !e.running && e.due.is_none_or(|d| d <= now) {
                    e.running = true;
                    start.push(p);
                }
            }
        }
        for p in start {
            let me = Arc::clone(self);
            tokio::spawn(async move {
                me.poll_pool(&p).await;
                if let Ok(mut g) = me.pools.lock()
                    && let Some(e) = g.get_mut(&p.pool_id)
                {
                    e.running = false;
                }
            });
        }
    }

    /// Runs rounds every [`PollerSettings::tick`] until the task is aborted.
    pub async fn run(self: Arc<Self>) {
        loop {
            self.round().await;
            tokio::time::sleep(self.settings.tick).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proxmox_tokens_have_their_documented_shape() {
        let ok = proxmox_token(&Secret::new("root@pam!vmnet=0f1e2d3c"), "env T").unwrap();
        assert_eq!(ok.as_str(), "PVEAPIToken=root@pam!vmnet=0f1e2d3c");
        for bad in [
            "0f1e2d3c",
            "root@pam=x",
            "root!id=x",
            "root@pam!=x",
            "root@pam!id=",
        ] {
            let e = proxmox_token(&Secret::new(bad), "env T").unwrap_err();
            assert_eq!(
                e.to_string(),
                "credentials env T are not a Proxmox VE API token (USER@REALM!TOKENID=SECRET)"
            );
        }
    }
}
