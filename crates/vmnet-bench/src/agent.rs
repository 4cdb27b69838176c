//! `vmnet-lab bench agent`: the real agent process (`vmnet serve`) under N VMs put over its API,
//! in a throwaway sandbox: PUT and DELETE latency and the agent's memory and descriptors.
//!
//! It creates a sandbox, starts this executable as `vmnet serve --netns <sandbox host>` with its
//! own SQLite store and unix socket in a fresh directory, and PUTs VMs with user ids 1, 2, …
//! (a mesh address, `0.0.0.0/0` and `::/0` via host; the same configs as `vmnet-lab bench vms`), one
//! after another, each PUT answered after its apply. At 0 VMs and at every checkpoint N
//! (`--count`, cumulative; default 100, 500, 1000) it waits for the next reconcile pass (the
//! agent's periodic full pass: every VM applied, i.e. audited) to finish and reads its duration
//! and, from `/proc/<agent pid>/`: `VmRSS`, `VmHWM` (peak RSS), threads and open descriptors.
//! It prints one row per checkpoint with the PUT latency of the VMs added since the previous
//! one (median, p99) and that pass's duration, then re-PUTs VM 1 (unchanged config) as the
//! steady-state cost. Then it DELETEs every VM (user ids 1, 2, …, so the first deletes run with
//! the most VMs present), each answered after its removal, and waits (up to
//! [`LEFTOVER_WAIT`]) until the host shows no object of the agent's prefix any more: the kernel
//! may finish a VM's device teardown after the DELETE was answered, but nothing may stay.
//!
//! At the last checkpoint it also times `GET /metrics` and the PUT median with and without
//! scrapes running ([`crate::agent_scrape`]).
//!
//! It prints the targets: RSS < 64 MiB at 1000 VMs, descriptors a fixed set plus one metadata
//! listener per VM, PUT ≤ 4 ms and DELETE ≤ 5 ms median, last 100 within 1.2× of first 100.
//!
//! # Cleanup
//! The agent is stopped by pid (SIGTERM, SIGKILL after 5 s) and reaped by a guard, also on error;
//! the sandbox guard deletes its namespaces, then the state directory goes.
//!
//! # Limitations
//! The agent's periodic full passes run while PUTs and DELETEs are measured, as on a live host.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use vmnet_agent::api::types::{AgentStatus, VmView};
use vmnet_agent::client::Client;
use vmnet_kernel::ns::{NetlinkNsDriver, NsDriver};
use vmnet_model::Error;
use vmnet_plan::ns::NsSettings;

use crate::vms::stats;

/// Arguments of this command.
#[derive(Debug, clap::Args)]
pub struct AgentBenchArgs {
    /// Checkpoints: numbers of VMs at which to read the agent's memory (repeatable, cumulative);
    /// default 100, 500 and 1000.
    #[arg(long)]
    pub count: Vec<u32>,
    /// Every namespace-mode feature on each VM, and the guests' metadata connections open at the
    /// last checkpoint.
    #[arg(long)]
    pub all_features: bool,
}

mod report;
pub use report::render;

pub use crate::procstat::{
    ProcUsage, cpu_busy_ms, cpu_line, parse_fd_limit, parse_status, proc_usage,
};

/// A running `vmnet serve`, stopped by its pid and reaped on drop.
pub(crate) struct AgentProc {
    child: Child,
}

impl AgentProc {
    fn start(dir: &Path, host_ns: &str, prefix: &str) -> Result<Self, Error> {
        Self::start_logged(dir, host_ns, prefix, "agent.log", "warn")
    }

    /// Starts `vmnet serve` on the store and socket in `dir`, its log in `dir/log` at the
    /// `RUST_LOG` filter `filter`.
    pub(crate) fn start_logged(
        dir: &Path,
        host_ns: &str,
        prefix: &str,
        log: &str,
        filter: &str,
    ) -> Result<Self, Error> {
        Self::start_with(dir, host_ns, prefix, log, filter, &[])
    }

    /// As [`Self::start_logged`], with `extra` flags of `vmnet serve` added.
    pub(crate) fn start_with(
        dir: &Path,
        host_ns: &str,
        prefix: &str,
        log: &str,
        filter: &str,
        extra: &[&str],
    ) -> Result<Self, Error> {
        let exe = vmnet_sandbox::exe::vmnet()?;
        let log = std::fs::File::create(dir.join(log))
            .map_err(|e| Error::internal(format!("agent log: {e}")))?;
        let child = Command::new(exe)
            .arg("--database-url")
            .arg(format!("sqlite://{}", dir.join("vmnet.db").display()))
            .arg("--socket")
            .arg(dir.join("vmnet.sock"))
            .arg("--state-dir")
            .arg(dir.join("state"))
            .args(["serve", "--netns", host_ns, "--name-prefix", prefix])
            // Packet activity on: the program on every VM's tap, its maps pinned in the state
            // dir (removed after the agent stopped, see `StateDir`).
            .arg("--activity-root")
            .arg(dir.join(ACTIVITY_DIR))
            .args(extra)
            .env("RUST_LOG", filter)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| Error::internal(format!("cannot start vmnet serve: {e}")))?;
        Ok(Self { child })
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        if !matches!(self.child.try_wait(), Ok(None)) {
            return;
        }
        let Ok(raw) = i32::try_from(self.child.id()) else {
            return;
        };
        let pid = Pid::from_raw(raw);
        let _ = kill(pid, Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = kill(pid, Signal::SIGKILL);
        let _ = self.child.wait();
    }
}

/// A fresh directory removed (with its contents) on drop.
pub(crate) struct StateDir(pub(crate) PathBuf);

impl StateDir {
    pub(crate) fn new() -> Result<Self, Error> {
        let p = std::env::temp_dir().join(format!(
            "vmnet-bench-agent-{}-{}",
            std::process::id(),
            vmnet_agent::agent::now_ms()
        ));
        std::fs::create_dir(&p)
            .map_err(|e| Error::internal(format!("state dir {}: {e}", p.display())))?;
        Ok(Self(p))
    }
}

/// Where in the state dir the agent pins its packet-activity maps (a bpffs it mounts there).
pub(crate) const ACTIVITY_DIR: &str = "bpf";

impl Drop for StateDir {
    fn drop(&mut self) {
        // The agent has stopped (dropped first); its pins and bpffs go before the directory.
        let _ = vmnet_kernel::activity::remove_root(&self.0.join(ACTIVITY_DIR));
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One checkpoint of the table.
#[derive(Debug, Clone)]
pub struct AgentRow {
    /// VMs stored and applied.
    pub n: u32,
    /// PUT latencies of the VMs added since the previous checkpoint.
    pub puts: Vec<Duration>,
    /// The agent's usage at this checkpoint.
    pub usage: ProcUsage,
    /// Duration of the reconcile pass waited for at this checkpoint, ms.
    pub pass_ms: Option<u64>,
}

/// The config of VM `uid` (`bench-<uid>`): a mesh address, `0.0.0.0/0` and `::/0` via host.
pub(crate) fn vm_body(uid: u32) -> serde_json::Value {
    serde_json::json!({
        "id": format!("bench-{uid}"),
        "user_id": uid,
        "tenant": 1,
        "mesh_ipv6": format!("fdaa:1::{uid:x}"),
        "network": {"routes": [
            {"destination": "0.0.0.0/0", "via": "host"},
            {"destination": "::/0", "via": "host"}
        ]}
    })
}

/// How long the bench waits, after the last DELETE, for the kernel to finish tearing down.
pub const LEFTOVER_WAIT: Duration = Duration::from_secs(10);

/// The DELETE phase: every VM deleted, then what the host still showed.
#[derive(Debug, Clone, Default)]
pub struct DeletePhase {
    /// DELETE latencies, in deletion order (user id 1 first).
    pub deletes: Vec<Duration>,
    /// User ids with an object of the agent's prefix left on the host after the wait (netns,
    /// host veth, host rule or a route in the VM's host table); empty when clean.
    pub leftovers: Vec<u32>,
    /// How long after the last DELETE the host was clean (or the wait gave up).
    pub settled_after: Duration,
}

/// DELETEs VMs `1..=n` one after another, then waits until the host shows no object of them.
async fn delete_all(
    client: &Client,
    n: u32,
    host: &str,
    prefix: &str,
) -> Result<DeletePhase, Error> {
    let mut deletes = Vec::with_capacity(usize::try_from(n).unwrap_or(0));
    for uid in 1..=n {
        let t = Instant::now();
        let _: VmView = client
            .delete(&format!("/v1/vms/bench-{uid}"))
            .await
            .map_err(|e| Error::internal(format!("DELETE vm {uid}: {}", e.message)))?;
        deletes.push(t.elapsed());
    }
    let done = Instant::now();
    // A driver of our own, only to observe what the agent's prefix still has on the host.
    let settings = NsSettings {
        name_prefix: prefix.to_owned(),
        ..NsSettings::default()
    };
    let observer = NetlinkNsDriver::new(settings, Some(host.to_owned()))
        .map_err(|e| Error::internal(format!("observer: {e}")))?;
    loop {
        let left: Vec<u32> = observer
            .observe()
            .await
            .map_err(|e| Error::internal(format!("observe: {e}")))?
            .into_iter()
            .map(|o| o.user_id)
            .collect();
        if left.is_empty() || done.elapsed() > LEFTOVER_WAIT {
            return Ok(DeletePhase {
                deletes,
                leftovers: left,
                settled_after: done.elapsed(),
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until a reconcile pass has started and finished after `since_ms` (Unix ms); returns
/// its duration (ms).
pub(crate) async fn settle(
    client: &Client,
    since_ms: i64,
    log: &Path,
) -> Result<Option<u64>, Error> {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let st: AgentStatus = client.get("/v1/status").await?;
        let r = &st.reconcile;
        if r.last_started_at_unix_ms.is_some_and(|s| s >= since_ms)
            && r.last_finished_at_unix_ms >= r.last_started_at_unix_ms
        {
            return Ok(r.last_duration_ms);
        }
        if Instant::now() > deadline {
            return Err(Error::internal(format!(
                "no reconcile pass finished; agent log:\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Runs the command.
///
/// # Errors
/// `INVALID_INPUT` when not root or for a bad count; `INTERNAL` when the sandbox or the agent
/// fails, or an API error of a PUT.
pub async fn run(args: AgentBenchArgs) -> Result<(), Error> {
    if !nix::unistd::geteuid().is_root() {
        return Err(Error::invalid(
            "vmnet-lab bench agent must run as root (it creates network namespaces)",
        ));
    }
    let mut counts = if args.count.is_empty() {
        vec![100, 500, 1000]
    } else {
        args.count.clone()
    };
    counts.sort_unstable();
    counts.dedup();
    if let Some(bad) = counts
        .iter()
        .find(|&&n| n == 0 || n > vmnet_model::vm::MAX_USER_ID)
    {
        return Err(Error::invalid(format!(
            "--count {bad}: must be 1..={}",
            vmnet_model::vm::MAX_USER_ID
        )));
    }
    let sb = vmnet_sandbox::Sandbox::new("ba")
        .map_err(|e| Error::internal(format!("bench sandbox: {e}")))?;
    let dir = StateDir::new()?;
    let log = dir.0.join("agent.log");
    let agent = AgentProc::start(&dir.0, &sb.host(), &sb.agent_prefix())?;
    eprintln!(
        "bench sandbox {} (host netns {}), agent pid {}",
        sb.prefix(),
        sb.host(),
        agent.pid()
    );
    let client = Client::new(dir.0.join("vmnet.sock"));
    let ready = Instant::now() + Duration::from_secs(30);
    while client.get::<AgentStatus>("/v1/status").await.is_err() {
        if Instant::now() > ready {
            return Err(Error::internal(format!(
                "agent not ready; log:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let usage =
        |pid: u32| proc_usage(pid).map_err(|e| Error::internal(format!("agent {pid} gone: {e}")));
    let pass_ms = settle(&client, 0, &log).await?;
    let mut rows = vec![AgentRow {
        n: 0,
        puts: Vec::new(),
        usage: usage(agent.pid())?,
        pass_ms,
    }];
    let body = |uid: u32| {
        if args.all_features {
            crate::agent_load::vm_body_full(uid)
        } else {
            vm_body(uid)
        }
    };
    let last_n = counts.last().copied().unwrap_or(0);
    // Host CPU busy time around the first and the last 100 PUTs.
    let group = 100.min(last_n);
    let (mut first_cpu, mut last_cpu) = ((None, None), (None, None));
    let mut next = 1;
    for &n in &counts {
        let mut puts = Vec::new();
        for uid in next..=n {
            if uid == 1 {
                first_cpu.0 = cpu_busy_ms();
            }
            if uid + group == last_n + 1 {
                last_cpu.0 = cpu_busy_ms();
            }
            let t = Instant::now();
            put_vm(&client, uid, &body(uid), &log).await?;
            puts.push(t.elapsed());
            if uid == group {
                first_cpu.1 = cpu_busy_ms();
            }
            if uid == last_n {
                last_cpu.1 = cpu_busy_ms();
            }
        }
        next = n + 1;
        let since = vmnet_agent::agent::now_ms();
        let pass_ms = settle(&client, since, &log).await?;
        rows.push(AgentRow {
            n,
            puts,
            usage: usage(agent.pid())?,
            pass_ms,
        });
    }
    let guests = if args.all_features {
        let g = crate::agent_load::connect_guests(last_n, &sb.agent_prefix(), body)?;
        // Read while every connection is open; they close when `g` is dropped.
        Some((usage(agent.pid())?, g.open, g.failed))
    } else {
        None
    };
    // The steady-state cost: re-PUT VM 1 unchanged 100 times.
    let mut again = Vec::new();
    for _ in 0..100 {
        let t = Instant::now();
        let _: VmView = client.put("/v1/vms/bench-1", &body(1)).await?;
        again.push(t.elapsed());
    }
    let after = usage(agent.pid())?;
    let scraped = crate::agent_scrape::measure(&client, last_n, &body).await?;
    let deleted = delete_all(&client, last_n, &sb.host(), &sb.agent_prefix()).await?;
    print!("{}", render(&rows, stats(&again), &after, &deleted));
    print!("{}", crate::agent_scrape::render(&scraped));
    if let Some(line) = cpu_line(first_cpu, last_cpu, group) {
        println!("{line}");
    }
    if let Some((u, open, failed)) = &guests {
        println!(
            "every feature on (limits, public IPv4+IPv6, 50-prefix firewall, metadata, activity; no mesh data plane); agent RSS at N={last_n} with {open} guests' metadata keep-alive connections open ({failed} failed): {:.1} MiB (target < 64 MiB)",
            u.rss_kib as f64 / 1024.0
        );
    }
    drop(agent);
    drop(sb);
    drop(dir);
    Ok(())
}

/// PUTs bench VM `uid` with `body`; a failure names the VM and ends with the agent's log.
pub(crate) async fn put_vm(
    client: &Client,
    uid: u32,
    body: &serde_json::Value,
    log: &Path,
) -> Result<VmView, Error> {
    client
        .put(&format!("/v1/vms/bench-{uid}"), body)
        .await
        .map_err(|e| {
            Error::internal(format!(
                "PUT vm {uid}: {}; the agent log ends:\n{}",
                e.message,
                log_tail(log, 40)
            ))
        })
}

/// The last `n` lines of the agent's log (empty when it cannot be read).
pub(crate) fn log_tail(log: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
