//! The drift audit loop: every period (5 s in the agent) the pool firewall compares the kernel
//! with what it loaded and re-applies on any difference; the repairs are counted in its status,
//! and every audit is recorded ([`AuditRecord`]) for the agent's status.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use vmnet_kernel::pool::firewall::{FirewallStatus, NftExec, PoolFirewall};

use crate::api::error::from_firewall;

/// The agent's audit period.
pub const AUDIT_PERIOD: Duration = Duration::from_secs(5);

/// What the audit loop has done so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AuditRecord {
    /// Audits run (with or without drift).
    pub audits: u64,
    /// When the last audit finished, ms since the Unix epoch.
    pub last_audit_at_unix_ms: Option<i64>,
    /// The last audit's error (listing or repair failed); `None` after a good audit.
    pub last_error: Option<String>,
}

/// Runs the audit every `period` until the returned task is aborted. Each audit runs on a
/// blocking thread (it talks to nft synchronously) and is recorded in `record`. Failures are
/// logged; the next tick retries.
pub fn spawn<E: NftExec + 'static>(
    firewall: Arc<Mutex<PoolFirewall<E>>>,
    record: Arc<Mutex<AuditRecord>>,
    period: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            audit_once(&firewall, &record).await;
        }
    })
}

/// Runs one audit now (what every tick of [`spawn`] runs, and what a notification of a change
/// to the tables runs at once) and records it; returns the differences it repaired, one line
/// each (empty: the tables were as planned, or the audit failed).
pub async fn audit_once<E: NftExec + 'static>(
    firewall: &Arc<Mutex<PoolFirewall<E>>>,
    record: &Arc<Mutex<AuditRecord>>,
) -> Vec<String> {
    let fw = Arc::clone(firewall);
    let res = tokio::task::spawn_blocking(move || {
        fw.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .audit()
    })
    .await;
    let mut repaired = Vec::new();
    let error = match res {
        Ok(Ok(r)) => {
            if r.repaired {
                tracing::warn!(drift = ?r.drift, "bcd tables repaired");
                repaired = r.drift;
            }
            None
        }
        Ok(Err(e)) => {
            tracing::error!(error = %e, "pool firewall audit failed");
            Some(from_firewall(&e).message)
        }
        Err(e) => {
            tracing::error!(error = %e, "pool firewall audit task failed");
            Some(format!("audit task: {e}"))
        }
    };
    let mut r = record
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    r.audits += 1;
    r.last_audit_at_unix_ms = Some(crate::status::now_ms());
    r.last_error = error;
    repaired
}

/// The status counters of the firewall (taps, drift repairs, last drift).
pub fn status<E: NftExec>(firewall: &Mutex<PoolFirewall<E>>) -> FirewallStatus {
    firewall
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .status()
}
