//! The agent side of the pool sandbox: `vmnet serve --host-id` started inside the sandbox host,
//! driven over its API as an operator would, and stopped again (SIGTERM by pid, SIGKILL after
//! 10 s; [`crate::agent`]) when the sandbox goes.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use vmnet_agent::api::types::PoolStatus;
use vmnet_agent::client::{Client, segment};
use vmnet_model::Error;

use super::PoolSpec;
use crate::agent::{AgentOptions, AgentProc};

/// The pool sandbox's agent: the process (stopped on drop) and what the job asks of it.
pub struct PoolAgent {
    proc: AgentProc,
    /// Its API.
    pub client: Client,
    /// Its seed directory (`<state dir>/pool/seeds`).
    pub seeds: PathBuf,
}

impl PoolAgent {
    /// Starts `vmnet serve` (this executable) in namespace `host_ns` for `spec`'s host and
    /// bridge, with `extra` (`up --agent-arg`) appended, its database, socket and state under
    /// `dir`, and waits until it answers.
    ///
    /// # Errors
    /// `INTERNAL` when it cannot be started or does not answer within `timeout`.
    pub async fn start(
        spec: &PoolSpec,
        host_ns: &str,
        prefix: &str,
        dir: &Path,
        (extra, timeout): (&[String], Duration),
    ) -> Result<Self, Error> {
        let proc = AgentOptions::new(host_ns, prefix, dir)
            .args(["--host-id", &spec.host.host_id, "--bridge", &spec.bridge])
            .args(extra)
            .start(timeout)
            .await?;
        Ok(Self {
            client: proc.client().clone(),
            seeds: dir.join("state/pool/seeds"),
            proc,
        })
    }

    /// The agent's process id.
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }

    /// The agent's whole command line (`up --agent-arg` flags last).
    #[must_use]
    pub fn command(&self) -> &[String] {
        self.proc.command()
    }

    /// The last lines of the agent's log.
    #[must_use]
    pub fn log_tail(&self) -> String {
        self.proc.log_tail()
    }

    /// The range, the added ranges (in order) and the host of `spec`, over the API.
    ///
    /// # Errors
    /// The API's error (e.g. `INVALID_INPUT` for a bad range).
    pub async fn set_up_pool(&self, spec: &PoolSpec) -> Result<(), Error> {
        let p = &spec.pool;
        let _: Value = self
            .client
            .put(
                &format!("/v1/pools/{}/range", segment(&p.pool_id)),
                &json!({ "cidr": p.cidr, "gateway": p.gateway, "first_host": p.first_host,
                         "last_host": p.last_host, "dns": p.dns }),
            )
            .await?;
        for r in &spec.ranges {
            let _: Value = self
                .client
                .post(
                    &format!("/v1/pools/{}/ranges", segment(&p.pool_id)),
                    Some(&json!({ "cidr": r.cidr, "gateway": r.gateway,
                                  "first_host": r.first_host, "last_host": r.last_host })),
                )
                .await?;
        }
        let h = &spec.host;
        let _: Value = self
            .client
            .put(
                &format!("/v1/hosts/{}", segment(&h.host_id)),
                &json!({ "vcpus": h.vcpus, "memory_mib": h.memory_mib }),
            )
            .await?;
        Ok(())
    }

    /// Creates one instance on the spec's host; the answer comes once this host realised it.
    ///
    /// # Errors
    /// The API's error (`CAPACITY_UNAVAILABLE` when the pool is full).
    pub async fn create_instance(
        &self,
        spec: &PoolSpec,
        i: &super::PoolSpecInstance,
    ) -> Result<vmnet_model::pool::Instance, Error> {
        self.client
            .post(
                "/v1/instances",
                Some(&json!({
                    "instance_id": i.instance_id, "pool_id": spec.pool.pool_id,
                    "host_id": spec.host.host_id, "vcpus": 1, "memory_mib": 256,
                    "network_policy": i.policy, "sandbox": i.sandbox,
                })),
            )
            .await
    }

    /// Deletes an instance (its tap, rules and seed go with it).
    ///
    /// # Errors
    /// The API's error.
    pub async fn delete_instance(&self, id: &str) -> Result<(), Error> {
        let _: Value = self
            .client
            .delete(&format!("/v1/instances/{}", segment(id)))
            .await?;
        Ok(())
    }

    /// The pool part of `GET /v1/status`.
    ///
    /// # Errors
    /// The API's error, or `INTERNAL` when the agent runs without pool mode.
    pub async fn pool_status(&self) -> Result<PoolStatus, Error> {
        let st: vmnet_agent::api::types::AgentStatus = self.client.get("/v1/status").await?;
        st.pool
            .ok_or_else(|| Error::internal("the agent reports no pool mode"))
    }

    /// Sends `sig` to the agent (this process started it): `SIGSTOP` holds its audit loop off,
    /// `SIGCONT` lets it run again.
    ///
    /// # Errors
    /// The system error, as a message.
    pub fn signal(&self, sig: nix::sys::signal::Signal) -> Result<(), String> {
        self.proc.signal(sig).map_err(|e| e.message)
    }

    /// Waits until the audit has repaired drift once more than `before` repairs; the time it
    /// took, or `None` after `timeout`.
    pub async fn wait_repair(&self, before: u64, timeout: Duration) -> Option<Duration> {
        let start = Instant::now();
        while start.elapsed() < timeout && !crate::state::stopping() {
            if self
                .pool_status()
                .await
                .is_ok_and(|p| p.drift_repairs > before)
            {
                return Some(start.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }
}
