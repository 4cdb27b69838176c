//! What `/proc` says about a process (resident memory, threads and open descriptors) and about
//! the host's CPU time, for the agent bench's report.

use std::path::PathBuf;

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

/// The host's CPU time spent running, in ms, from the first (`cpu`) line of a `/proc/stat` text
/// with `ticks_per_sec` clock ticks per second: user, nice, system, irq and softirq, so neither
/// idle and I/O wait nor the time a hypervisor gave another machine (steal). Work of every
/// process and of the kernel's own threads counts, wherever it ran.
#[must_use]
pub fn parse_cpu_busy_ms(text: &str, ticks_per_sec: u64) -> Option<u64> {
    let fields: Vec<u64> = text
        .lines()
        .next()?
        .strip_prefix("cpu ")?
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    // user nice system idle iowait irq softirq steal …
    let busy = [0, 1, 2, 5, 6]
        .iter()
        .map(|&i| fields.get(i).copied())
        .sum::<Option<u64>>()?;
    Some(busy * 1000 / ticks_per_sec.max(1))
}

/// [`parse_cpu_busy_ms`] of this host now (`None` when `/proc/stat` cannot be read).
#[must_use]
pub fn cpu_busy_ms() -> Option<u64> {
    // SAFETY: sysconf only reads a configuration value.
    let hz = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).ok()?;
    parse_cpu_busy_ms(&std::fs::read_to_string("/proc/stat").ok()?, hz)
}

/// A process's CPU time in ms (user and system, of every thread, live or ended) from its
/// `/proc/<pid>/stat` text with `ticks_per_sec` clock ticks per second.
#[must_use]
pub fn parse_proc_cpu_ms(text: &str, ticks_per_sec: u64) -> Option<u64> {
    // The command name may hold spaces and parentheses: the fields follow the last `)`.
    let (_, rest) = text.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // state is field 3 of stat(5); utime and stime are fields 14 and 15.
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(ticks * 1000 / ticks_per_sec.max(1))
}

/// [`parse_proc_cpu_ms`] of process `pid` now (`None` when it cannot be read).
#[must_use]
pub fn proc_cpu_ms(pid: u32) -> Option<u64> {
    // SAFETY: sysconf only reads a configuration value.
    let hz = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).ok()?;
    parse_proc_cpu_ms(
        &std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?,
        hz,
    )
}

/// Host CPU time per PUT of the first and of the last PUTs, from busy-time readings
/// ([`cpu_busy_ms`]) taken around each group of `n` PUTs: a view of the per-VM cost that a
/// slower hypervisor (steal) does not inflate, unlike latency. It counts whatever else ran on
/// the host meanwhile too.
#[must_use]
pub fn cpu_line(
    first: (Option<u64>, Option<u64>),
    last: (Option<u64>, Option<u64>),
    n: u32,
) -> Option<String> {
    let per = |(a, b): (Option<u64>, Option<u64>)| Some(b?.checked_sub(a?)? as f64 / f64::from(n));
    let (f, l) = (per(first)?, per(last)?);
    Some(format!(
        "host CPU per PUT (user+system+irq, steal excluded): first {n} {f:.2} ms, last {n} {l:.2} ms = {:.2}x",
        l / f.max(1e-9)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_process_cpu_time() {
        let stat =
            "4242 (tokio (rt) x) S 1 4242 4242 0 -1 4194560 500 0 0 0 150 70 0 0 20 0 9 0 100 0 0";
        assert_eq!(parse_proc_cpu_ms(stat, 100), Some(2200));
        assert_eq!(parse_proc_cpu_ms("4242 (x) S 1", 100), None);
        assert_eq!(parse_proc_cpu_ms("garbage", 100), None);
    }

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
    fn cpu_busy_counts_user_nice_system_irq_softirq_not_idle_iowait_steal() {
        // user nice system idle iowait irq softirq steal guest guest_nice
        let text = "cpu  100 10 50 9000 70 5 15 400 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n";
        assert_eq!(parse_cpu_busy_ms(text, 100), Some(1800));
        assert_eq!(parse_cpu_busy_ms("cpu0 1 2 3\n", 100), None);
        assert_eq!(parse_cpu_busy_ms("cpu  1 x 3 4 5 6 7\n", 100), None);
    }

    #[test]
    fn cpu_line_divides_by_the_puts_and_compares() {
        let line = cpu_line((Some(1000), Some(1300)), (Some(5000), Some(5330)), 100);
        assert_eq!(
            line.as_deref(),
            Some(
                "host CPU per PUT (user+system+irq, steal excluded): first 100 3.00 ms, last 100 3.30 ms = 1.10x"
            )
        );
        assert_eq!(cpu_line((None, Some(1)), (Some(1), Some(2)), 100), None);
    }
}
