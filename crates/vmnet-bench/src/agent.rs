//! `vmnet bench agent`: the real agent process (`vmnet serve`) under N VMs put over its API,
//! in a throwaway sandbox: PUT latency and the agent's memory and descriptors.
//!
//! It creates a sandbox, starts this executable as `vmnet serve --netns <sandbox host>` with its
//! own SQLite store and unix socket in a fresh directory, and PUTs VMs with user ids 1, 2, …
//! (a mesh address, `0.0.0.0/0` and `::/0` via host; the same configs as `vmnet bench vms`), one
//! after another, each PUT answered after its apply. At 0 VMs and at every checkpoint N
//! (`--count`, cumulative; default 100, 500, 1000) it waits for the reconcile pass the PUTs
//! triggered to finish and reads from `/proc/<agent pid>/`: `VmRSS`, `VmHWM` (peak RSS),
//! threads and open descriptors. It prints one row per checkpoint with the PUT latency of the
//! VMs added since the previous one (median, p99), then re-PUTs VM 1 (unchanged config) as the
//! steady-state cost, and the targets of the issue: RSS < 64 MiB at 1000 VMs, and descriptors
//! well under a 1024 limit.
//!
//! # Cleanup
//! The agent is stopped by its pid (SIGTERM, then SIGKILL after 5 s) and reaped by a guard, also
//! on error; the sandbox guard then deletes every namespace of the sandbox (with the VMs' links),
//! and the state directory is removed.
//!
//! # Limitations
//! The reconcile interval is the agent's default; RSS is read after the pass the PUTs woke, so a
//! periodic full pass may overlap a reading (it adds little: passes run one VM at a time).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use vmnet_agent::api::types::{AgentStatus, VmView};
use vmnet_agent::client::Client;
use vmnet_model::Error;

use crate::vms::{Stats, stats};

/// Arguments of this command.
#[derive(Debug, clap::Args)]
pub struct AgentBenchArgs {
    /// Checkpoints: numbers of VMs at which to read the agent's memory (repeatable, cumulative);
    /// default 100, 500 and 1000.
    #[arg(long)]
    pub count: Vec<u32>,
}

/// What `/proc/<pid>/` shows of a process.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProcUsage {
    /// `VmRSS`, KiB.
    pub rss_kib: u64,
    /// `VmHWM` (peak RSS), KiB.
    pub hwm_kib: u64,
    /// `Threads`.
    pub threads: u64,
    /// Entries of `/proc/<pid>/fd`.
    pub fds: u64,
    /// The soft `Max open files` limit (`None` when unlimited or unreadable).
    pub fd_limit: Option<u64>,
}

/// Parses `Key:   value ...` lines of a `/proc/<pid>/status` text into [`ProcUsage`] (without
/// descriptors).
#[must_use]
pub fn parse_status(text: &str) -> ProcUsage {
    let field = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    ProcUsage {
        rss_kib: field("VmRSS"),
        hwm_kib: field("VmHWM"),
        threads: field("Threads"),
        ..ProcUsage::default()
    }
}

/// The soft limit on open files from a `/proc/<pid>/limits` text.
#[must_use]
pub fn parse_fd_limit(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Reads [`ProcUsage`] of process `pid`.
///
/// # Errors
/// When `/proc/<pid>/status` cannot be read (the process is gone).
pub fn proc_usage(pid: u32) -> std::io::Result<ProcUsage> {
    let base = PathBuf::from(format!("/proc/{pid}"));
    let mut u = parse_status(&std::fs::read_to_string(base.join("status"))?);
    u.fds = std::fs::read_dir(base.join("fd"))?.count() as u64;
    u.fd_limit = std::fs::read_to_string(base.join("limits"))
        .ok()
        .as_deref()
        .and_then(parse_fd_limit);
    Ok(u)
}

/// A running `vmnet serve`, stopped by its pid and reaped on drop.
struct AgentProc {
    child: Child,
}

impl AgentProc {
    fn start(dir: &Path, host_ns: &str, prefix: &str) -> Result<Self, Error> {
        let exe = std::env::current_exe()
            .map_err(|e| Error::internal(format!("cannot find this executable: {e}")))?;
        let log = std::fs::File::create(dir.join("agent.log"))
            .map_err(|e| Error::internal(format!("agent log: {e}")))?;
        let child = Command::new(exe)
            .arg("--database-url")
            .arg(format!("sqlite://{}", dir.join("vmnet.db").display()))
            .arg("--socket")
            .arg(dir.join("vmnet.sock"))
            .args(["serve", "--netns", host_ns, "--name-prefix", prefix])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| Error::internal(format!("cannot start vmnet serve: {e}")))?;
        Ok(Self { child })
    }

    fn pid(&self) -> u32 {
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
struct StateDir(PathBuf);

impl StateDir {
    fn new() -> Result<Self, Error> {
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

impl Drop for StateDir {
    fn drop(&mut self) {
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
}

fn vm_body(uid: u32) -> serde_json::Value {
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

/// Waits until a reconcile pass has started and finished after `since_ms` (Unix ms).
async fn settle(client: &Client, since_ms: i64, log: &Path) -> Result<(), Error> {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let st: AgentStatus = client.get("/v1/status").await?;
        let r = &st.reconcile;
        if r.last_started_at_unix_ms.is_some_and(|s| s >= since_ms)
            && r.last_finished_at_unix_ms >= r.last_started_at_unix_ms
        {
            return Ok(());
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
            "vmnet bench agent must run as root (it creates network namespaces)",
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
    settle(&client, 0, &log).await?;
    let mut rows = vec![AgentRow {
        n: 0,
        puts: Vec::new(),
        usage: usage(agent.pid())?,
    }];
    let mut next = 1;
    for &n in &counts {
        let mut puts = Vec::new();
        for uid in next..=n {
            let t = Instant::now();
            let _: VmView = client
                .put(&format!("/v1/vms/bench-{uid}"), &vm_body(uid))
                .await
                .map_err(|e| Error::internal(format!("PUT vm {uid}: {}", e.message)))?;
            puts.push(t.elapsed());
        }
        next = n + 1;
        let since = vmnet_agent::agent::now_ms();
        settle(&client, since, &log).await?;
        rows.push(AgentRow {
            n,
            puts,
            usage: usage(agent.pid())?,
        });
    }
    // The steady-state cost: re-PUT VM 1 unchanged 100 times.
    let mut again = Vec::new();
    for _ in 0..100 {
        let t = Instant::now();
        let _: VmView = client.put("/v1/vms/bench-1", &vm_body(1)).await?;
        again.push(t.elapsed());
    }
    let after = usage(agent.pid())?;
    print!("{}", render(&rows, stats(&again), &after));
    drop(agent);
    drop(sb);
    drop(dir);
    Ok(())
}

fn mib(kib: u64) -> String {
    format!("{:.1}", kib as f64 / 1024.0)
}

/// Renders the table and the target lines.
#[must_use]
pub fn render(rows: &[AgentRow], again: Stats, after: &ProcUsage) -> String {
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let s = stats(&r.puts);
            let put = |v: f64| {
                if r.puts.is_empty() {
                    "-".to_owned()
                } else {
                    format!("{v:.2}")
                }
            };
            vec![
                r.n.to_string(),
                r.puts.len().to_string(),
                put(s.median),
                put(s.p99),
                mib(r.usage.rss_kib),
                mib(r.usage.hwm_kib),
                r.usage.threads.to_string(),
                match r.usage.fd_limit {
                    Some(l) => format!("{}/{l}", r.usage.fds),
                    None => r.usage.fds.to_string(),
                },
            ]
        })
        .collect();
    let mut out = vmnet_agent::table::render(
        &[
            "VMS",
            "PUTS",
            "PUT MED ms",
            "PUT P99 ms",
            "RSS MiB",
            "HWM MiB",
            "THREADS",
            "FDS/LIMIT",
        ],
        &table,
    );
    out.push('\n');
    let _ = writeln!(
        out,
        "re-PUT of an unchanged VM x100: median {:.2} ms, p99 {:.2} ms; RSS after {} MiB, HWM {} MiB",
        again.median,
        again.p99,
        mib(after.rss_kib),
        mib(after.hwm_kib)
    );
    if let (Some(first), Some(last)) = (rows.first(), rows.last())
        && last.n > first.n
    {
        let per_vm = last.usage.rss_kib.saturating_sub(first.usage.rss_kib) as f64
            / f64::from(last.n - first.n);
        let _ = writeln!(
            out,
            "RSS growth: {per_vm:.1} KiB per VM from {} to {} VMs",
            first.n, last.n
        );
    }
    if let Some(r) = rows.iter().find(|r| r.n >= 1000) {
        let m = r.usage.rss_kib as f64 / 1024.0;
        let _ = writeln!(
            out,
            "agent RSS at N={}: {m:.1} MiB (target < 64 MiB at 1000): {}",
            r.n,
            if m < 64.0 { "met" } else { "MISSED" }
        );
    }
    if let Some(r) = rows.last() {
        let _ = writeln!(
            out,
            "open descriptors at N={}: {} (independent of N; limit {}): {}",
            r.n,
            r.usage.fds,
            r.usage
                .fd_limit
                .map_or_else(|| "unlimited".to_owned(), |l| l.to_string()),
            if r.usage.fds < 256 { "ok" } else { "HIGH" }
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_status_and_limits() {
        let status = "Name:\tvmnet\nVmHWM:\t   70000 kB\nVmRSS:\t   65536 kB\nThreads:\t7\n";
        let u = parse_status(status);
        assert_eq!((u.rss_kib, u.hwm_kib, u.threads), (65536, 70000, 7));
        let limits = "Limit                     Soft Limit           Hard Limit           Units\n\
                      Max open files            1024                 524288               files\n";
        assert_eq!(parse_fd_limit(limits), Some(1024));
        assert_eq!(
            parse_fd_limit("Max open files            unlimited            unlimited   files"),
            None
        );
        // This process: real numbers.
        let me = proc_usage(std::process::id()).expect("own /proc");
        assert!(
            me.rss_kib > 0 && me.hwm_kib >= me.rss_kib && me.fds > 2,
            "{me:?}"
        );
    }

    #[test]
    fn renders_rows_and_targets() {
        let row = |n: u32, rss_mib: u64| AgentRow {
            n,
            puts: vec![Duration::from_millis(3); n as usize],
            usage: ProcUsage {
                rss_kib: rss_mib * 1024,
                hwm_kib: rss_mib * 1024,
                threads: 5,
                fds: 20,
                fd_limit: Some(1024),
            },
        };
        let text = render(
            &[row(0, 20), row(1000, 70)],
            Stats::default(),
            &ProcUsage::default(),
        );
        assert!(text.contains("20/1024"), "{text}");
        assert!(text.contains("51.2 KiB per VM"), "{text}");
        assert!(
            text.contains("70.0 MiB (target < 64 MiB at 1000): MISSED"),
            "{text}"
        );
        let text = render(
            &[row(0, 20), row(1000, 30)],
            Stats::default(),
            &ProcUsage::default(),
        );
        assert!(
            text.contains("30.0 MiB (target < 64 MiB at 1000): met"),
            "{text}"
        );
    }
}
