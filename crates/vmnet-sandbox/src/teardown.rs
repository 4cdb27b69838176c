//! Removing a sandbox: its processes by pid, a fleet's PostgreSQL cluster, its namespaces by
//! exact prefix, and its state directory.

use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;
use vmnet_model::Error;
use vmnet_model::error::chain;

use crate::sandbox;
use crate::state::{self, FleetState, Paths};

/// What `down` removed.
#[derive(Debug, Default, Serialize)]
pub(crate) struct DownReport {
    /// The processes stopped, `role (pid N)`.
    pub stopped: Vec<String>,
    /// The recorded processes that were no longer running (killed, or crashed), `role (pid N)`.
    pub already_gone: Vec<String>,
    /// The namespaces deleted.
    pub namespaces: Vec<String>,
    /// Processes that were still inside those namespaces and that `up` did not start (an agent
    /// restarted by hand, a shell): `pid N (command line)`. Left running: `down` stops only the
    /// processes it recorded.
    pub left_running: Vec<String>,
}

/// Stops the recorded processes (relays, agents, echo: newest first), a fleet's PostgreSQL
/// cluster, deletes the sandbox's namespaces ([`sandbox::owned`], for a fleet
/// [`crate::fleet::owned`]: exact prefixes and a documented suffix, never a sandbox whose name
/// merely starts with this one) and removes the state directory.
pub(crate) fn teardown(paths: &Paths, name: &str) -> Result<DownReport, Error> {
    let mut report = DownReport::default();
    // With the trailing slash, so a sandbox whose name starts with this one's never matches.
    let marker = format!("{}/", paths.dir.display());
    let st = paths.load()?;
    for p in st.iter().flat_map(|st| st.procs.iter().rev()) {
        let who = format!("{} (pid {})", p.role, p.pid);
        if state::stop(p.pid, &marker) {
            report.stopped.push(who);
        } else {
            report.already_gone.push(who);
        }
    }
    let fleet_state = st.and_then(|st| st.fleet);
    // The hosts' wireguard-go outlive their agents by design: stop them by their sockets' pid.
    if let Some(f) = &fleet_state {
        report
            .stopped
            .extend(crate::fleet_job::mesh::stop_devices(&f.hosts));
    }
    let is_fleet = fleet_state.is_some() || crate::fleet::exists(name);
    let pg = remove_postgres(name, fleet_state.as_ref())?;
    report.stopped.extend(pg);
    let sb_err = |e: crate::SandboxError| Error::internal(format!("sandbox {name}: {}", chain(&e)));
    if is_fleet {
        report.namespaces = crate::fleet::owned(name);
        report.left_running = still_inside(&report.namespaces);
        crate::fleet::cleanup(name).map_err(sb_err)?;
    } else {
        report.namespaces = sandbox::owned(name);
        report.left_running = still_inside(&report.namespaces);
        sandbox::cleanup(name).map_err(sb_err)?;
    }
    // A fleet's agents pinned their mesh maps on a bpffs in each host's state dir.
    if is_fleet {
        let _ = crate::fleet_job::mesh::unmount_bpf(&paths.dir);
    }
    // The agent (stopped above) pinned its activity maps on a bpffs inside the state dir.
    if let Err(e) = vmnet_kernel::activity::remove_root(&paths.activity_root()) {
        return Err(Error::internal(format!("sandbox {name}: {e}")));
    }
    match std::fs::remove_dir_all(&paths.dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(Error::internal(format!(
                "remove {}: {e}",
                paths.dir.display()
            )));
        }
    }
    Ok(report)
}

/// The processes whose network namespace is one of `names` (compared by the namespace's device
/// and inode), `pid N (command line)`.
fn still_inside(names: &[String]) -> Vec<String> {
    use std::os::unix::fs::MetadataExt;
    let ids: std::collections::HashSet<(u64, u64)> = names
        .iter()
        .filter_map(|n| std::fs::metadata(crate::netns::path(n)).ok())
        .map(|m| (m.dev(), m.ino()))
        .collect();
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(m) = std::fs::metadata(e.path().join("ns/net")) else {
            continue; // gone, or a zombie
        };
        if ids.contains(&(m.dev(), m.ino())) {
            let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            out.push(format!("pid {pid} ({})", cmd.trim()));
        }
    }
    out
}

/// The shared PostgreSQL cluster's directory of the fleet `name`.
#[must_use]
pub fn pg_dir(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("vmnet-sandbox-{name}-pg"))
}

/// Stops the fleet's PostgreSQL server by pid (`SIGINT`, fast shutdown; `SIGKILL` after 10 s)
/// when its command line still names the cluster directory, and removes the directory. The
/// directory is the recorded one, else [`pg_dir`]; the pid the recorded one, else the one in
/// `data/postmaster.pid`. Returns what was stopped.
///
/// # Errors
/// `INTERNAL` when the directory cannot be removed.
pub(crate) fn remove_postgres(
    name: &str,
    recorded: Option<&FleetState>,
) -> Result<Vec<String>, Error> {
    let dir = recorded
        .and_then(|f| f.postgres_dir.clone())
        .unwrap_or_else(|| pg_dir(name));
    if !dir.exists() {
        return Ok(Vec::new());
    }
    let pid = recorded.and_then(|f| f.postgres_pid).or_else(|| {
        std::fs::read_to_string(dir.join("data/postmaster.pid"))
            .ok()
            .and_then(|t| t.lines().next().and_then(|l| l.trim().parse().ok()))
    });
    let mut stopped = Vec::new();
    let marker = format!("{}/", dir.display());
    let sigint = nix::sys::signal::Signal::SIGINT;
    if let Some(pid) = pid
        && state::stop_with(pid, &marker, sigint, Duration::from_secs(10))
    {
        stopped.push(format!("postgres (pid {pid})"));
    }
    std::fs::remove_dir_all(&dir)
        .map_err(|e| Error::internal(format!("remove {}: {e}", dir.display())))?;
    Ok(stopped)
}
