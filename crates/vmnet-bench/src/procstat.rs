//! What `/proc` says about a process: resident memory, threads and open descriptors, for the
//! agent bench's report.

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
