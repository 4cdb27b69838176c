//! Whether the agent is alive and ready: the heartbeats of its loops (`GET /healthz`, the
//! systemd watchdog) and its convergence since start (`GET /readyz`, `READY=1`).
//!
//! # Design
//! - Each loop the agent runs beats ([`Loops::beat`]) whenever it makes progress: the reconcile
//!   loop before every step of a pass (the host state, each VM, garbage collection, each VM of a
//!   firewall audit) and at least every second while it waits for its next pass; the
//!   notification loop on every event and at least every second while idle. A loop whose last
//!   beat is older than its deadline ([`DEFAULT_LOOP_DEADLINE`]) is *stalled*: a kernel call
//!   that never returns, a lock never released, a deadlock. Pool mode's table audit counts
//!   as stalled when its last audit finished longer ago than the deadline.
//! - Every step of a pass beats both loops: a pass may run on behalf of the notification loop
//!   (a full pass on lost notifications), and a loop waiting for the pass lock behind a pass
//!   that progresses is not stalled. (A notification loop stuck elsewhere while a pass runs is
//!   seen once the pass ends.)
//! - Alive ([`Agent::health`]) means no loop is stalled. The systemd watchdog is fed only while
//!   alive ([`crate::notify`]), so a stalled loop gets the agent restarted.
//! - Ready ([`Agent::readiness`]) means alive, a full reconcile pass has finished since the
//!   agent started (every stored VM was applied or its error recorded) and the store answers a
//!   transaction within [`STORE_PROBE_TIMEOUT`].
//!
//! # Limitations
//! A loop that beats but makes no useful progress (a pass that fails on every VM) is alive:
//! its failures show in `GET /v1/status` and the metrics, not in the health.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use vmnet_model::Error;

use crate::agent::{Agent, store_tx};

/// How long a loop may go without progress before it counts as stalled (see the module docs).
pub const DEFAULT_LOOP_DEADLINE: Duration = Duration::from_secs(60);

/// How often an idle loop beats (at most; see [`Loops::idle_beat`]).
pub const IDLE_BEAT: Duration = Duration::from_secs(1);

/// How long the readiness probe waits for a store transaction.
pub const STORE_PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// A loop the agent runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Loop {
    /// The reconcile loop (passes and the firewall audit).
    Reconcile,
    /// The repair on the kernel's change notifications.
    Watch,
}

impl Loop {
    /// How the loop is named in a reason.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Reconcile => "reconcile loop",
            Self::Watch => "kernel notification loop",
        }
    }
}

/// The heartbeats of the agent's loops and whether it has converged since start.
#[derive(Debug)]
pub struct Loops {
    beats: Mutex<BTreeMap<Loop, Instant>>,
    deadline: Mutex<Duration>,
    converged: AtomicBool,
}

impl Default for Loops {
    fn default() -> Self {
        Self {
            beats: Mutex::new(BTreeMap::new()),
            deadline: Mutex::new(DEFAULT_LOOP_DEADLINE),
            converged: AtomicBool::new(false),
        }
    }
}

impl Loops {
    /// Records progress of `l` now (and starts watching it).
    pub fn beat(&self, l: Loop) {
        if let Ok(mut b) = self.beats.lock() {
            b.insert(l, Instant::now());
        }
    }

    /// Stops watching `l` (its task ended on purpose).
    pub fn end(&self, l: Loop) {
        if let Ok(mut b) = self.beats.lock() {
            b.remove(&l);
        }
    }

    /// The deadline of every loop.
    #[must_use]
    pub fn deadline(&self) -> Duration {
        self.deadline.lock().map_or(DEFAULT_LOOP_DEADLINE, |d| *d)
    }

    /// How often an idle loop beats: every [`IDLE_BEAT`], or a quarter of the deadline when
    /// that is shorter.
    #[must_use]
    pub fn idle_beat(&self) -> Duration {
        IDLE_BEAT.min(self.deadline() / 4)
    }

    /// Sets the deadline of every loop.
    pub fn set_deadline(&self, d: Duration) {
        if let Ok(mut x) = self.deadline.lock() {
            *x = d;
        }
    }

    /// The stalled loops, one reason each (empty when every loop progressed in time).
    #[must_use]
    pub fn stalled(&self) -> Vec<String> {
        let deadline = self.deadline();
        let now = Instant::now();
        self.beats
            .lock()
            .map(|b| {
                b.iter()
                    .filter(|(_, t)| now.duration_since(**t) > deadline)
                    .map(|(l, t)| {
                        format!(
                            "{}: no progress for {:.1} s (deadline {} s)",
                            l.name(),
                            now.duration_since(*t).as_secs_f64(),
                            deadline.as_secs_f64()
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Whether a full pass has finished since start.
    #[must_use]
    pub fn converged(&self) -> bool {
        self.converged.load(Ordering::Acquire)
    }

    pub(crate) fn set_converged(&self) {
        self.converged.store(true, Ordering::Release);
    }
}

impl Agent {
    /// Whether every loop progressed within its deadline (`GET /healthz`).
    ///
    /// # Errors
    /// `UNAVAILABLE` naming each stalled loop.
    pub fn health(&self) -> Result<(), Error> {
        let mut stalled = self.loops.stalled();
        if let Some(p) = self.pool() {
            let deadline = self.loops.deadline();
            let last = p.runtime().audit_record().last_audit_at_unix_ms;
            let since = p.started_at_unix_ms();
            let at = last.unwrap_or(since).max(since);
            let age_ms = crate::status::now_ms().saturating_sub(at);
            if u128::from(age_ms.unsigned_abs()) > deadline.as_millis() {
                stalled.push(format!(
                    "pool table audit: no audit for {:.1} s (deadline {} s)",
                    age_ms as f64 / 1000.0,
                    deadline.as_secs_f64()
                ));
            }
        }
        if stalled.is_empty() {
            Ok(())
        } else {
            Err(Error::unavailable(format!(
                "not alive: {}",
                stalled.join("; ")
            )))
        }
    }

    /// Whether the agent is alive, has converged since start, and its store answers
    /// (`GET /readyz`).
    ///
    /// # Errors
    /// `UNAVAILABLE` with the first reason it is not ready.
    pub async fn readiness(&self) -> Result<(), Error> {
        self.health()?;
        if !self.loops.converged() {
            return Err(Error::unavailable(
                "not ready: the first reconcile pass since the agent started has not finished",
            ));
        }
        let probe = async {
            store_tx!(self.db(), _tx => async { Ok::<(), vmnet_ipam::IpamError>(()) }.await)
        };
        match tokio::time::timeout(STORE_PROBE_TIMEOUT, probe).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(Error::unavailable(format!(
                "not ready: the store does not answer: {}",
                e.message
            ))),
            Err(_) => Err(Error::unavailable(format!(
                "not ready: the store did not answer within {} s",
                STORE_PROBE_TIMEOUT.as_secs()
            ))),
        }
    }

    /// The agent's loop heartbeats.
    #[must_use]
    pub fn loops(&self) -> &Loops {
        &self.loops
    }

    /// Sets how long a loop may go without progress before the agent is not alive.
    pub fn set_loop_deadline(&self, d: Duration) {
        self.loops.set_deadline(d);
    }

    /// A pass step: the reconcile loop (and the notification loop, which may be waiting for
    /// this pass) progress.
    pub(crate) fn pass_progress(&self) {
        self.loops.beat(Loop::Reconcile);
        if self.notifications_on() {
            self.loops.beat(Loop::Watch);
        }
    }
}
