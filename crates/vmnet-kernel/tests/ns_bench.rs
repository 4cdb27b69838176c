//! A small run of the benchmark hook (root required): N VMs applied and removed through
//! `apply_then_remove` (below), medians printed. `VMNET_BENCH_N` sets N
//! (default 30). The per-VM setup must stay within a generous bound here (the product target,
//! 5 ms median, is measured by `vmnet-lab bench vms` on a quiet machine).

mod ns_support;

use std::time::{Duration, Instant};

use ns_support::{Env, vm_json};

use vmnet_kernel::ns::{NsDriver, NsError};
use vmnet_plan::ns::VmPlan;

fn median(v: &[Duration]) -> Duration {
    let mut s = v.to_vec();
    s.sort_unstable();
    s[s.len() / 2]
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

fn p99(v: &[Duration]) -> Duration {
    let mut s = v.to_vec();
    s.sort_unstable();
    s[(s.len() * 99 / 100).min(s.len() - 1)]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn apply_and_remove_many_vms() {
    let env = Env::new();
    let n: u32 = std::env::var("VMNET_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let plans: Vec<_> = (1..=n)
        .map(|u| {
            env.plan(&vm_json(
                &format!("b{u}"),
                u,
                Some(&format!("fdaa::{u:x}")),
                &[("0.0.0.0/0", "host"), ("::/0", "host")],
            ))
        })
        .collect();
    // Warm up once (host-wide state, code paths), then measure.
    env.driver.apply(&plans[0]).await.unwrap();
    env.driver.remove(plans[0].user_id).await.unwrap();
    let fds_before = open_fds();
    let t = apply_then_remove(env.driver.as_ref(), &plans)
        .await
        .expect("bench");
    let (setup, teardown) = (median(&t.setup), median(&t.teardown));
    let k = t.setup.len().min(100);
    println!(
        "ns bench: n={n} setup median {setup:?} p99 {:?}, first {k} median {:?}, last {k} median {:?}; teardown median {teardown:?} p99 {:?}",
        p99(&t.setup),
        median(&t.setup[..k]),
        median(&t.setup[t.setup.len() - k..]),
        p99(&t.teardown)
    );
    assert_eq!(t.setup.len(), plans.len());
    // No socket or namespace handle per VM outlives its apply/remove.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let fds_after = open_fds();
    assert!(
        fds_after <= fds_before + 4,
        "descriptors leaked: {fds_before} → {fds_after}"
    );
    assert!(
        env.driver.observe().await.unwrap().is_empty(),
        "everything removed"
    );
    assert!(setup < Duration::from_millis(100), "setup median {setup:?}");
}

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
