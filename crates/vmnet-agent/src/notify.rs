//! The service manager's notifications (`sd_notify(3)`), when the agent runs under systemd
//! with `Type=notify` (`NOTIFY_SOCKET` set): `READY=1` once the agent is ready, `WATCHDOG=1`
//! while it is alive, `STATUS=` with a one-line summary, `STOPPING=1` when it stops.
//!
//! # Design
//! - A thread of its own ticks every half of the watchdog period (`WATCHDOG_USEC`) and asks
//!   what `GET /healthz` asks ([`Agent::health`]): it sends `WATCHDOG=1` only while every loop
//!   progressed within its deadline, so a stalled reconcile loop stops the pings and systemd
//!   restarts the agent after `WatchdogSec`. A thread, not a task: a runtime worker busy with a
//!   long kernel change must not look like a stalled agent.
//! - One task ([`run`]) ticks every half of the watchdog period (every second without a
//!   watchdog) and asks what `GET /readyz` asks ([`Agent::readiness`]): it sends `READY=1`
//!   once, the first time the agent is ready (a full reconcile pass finished since start, the
//!   store answers), so `systemctl start` returns when the host's VMs are converged.
//! - `STATUS=` is sent when the summary changes: `converging`, then the VM counts (read at
//!   most every 10 s), or the reason the agent is not alive.
//! - Without `NOTIFY_SOCKET` the task returns at once and nothing is sent.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use sd_notify::NotifyState;

use crate::agent::Agent;

/// How often the VM counts of `STATUS=` are read again.
const SUMMARY_EVERY: Duration = Duration::from_secs(10);

/// How often the task looks when systemd set no watchdog.
const TICK_WITHOUT_WATCHDOG: Duration = Duration::from_secs(1);

/// Whether the service manager listens (`NOTIFY_SOCKET` is set).
#[must_use]
pub fn enabled() -> bool {
    std::env::var_os("NOTIFY_SOCKET").is_some()
}

fn send(states: &[NotifyState]) {
    if let Err(e) = sd_notify::notify(states) {
        tracing::warn!("systemd notification failed: {e}");
    }
}

/// Tells the service manager the agent is stopping (`STOPPING=1`); nothing without one.
pub fn stopping() {
    if enabled() {
        send(&[NotifyState::Stopping, NotifyState::Status("stopping")]);
    }
}

/// Stops the watchdog thread when dropped (the task that started it ended or was aborted).
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Starts the thread that sends `WATCHDOG=1` every `tick` while the agent is alive, until
/// `stop` is set.
fn watchdog_thread(agent: Arc<Agent>, tick: Duration, stop: Arc<AtomicBool>) {
    let started = std::thread::Builder::new()
        .name("vmnet-watchdog".into())
        .spawn(move || {
            while !stop.load(Ordering::Acquire) {
                if agent.health().is_ok() {
                    send(&[NotifyState::Watchdog]);
                }
                std::thread::sleep(tick);
            }
        });
    if let Err(e) = started {
        tracing::warn!("cannot start the watchdog thread: {e}; systemd will restart the agent");
    }
}

/// Runs the notifications (see the module docs) until the task is aborted; returns at once
/// when no service manager listens.
pub async fn run(agent: Arc<Agent>) {
    if !enabled() {
        return;
    }
    let watchdog = sd_notify::watchdog_enabled();
    let tick = watchdog.map_or(TICK_WITHOUT_WATCHDOG, |w| w / 2);
    tracing::info!(watchdog = ?watchdog, "systemd notifications on");
    let stop = Arc::new(AtomicBool::new(false));
    let _stop_watchdog = StopOnDrop(Arc::clone(&stop));
    if watchdog.is_some() {
        watchdog_thread(Arc::clone(&agent), tick, stop);
    }
    let mut ready = false;
    let mut shown = String::new();
    let mut counted = None;
    let mut every = tokio::time::interval(tick);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let alive = agent.health();
        let mut states = Vec::new();
        let now_ready = ready || agent.readiness().await.is_ok();
        if now_ready && !ready {
            ready = true;
            states.push(NotifyState::Ready);
            tracing::info!("ready: the first reconcile pass finished; told systemd");
        }
        let counts_due = counted.is_none_or(|t: tokio::time::Instant| t.elapsed() >= SUMMARY_EVERY);
        let status = match (alive.as_ref().err(), ready) {
            (Some(e), _) => e.message.clone(),
            (None, false) => "converging: the first reconcile pass is running".to_owned(),
            (None, true) if counts_due || !shown.contains("VMs") => {
                counted = Some(tokio::time::Instant::now());
                counts(&agent).await
            }
            (None, true) => shown.clone(),
        };
        if status != shown {
            shown.clone_from(&status);
            states.push(NotifyState::Status(&shown));
        }
        if !states.is_empty() {
            send(&states);
        }
    }
}

/// The `STATUS=` of a ready, alive agent: its VM counts.
async fn counts(agent: &Agent) -> String {
    match agent.status().await {
        Ok(s) => format!(
            "{} VMs: {} applied, {} failed; {} passes",
            s.vms.desired, s.vms.applied, s.vms.failed, s.reconcile.passes
        ),
        Err(e) => format!("ready; status unavailable: {}", e.message),
    }
}
