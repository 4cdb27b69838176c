//! The drift audit loop: every period (5 s in the agent) the pool firewall compares the kernel
//! with what it loaded and re-applies on any difference; the repairs are counted in its status.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use vmnet_kernel::pool::firewall::{FirewallStatus, NftExec, PoolFirewall};

/// The agent's audit period.
pub const AUDIT_PERIOD: Duration = Duration::from_secs(5);

/// Runs the audit every `period` until the returned task is aborted. Each audit runs on a
/// blocking thread (it talks to nft synchronously). Failures are logged; the next tick retries.
pub fn spawn<E: NftExec + 'static>(
    firewall: Arc<Mutex<PoolFirewall<E>>>,
    period: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            let fw = Arc::clone(&firewall);
            let res = tokio::task::spawn_blocking(move || {
                fw.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .audit()
            })
            .await;
            match res {
                Ok(Ok(r)) if r.repaired => tracing::warn!(drift = ?r.drift, "bcd tables repaired"),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => tracing::error!(error = %e, "pool firewall audit failed"),
                Err(e) => tracing::error!(error = %e, "pool firewall audit task failed"),
            }
        }
    })
}

/// The status counters of the firewall (taps, drift repairs, last drift).
pub fn status<E: NftExec>(firewall: &Mutex<PoolFirewall<E>>) -> FirewallStatus {
    firewall
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .status()
}
