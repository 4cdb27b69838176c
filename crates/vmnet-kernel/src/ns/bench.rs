//! A benchmark hook for `vmnet bench vms`: apply N plans one by one, then remove them, timing each.

use std::time::{Duration, Instant};

use vmnet_plan::ns::VmPlan;

use super::{NsDriver, NsError};

/// Per-VM latencies of one benchmark run, in the order the plans were given.
#[derive(Debug, Clone, Default)]
pub struct BenchTimings {
    /// Time of each `apply` (a fresh VM).
    pub setup: Vec<Duration>,
    /// Time of each `remove`.
    pub teardown: Vec<Duration>,
}

/// Applies every plan in order, then removes them in order, timing each call.
///
/// # Errors
/// The first failure; VMs applied so far are removed before returning it.
pub async fn apply_then_remove(
    driver: &dyn NsDriver,
    plans: &[VmPlan],
) -> Result<BenchTimings, NsError> {
    let mut t = BenchTimings::default();
    for (i, p) in plans.iter().enumerate() {
        let start = Instant::now();
        if let Err(e) = driver.apply(p).await {
            for q in &plans[..=i] {
                let _ = driver.remove(q.user_id).await;
            }
            return Err(e);
        }
        t.setup.push(start.elapsed());
    }
    for p in plans {
        let start = Instant::now();
        driver.remove(p.user_id).await?;
        t.teardown.push(start.elapsed());
    }
    Ok(t)
}
