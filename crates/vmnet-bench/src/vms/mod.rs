//! `vmnet-lab bench vms`: per-VM setup/teardown latency of the namespace-mode driver against the
//! shell baseline, in a throwaway sandbox.
//!
//! For each N (default 1, 100, 1000), starting from an empty sandbox host namespace:
//!
//! 1. **netlink**: N VMs (user ids 1..=N, a mesh address, `0.0.0.0/0` and `::/0` via host, both
//!    throughput limits: private 100, public 20 MiB/s) are set up one after another with
//!    [`vmnet_kernel::ns::NetlinkNsDriver`] (`apply` of each VM's plan), timing each; then the
//!    process's `VmRSS` is read; then every VM's public limit is changed to 25 MiB/s
//!    (`apply_limits` each, timed: the HTB classes changed in place); then every VM is removed
//!    (`remove`), one after another, each removal timed (deleting a veth waits ~30 ms in the
//!    kernel, so this phase dominates the run time).
//! 2. **shell**: the same N plans are set up by forking `ip` and `nft` per step, as a shell
//!    script would (netns, veth with the peer in the netns, tap, MTUs, addresses, sysctls, routes,
//!    rules, `nft -j -f` of the same table; [`shell_setup`]), and torn down with `ip link del` +
//!    `ip netns del` ([`shell_teardown`]), one after another.
//!
//! It prints one row per N and method (setup median/p99, teardown median/p99 and wall time,
//! RSS after the setups, with the growth during that round in parentheses), the median of the first 100 setups against the last 100 at the largest N, and the
//! targets of the issue: setup median ≤ 5 ms, ≥ 10× faster than the shell, last-100 within 1.5×
//! of the first-100, RSS < 64 MiB at 1000 VMs.
//!
//! # Limitations
//! RSS is this process's (it runs the same driver the agent runs, without the agent's HTTP
//! server and store, with the agent's allocator settings: one malloc arena, free heap handed
//! back before each round as the agent does after each reconcile pass). The shell baseline needs `ip` and `nft` on `PATH`. Removals run one at a
//! time: the driver shares one host netlink socket, and concurrent route dumps on it overflow
//! its receive buffer (`ENOBUFS`); the agent serializes its operations the same way.

mod config;
pub mod firewall;
pub mod public;
mod shell;

use self::config::{vm_config, vm_config_with};

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vmnet_kernel::ns::{NetlinkNsDriver, NsDriver};
use vmnet_model::Error;
use vmnet_model::error::chain;
use vmnet_plan::ns::{NsSettings, VmPlan, plan_vm};

use self::shell::run_cmds;
pub use self::shell::{shell_setup, shell_teardown};

/// Arguments of this command.
#[derive(Debug, clap::Args)]
pub struct VmsBenchArgs {
    /// Numbers of VMs to set up and tear down (repeatable); default 1, 100 and 1000.
    #[arg(long)]
    pub count: Vec<u32>,
    /// Run the shell baseline for at most this many VMs per round (it forks ~20 commands per
    /// VM); default: as many as the netlink round.
    #[arg(long)]
    pub shell_max: Option<u32>,
    /// Give every VM a public IPv4 (documentation ranges: the first 768 VMs) and a public IPv6
    /// /128, and time removing and adding one VM's public mapping at each N.
    #[arg(long)]
    pub public: bool,
    /// Give every VM a 50-prefix firewall; time one VM's firewall change and an audit pass.
    #[arg(long)]
    pub firewall: bool,
    /// Run the driver without the kernel-notification watcher the agent runs (the sockets of
    /// every VM netns, their notifications read and discarded as the agent's own changes).
    #[arg(long)]
    pub no_watch: bool,
}

/// Latency statistics of one phase.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Stats {
    /// Median, ms.
    pub median: f64,
    /// 99th percentile, ms.
    pub p99: f64,
}

/// The median and 99th percentile (nearest rank) of `samples`, in milliseconds.
#[must_use]
pub fn stats(samples: &[Duration]) -> Stats {
    if samples.is_empty() {
        return Stats::default();
    }
    let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
    ms.sort_by(f64::total_cmp);
    // Nearest rank: the ceil(0.99 n)-th smallest sample.
    let p99_rank = (99 * ms.len()).div_ceil(100).clamp(1, ms.len());
    let median = if ms.len() % 2 == 1 {
        ms[ms.len() / 2]
    } else {
        f64::midpoint(ms[ms.len() / 2 - 1], ms[ms.len() / 2])
    };
    Stats {
        median,
        p99: ms[p99_rank - 1],
    }
}

/// One row of the table.
#[derive(Debug, Clone)]
pub struct Row {
    /// Number of VMs.
    pub n: u32,
    /// `netlink` or `shell`.
    pub method: &'static str,
    /// Setup latencies.
    pub setup: Vec<Duration>,
    /// Teardown latencies.
    pub teardown: Vec<Duration>,
    /// Wall time of the whole teardown.
    pub teardown_wall: Duration,
    /// VmRSS after setup, KiB (netlink only).
    pub rss_kib: Option<u64>,
    /// VmRSS before the first setup of this round, KiB (netlink only).
    pub rss_before_kib: Option<u64>,
    /// Limit changes (public 20 → 25 MiB/s on every VM, an `apply` each; netlink only).
    pub change: Vec<Duration>,
    /// tc objects in the VM namespaces after the teardown (qdiscs, classes and filters of
    /// namespaces with our prefix; 0 when nothing leaked; netlink only).
    pub leftover_netns: Option<usize>,
    /// With `--public`: one VM's public mapping added / removed (whole apply), latencies.
    pub mapping: Option<(Vec<Duration>, Vec<Duration>)>,
    /// With `--firewall`: firewall change latencies, the first and the steady audit pass's
    /// wall times, tables they rewrote.
    pub firewall: Option<(firewall::Changes, (Duration, Duration), usize)>,
}

/// The private and public limits of every bench VM, MiB/s.
pub const LIMITS: (u32, u32) = (100, 20);
/// The public limit a limit change sets, MiB/s.
pub const CHANGED_PUBLIC: u32 = 25;

/// The `VmRSS` of this process in KiB.
#[must_use]
pub fn rss_kib() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn ms(d: f64) -> String {
    format!("{d:.2}")
}

/// Runs the command.
///
/// # Errors
/// `INVALID_INPUT` when not root or for a bad count; `INTERNAL` when the sandbox, the driver or
/// a shell command fails.
pub async fn run(args: VmsBenchArgs) -> Result<(), Error> {
    if !nix::unistd::geteuid().is_root() {
        return Err(Error::invalid(
            "vmnet-lab bench vms must run as root (it creates network namespaces)",
        ));
    }
    let counts = if args.count.is_empty() {
        vec![1, 100, 1000]
    } else {
        args.count.clone()
    };
    if let Some(bad) = counts
        .iter()
        .find(|&&n| n == 0 || n > vmnet_model::vm::MAX_USER_ID)
    {
        return Err(Error::invalid(format!(
            "--count {bad}: must be 1..={}",
            vmnet_model::vm::MAX_USER_ID
        )));
    }
    let sb = vmnet_sandbox::Sandbox::new("bv")
        .map_err(|e| Error::internal(format!("bench sandbox: {}", chain(&e))))?;
    let host = sb.host();
    let settings = NsSettings {
        name_prefix: sb.agent_prefix(),
        ..NsSettings::default()
    };
    let mut driver = NetlinkNsDriver::new(settings.clone(), Some(host.clone()))
        .map_err(|e| Error::internal(format!("driver: {e}")))?;
    // Every change is the bench's own, so its notifications are read and discarded, as the
    // agent's are (the agent quiets the namespaces of one change at a time; here every
    // namespace is quiet for the whole run).
    let _events = if args.no_watch {
        None
    } else {
        Some(
            driver
                .watch_kernel()
                .map_err(|e| Error::internal(format!("watcher: {e}")))?,
        )
    };
    let driver = Arc::new(driver);
    let _quiet = driver.watcher().map(|w| w.quiet_all());
    eprintln!("bench sandbox {} (host netns {host})", sb.prefix());
    let mut rows = Vec::new();
    for &n in &counts {
        rows.push(bench_netlink(&driver, &settings, n, args.public, args.firewall).await?);
        let shell_n = args.shell_max.map_or(n, |m| n.min(m));
        if shell_n > 0 {
            let host2 = host.clone();
            let sub: Vec<VmPlan> = (1..=shell_n)
                .map(|uid| vm_config(uid).and_then(|c| plan_vm(&c, &settings)))
                .collect::<Result<_, _>>()?;
            let mut row = tokio::task::spawn_blocking(move || bench_shell(&sub, &host2))
                .await
                .map_err(|e| Error::internal(format!("shell baseline: {e}")))??;
            row.n = n;
            rows.push(row);
        }
    }
    print!("{}", render(&rows));
    drop(driver);
    drop(sb);
    Ok(())
}

/// Sets up VMs 1..=n with the driver (each plan made just before its timed apply and dropped
/// after it, so the RSS is the driver's and the runtime's, not a list of plans), then removes them.
async fn bench_netlink(
    driver: &Arc<NetlinkNsDriver>,
    settings: &NsSettings,
    n: u32,
    public: bool,
    with_fw: bool,
) -> Result<Row, Error> {
    let fw = with_fw.then_some(0);
    // The agent hands free heap back after every reconcile pass; the rounds before this one
    // (their audits list every table) leave theirs here.
    vmnet_agent::malloc::release_free();
    let rss_before = rss_kib();
    let mut setup = Vec::with_capacity(usize::try_from(n).unwrap_or(0));
    for uid in 1..=n {
        let p = &plan_vm(&vm_config_with(uid, LIMITS.1, public, fw)?, settings)?;
        let t = Instant::now();
        driver
            .apply(p)
            .await
            .map_err(|e| Error::internal(format!("apply vm {}: {e}", p.user_id)))?;
        setup.push(t.elapsed());
    }
    let rss = rss_kib();
    let mut change = Vec::with_capacity(usize::try_from(n).unwrap_or(0));
    for uid in 1..=n {
        let p = &plan_vm(&vm_config_with(uid, CHANGED_PUBLIC, public, fw)?, settings)?;
        let t = Instant::now();
        let changes = driver
            .apply_limits(p)
            .await
            .map_err(|e| Error::internal(format!("limit change vm {}: {e}", p.user_id)))?;
        change.push(t.elapsed());
        if changes.len() != 4 {
            return Err(Error::internal(format!(
                "limit change vm {uid}: expected the classes written in place, got {changes:?}"
            )));
        }
    }
    let mapping = if public {
        // The middle VM: neither the first nor the last made.
        let uid = n.div_ceil(2);
        Some(
            public::bench_mapping(driver.as_ref(), settings, uid, |with| {
                Ok(vm_config_with(uid, LIMITS.1, with, fw)?)
            })
            .await?,
        )
    } else {
        None
    };
    let firewall = if with_fw {
        let uid = n.div_ceil(2);
        let change = firewall::bench_change(driver.as_ref(), settings, uid, |variant| {
            Ok(vm_config_with(uid, CHANGED_PUBLIC, public, Some(variant))?)
        })
        .await?;
        let (first, steady, rewritten) =
            firewall::bench_audit(driver.as_ref(), settings, n, |uid| {
                Ok(vm_config_with(uid, CHANGED_PUBLIC, public, fw)?)
            })
            .await?;
        Some((change, (first, steady), rewritten))
    } else {
        None
    };
    let wall = Instant::now();
    let mut teardown = Vec::with_capacity(usize::try_from(n).unwrap_or(0));
    for uid in 1..=n {
        let t = Instant::now();
        driver
            .remove(uid)
            .await
            .map_err(|e| Error::internal(format!("remove vm {uid}: {e}")))?;
        teardown.push(t.elapsed());
    }
    let teardown_wall = wall.elapsed();
    // Every tc object lives on a VM's tap or veth end, inside its netns: none may outlive it.
    let leftover = vmnet_sandbox::netns::list(&settings.name_prefix)
        .into_iter()
        .filter(|ns| {
            vmnet_plan::ns::parse_uid(&settings.name_prefix, vmnet_plan::ns::NameKind::Netns, ns)
                .is_some()
        })
        .count();
    Ok(Row {
        n,
        method: "netlink",
        setup,
        teardown,
        teardown_wall,
        rss_kib: rss,
        rss_before_kib: rss_before,
        change,
        leftover_netns: Some(leftover),
        mapping,
        firewall,
    })
}

fn bench_shell(plans: &[VmPlan], host: &str) -> Result<Row, Error> {
    let mut setup = Vec::with_capacity(plans.len());
    for p in plans {
        let cmds = shell_setup(p, host);
        let nft = serde_json::to_vec(&p.nft).map_err(|e| Error::internal(e.to_string()))?;
        let t = Instant::now();
        run_cmds(&cmds, Some(&nft))?;
        setup.push(t.elapsed());
    }
    let wall = Instant::now();
    let mut teardown = Vec::with_capacity(plans.len());
    for p in plans {
        let t = Instant::now();
        run_cmds(&shell_teardown(p, host), None)?;
        teardown.push(t.elapsed());
    }
    let n = u32::try_from(plans.len()).unwrap_or(u32::MAX);
    Ok(Row {
        n,
        method: "shell",
        setup,
        teardown,
        teardown_wall: wall.elapsed(),
        rss_kib: None,
        rss_before_kib: None,
        change: Vec::new(),
        leftover_netns: None,
        mapping: None,
        firewall: None,
    })
}

/// Renders the table and the target lines.
#[must_use]
pub fn render(rows: &[Row]) -> String {
    let mut out = String::new();
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let (s, t) = (stats(&r.setup), stats(&r.teardown));
            vec![
                r.n.to_string(),
                r.method.into(),
                r.setup.len().to_string(),
                ms(s.median),
                ms(s.p99),
                ms(t.median),
                ms(t.p99),
                format!("{:.1}", r.teardown_wall.as_secs_f64()),
                match (r.rss_before_kib, r.rss_kib) {
                    (Some(b), Some(a)) => {
                        format!(
                            "{:.1} (+{:.1})",
                            a as f64 / 1024.0,
                            a.saturating_sub(b) as f64 / 1024.0
                        )
                    }
                    (_, Some(a)) => format!("{:.1}", a as f64 / 1024.0),
                    _ => "-".into(),
                },
            ]
        })
        .collect();
    out.push_str(&vmnet_agent::table::render(
        &[
            "N",
            "METHOD",
            "VMS",
            "SETUP MED ms",
            "SETUP P99 ms",
            "TEARDOWN MED ms",
            "TEARDOWN P99 ms",
            "TEARDOWN WALL s",
            "RSS MiB (+ROUND)",
        ],
        &table,
    ));
    out.push('\n');
    let netlink_max = rows
        .iter()
        .filter(|r| r.method == "netlink")
        .max_by_key(|r| r.n);
    for r in rows.iter().filter(|r| r.method == "netlink") {
        if let Some((add, remove)) = &r.mapping {
            let (a, d) = (stats(add), stats(remove));
            let _ = writeln!(
                out,
                "one VM's public mapping at N={}: add median {} ms (p99 {}), remove median {} ms (p99 {}), {} each",
                r.n,
                ms(a.median),
                ms(a.p99),
                ms(d.median),
                ms(d.p99),
                add.len()
            );
        }
    }
    for r in rows.iter().filter(|r| r.method == "netlink") {
        if let Some((change, audit, rewritten)) = &r.firewall {
            out.push_str(&firewall::lines(r.n, change, *audit, *rewritten));
        }
    }
    if let Some(r) = netlink_max {
        let s = stats(&r.setup);
        let _ = writeln!(
            out,
            "setup median at N={}: {} ms (target <= 5 ms): {}",
            r.n,
            ms(s.median),
            verdict(s.median <= 5.0)
        );
        if let Some(sh) = rows.iter().find(|x| x.method == "shell" && x.n == r.n) {
            let ratio = stats(&sh.setup).median / s.median.max(1e-9);
            let _ = writeln!(
                out,
                "shell / netlink setup median at N={}: {ratio:.1}x (target >= 10x): {}",
                r.n,
                verdict(ratio >= 10.0)
            );
        }
        if r.setup.len() >= 200 {
            let first = stats(&r.setup[..100]).median;
            let last = stats(&r.setup[r.setup.len() - 100..]).median;
            let ratio = last / first.max(1e-9);
            let _ = writeln!(
                out,
                "first-100 vs last-100 setup median at N={}: {} ms vs {} ms = {ratio:.2}x (target <= 1.5x): {}",
                r.n,
                ms(first),
                ms(last),
                verdict(ratio <= 1.5)
            );
        }
        let c = stats(&r.change);
        let _ = writeln!(
            out,
            "limit change median at N={} (public {} -> {CHANGED_PUBLIC} MiB/s, classes changed in place): {} ms, p99 {} ms (target <= 1 ms): {}",
            r.n,
            LIMITS.1,
            ms(c.median),
            ms(c.p99),
            verdict(c.median <= 1.0)
        );
        if let Some(left) = r.leftover_netns {
            let _ = writeln!(
                out,
                "VM namespaces (and with them tc objects) left after the teardown at N={}: {left}: {}",
                r.n,
                verdict(left == 0)
            );
        }
        if let Some(k) = r.rss_kib {
            let mib = k as f64 / 1024.0;
            let _ = writeln!(
                out,
                "RSS at N={}: {mib:.1} MiB (target < 64 MiB at 1000): {}",
                r.n,
                verdict(mib < 64.0)
            );
        }
    }
    out
}

fn verdict(ok: bool) -> &'static str {
    if ok { "met" } else { "MISSED" }
}

#[cfg(test)]
mod tests;
