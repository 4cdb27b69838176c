//! `vmnet-lab bench drift`: how fast the agent puts back what another program changed, at N
//! VMs, when only the kernel's change notifications can repair it.
//!
//! It creates a sandbox and a state directory as `vmnet-lab bench agent` does and starts the
//! agent with its reconcile pass and firewall audit an hour apart (the backstops, which would
//! otherwise also repair), then PUTs VMs 1..=N with every feature on (the configs of
//! `bench agent --all-features`). Once the agent is idle it reads the agent's CPU time over
//! [`IDLE`]. Then it makes `--changes` changes of the kinds of [`inject::Kind`], cycling through
//! the kinds, each at a VM drawn by a fixed pseudo-random sequence (the NAT rule and host route
//! among the VMs with a public IPv4), one after another: each change is timed from just before
//! the command that made it to the arrival of the agent's `drift_repaired` event on
//! `GET /v1/events` (the repair done; one change at a time, so the next repair event is the
//! change's), at most [`REPAIR_WAIT`]. Then a storm: the chain holding VM 1's firewall rules
//! flushed [`STORM_RATE`] times a second for `--storm-secs` (one `nft -i` process fed a command
//! every 10 ms), with the agent's CPU over the storm and
//! its notification checks, repairs and back-offs before and after, and whether the rule is
//! back once the storm ends.
//!
//! It prints one row per kind (changes, change to repair p50 / p99 / max, repairs by
//! notification) with the goals (p50 ≤ 100 ms, p99 ≤ 1 s), then the agent's CPU idle and during
//! the run (goal idle ≤ 1 % of a core), then the storm.
//!
//! # Cleanup
//! As `vmnet-lab bench agent`: the agent is stopped by pid and reaped by a guard, also on
//! error; the sandbox guard deletes its namespaces, then the state directory goes.
//!
//! # Limitations
//! Each change is made by a process (`nft`, `ip`, `tc` inside the namespace): the change itself
//! happens a little after the instant it is timed from. The event arrives over the API socket
//! after the repair: the figure includes its delivery.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use vmnet_agent::api::types::AgentStatus;
use vmnet_agent::client::Client;
use vmnet_model::Error;
use vmnet_plan::ns::{NsSettings, VmPlan, plan_vm};

use crate::agent::{AgentProc, StateDir, log_tail, put_vm};
use crate::agent_load::{PUBLIC_V4_VMS, vm_body_full};
use crate::procstat::proc_cpu_ms;

pub mod inject;
mod report;

use inject::Kind;
pub use report::{KindRow, StormRow, render};

/// Arguments of this command.
#[derive(Debug, clap::Args)]
pub struct DriftBenchArgs {
    /// VMs the agent holds.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=4000))]
    pub vms: u32,
    /// Changes made, one after another.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub changes: u32,
    /// Length of the storm, seconds (0: no storm).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(0..=600))]
    pub storm_secs: u32,
}

/// How long the agent's idle CPU is read.
pub const IDLE: Duration = Duration::from_secs(10);

/// How long a change may wait for its repair before it counts as not repaired.
pub const REPAIR_WAIT: Duration = Duration::from_secs(5);

/// Deletions a second during the storm.
pub const STORM_RATE: u32 = 100;

/// The backstops' interval while the bench runs: an hour, so only notifications repair.
const BACKSTOP_SECS: &str = "3600";

/// A repair the agent announced.
#[derive(Debug, Clone)]
struct Repaired {
    at: Instant,
    trigger: String,
}

/// Runs the command.
///
/// # Errors
/// `INVALID_INPUT` when not root; `INTERNAL` when the sandbox, the agent or a change fails.
pub async fn run(args: DriftBenchArgs) -> Result<(), Error> {
    if !nix::unistd::geteuid().is_root() {
        return Err(Error::invalid(
            "vmnet-lab bench drift must run as root (it creates network namespaces)",
        ));
    }
    let sb = vmnet_sandbox::Sandbox::new("bd")
        .map_err(|e| Error::internal(format!("bench sandbox: {e}")))?;
    let dir = StateDir::new()?;
    let log = dir.0.join("agent.log");
    let agent = AgentProc::start_with(
        &dir.0,
        &sb.host(),
        &sb.agent_prefix(),
        "agent.log",
        "warn",
        &[
            "--reconcile-interval-secs",
            BACKSTOP_SECS,
            "--firewall-audit-secs",
            BACKSTOP_SECS,
        ],
    )?;
    eprintln!(
        "bench sandbox {} (host netns {}), agent pid {}",
        sb.prefix(),
        sb.host(),
        agent.pid()
    );
    let client = Client::new(dir.0.join("vmnet.sock"));
    wait_up(&client, &log).await?;
    let settings = NsSettings {
        name_prefix: sb.agent_prefix(),
        ..NsSettings::default()
    };
    let mut plans = Vec::new();
    for uid in 1..=args.vms {
        let body = vm_body_full(uid);
        put_vm(&client, uid, &body, &log).await?;
        let cfg = vmnet_model::vm::from_value(&body)?;
        plans.push(plan_vm(&cfg, &settings)?);
    }
    quiet(&client).await?;
    let pid = agent.pid();
    let idle_cpu = cpu_share(pid, IDLE).await?;

    let repairs: Arc<Mutex<Vec<Repaired>>> = Arc::default();
    let listener = listen(&client, Arc::clone(&repairs));
    let with_v4 = args.vms.min(PUBLIC_V4_VMS);
    let mut rng = Lcg(0x5eed);
    let mut samples: Vec<(Kind, Option<Duration>, String)> = Vec::new();
    let cpu0 = proc_cpu_ms(pid);
    let run_start = Instant::now();
    for i in 0..args.changes {
        let kind = Kind::ALL[usize::try_from(i).unwrap_or(0) % Kind::ALL.len()];
        let pool = if kind.needs_public_v4() {
            with_v4
        } else {
            args.vms
        };
        let uid = 1 + rng.below(pool);
        let plan = &plans[usize::try_from(uid - 1).unwrap_or(0)];
        let seen = repairs.lock().map(|r| r.len()).unwrap_or(0);
        let host = sb.host();
        let p = plan.clone();
        let t0 = tokio::task::spawn_blocking(move || inject::inject(kind, &p, &host))
            .await
            .map_err(|e| Error::internal(format!("change: {e}")))??;
        let (took, trigger) = wait_repair(&repairs, seen, t0).await;
        samples.push((kind, took, trigger));
        // The next change starts once this one's repair is in (or given up).
        if took.is_none() {
            eprintln!("{}: not repaired within {REPAIR_WAIT:?}", kind.label());
        }
    }
    let run_wall = run_start.elapsed();
    let run_cpu = cpu0
        .zip(proc_cpu_ms(pid))
        .map(|(a, b)| percent(b.saturating_sub(a), run_wall));
    listener.abort();
    let rows = report::kind_rows(&samples);
    let storm = if args.storm_secs > 0 {
        Some(storm(&client, pid, &plans[0], args.storm_secs).await?)
    } else {
        None
    };
    print!(
        "{}",
        render(&report::Report {
            vms: args.vms,
            rows,
            idle_cpu,
            run_cpu,
            storm,
        })
    );
    drop(agent);
    drop(sb);
    drop(dir);
    Ok(())
}

/// Waits until the agent answers.
async fn wait_up(client: &Client, log: &std::path::Path) -> Result<(), Error> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while client.get::<AgentStatus>("/v1/status").await.is_err() {
        if Instant::now() > deadline {
            return Err(Error::internal(format!(
                "agent not ready; log:\n{}",
                log_tail(log, 40)
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// The agent's notification counters (`reconcile.notifications` of `GET /v1/status`).
async fn notifications(client: &Client) -> Result<Value, Error> {
    let st: Value = client.get("/v1/status").await?;
    Ok(st["reconcile"]["notifications"].clone())
}

/// Waits until the agent has checked nothing for a second (its own PUTs' notifications are
/// discarded; anything else settles).
async fn quiet(client: &Client) -> Result<(), Error> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut last = notifications(client).await?["checks_total"].clone();
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = notifications(client).await?["checks_total"].clone();
        if now == last || Instant::now() > deadline {
            return Ok(());
        }
        last = now;
    }
}

/// The agent's CPU over `span`, % of one core.
async fn cpu_share(pid: u32, span: Duration) -> Result<f64, Error> {
    let a = proc_cpu_ms(pid).ok_or_else(|| Error::internal("agent gone"))?;
    let t = Instant::now();
    tokio::time::sleep(span).await;
    let b = proc_cpu_ms(pid).ok_or_else(|| Error::internal("agent gone"))?;
    Ok(percent(b.saturating_sub(a), t.elapsed()))
}

/// `cpu_ms` over `wall`, % of one core.
fn percent(cpu_ms: u64, wall: Duration) -> f64 {
    #[allow(clippy::cast_precision_loss)] // milliseconds of a bench run
    let ms = cpu_ms as f64;
    ms / (wall.as_secs_f64() * 1000.0).max(1.0) * 100.0
}

/// Follows the agent's `drift_repaired` events into `repairs`, stamping each on arrival.
fn listen(client: &Client, repairs: Arc<Mutex<Vec<Repaired>>>) -> tokio::task::JoinHandle<()> {
    let client = client.clone();
    tokio::spawn(async move {
        let _ = client
            .events_lines("follow=true&kind=drift_repaired", |line| {
                let at = Instant::now();
                let v: Value = serde_json::from_str(line).unwrap_or_default();
                let trigger = v["data"]["trigger"]
                    .as_str()
                    .or_else(|| v["trigger"].as_str())
                    .unwrap_or("?")
                    .to_owned();
                if let Ok(mut r) = repairs.lock() {
                    r.push(Repaired { at, trigger });
                }
                true
            })
            .await;
    })
}

/// The time from `t0` to the first repair after the `seen` first ones, and its trigger.
async fn wait_repair(
    repairs: &Mutex<Vec<Repaired>>,
    seen: usize,
    t0: Instant,
) -> (Option<Duration>, String) {
    loop {
        if let Some(r) = repairs.lock().ok().and_then(|r| r.get(seen).cloned()) {
            return (Some(r.at.saturating_duration_since(t0)), r.trigger);
        }
        if t0.elapsed() > REPAIR_WAIT {
            return (None, String::new());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// The storm: VM 1's firewall rule deleted [`STORM_RATE`] times a second for `secs`.
async fn storm(client: &Client, pid: u32, plan: &VmPlan, secs: u32) -> Result<StormRow, Error> {
    quiet(client).await?;
    let before = notifications(client).await?;
    let cpu0 = proc_cpu_ms(pid);
    let start = Instant::now();
    let listing = inject::table(plan)?;
    let (chain, _) = inject::rule_handle(&listing, &["tcp dport", "accept"])
        .ok_or_else(|| Error::internal("storm: VM 1 has no firewall rule"))?;
    let command = format!("flush chain inet {} {chain}\n", plan.name_prefix);
    let ns = plan.netns.clone();
    let sent = tokio::task::spawn_blocking(move || storm_commands(&ns, &command, secs))
        .await
        .map_err(|e| Error::internal(format!("storm: {e}")))??;
    let wall = start.elapsed();
    let cpu = cpu0
        .zip(proc_cpu_ms(pid))
        .map(|(a, b)| percent(b.saturating_sub(a), wall));
    // Back in place after the storm, within the back-off's longest wait.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut back = None;
    while Instant::now() < deadline {
        let listing = inject::table(plan).unwrap_or_default();
        if inject::rule_handle(&listing, &["tcp dport", "accept"]).is_some() {
            back = Some(start.elapsed().saturating_sub(wall));
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let after = notifications(client).await?;
    let delta = |k: &str| {
        after[k]
            .as_u64()
            .unwrap_or(0)
            .saturating_sub(before[k].as_u64().unwrap_or(0))
    };
    Ok(StormRow {
        secs,
        sent,
        chain,
        cpu,
        checks: delta("checks_total"),
        repairs: delta("repairs_total"),
        backoffs: delta("backoffs_total"),
        back_after: back,
    })
}

/// Sends `command` to one `nft -i` inside `ns` [`STORM_RATE`] times a second for `secs`;
/// returns how many were sent.
fn storm_commands(ns: &str, command: &str, secs: u32) -> Result<u32, Error> {
    use std::io::Write as _;
    let mut child = std::process::Command::new("ip")
        .args(["netns", "exec", ns, "nft", "-i"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| Error::internal(format!("storm: nft -i: {e}")))?;
    let mut sent = 0u32;
    if let Some(mut stdin) = child.stdin.take() {
        let every = Duration::from_secs(1) / STORM_RATE;
        let end = Instant::now() + Duration::from_secs(u64::from(secs));
        let mut next = Instant::now();
        while Instant::now() < end {
            if stdin.write_all(command.as_bytes()).is_err() {
                break;
            }
            sent += 1;
            next += every;
            std::thread::sleep(next.saturating_duration_since(Instant::now()));
        }
    }
    let _ = child.wait();
    Ok(sent)
}

/// A fixed pseudo-random sequence (the bench is repeatable run to run).
struct Lcg(u64);

impl Lcg {
    /// A number in `0..n`.
    fn below(&mut self, n: u32) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        u32::try_from((self.0 >> 33) % u64::from(n.max(1))).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_draws_stay_in_range_and_repeat() {
        let (mut a, mut b) = (Lcg(1), Lcg(1));
        for _ in 0..1000 {
            let x = a.below(7);
            assert!(x < 7);
            assert_eq!(x, b.below(7));
        }
        assert_eq!(Lcg(3).below(1), 0);
    }

    #[test]
    fn cpu_is_a_share_of_one_core() {
        assert!((percent(100, Duration::from_secs(10)) - 1.0).abs() < 1e-9);
    }
}
