//! The state of a sandbox made by `vmnet-lab up --sandbox`: its directory, the recorded background
//! processes, and starting and stopping those processes by pid.
//!
//! Layout of `<root>/<name>/` (default root `/run/vmnet-sandbox`):
//!
//! | file | what |
//! |---|---|
//! | `sandbox.json` | [`SandboxState`]: prefix, namespaces, pids of the agents (with their logs and command lines), echo service, relays and uplink keepers; for a fleet also its hosts and PostgreSQL server ([`FleetState`]) |
//! | `vmnet.sock` | the sandbox agent's API socket |
//! | `state/` | the agent's state directory (its SQLite store) |
//! | `<host name>/vmnet.sock`, `<host name>/state/` | a fleet host's agent socket and state (its store is a database in the fleet's PostgreSQL cluster, `<temp dir>/vmnet-sandbox-<name>-pg`) |
//! | `agent.log`, `agent-<host name>.log`, `echo.log`, `relay-<vm>.log` | the background processes' output |
//! | `*.ready` | readiness markers written by the helpers |
//!
//! # Design
//! Background processes run in their own process group, so they outlive `vmnet-lab up` and
//! ignore the terminal's Ctrl-C: the helpers are `vmnet-lab sandbox-helper …`, the agent is the
//! product's `vmnet serve` ([`crate::exe`]). The agent gets `serve --netns`
//! and enters the sandbox host namespace itself, so it stays in the host's mount namespace —
//! unlike `ip netns exec`, whose private mount namespace would hide the VM namespaces the agent
//! creates. A pid is only signalled when
//! `/proc/<pid>/cmdline` still names this sandbox's directory (no recycled-pid accidents).

use std::fs::OpenOptions;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use vmnet_model::Error;

/// One background process of the sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Proc {
    /// What it is: `agent`, `agent-<host>`, `echo`, `relay-<vm>`, `uplink-<namespace>`.
    pub role: String,
    /// Its pid.
    pub pid: u32,
    /// Its log file (recorded for agents and the helpers `up` and `guest attach` start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log: Option<PathBuf>,
    /// Its whole command line (recorded for agents).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub command: Vec<String>,
}

/// What `vmnet-lab down --sandbox` needs to remove a sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SandboxState {
    /// The sandbox name (also the name prefix of everything in it).
    pub name: String,
    /// The sandbox host namespace.
    pub host_ns: String,
    /// The fake internet namespace.
    pub inet_ns: String,
    /// The background processes, in start order.
    pub procs: Vec<Proc>,
    /// The simulated guests' namespaces.
    pub guest_ns: Vec<String>,
    /// A fleet sandbox's hosts and shared PostgreSQL cluster (`None` for one host; a fleet
    /// leaves `host_ns` empty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fleet: Option<FleetState>,
}

/// What `down` needs beyond [`SandboxState`] to remove a fleet sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct FleetState {
    /// The hosts' agent prefixes.
    pub hosts: Vec<String>,
    /// The shared PostgreSQL cluster's directory, once made.
    pub postgres_dir: Option<PathBuf>,
    /// Its server's pid, once started (stopped by pid, its command line naming the directory).
    pub postgres_pid: Option<u32>,
}

/// The paths of one sandbox.
#[derive(Debug, Clone)]
pub struct Paths {
    /// `<root>/<name>`.
    pub dir: PathBuf,
}

impl Paths {
    /// The paths of sandbox `name` under `root`.
    #[must_use]
    pub fn new(root: &Path, name: &str) -> Self {
        Self {
            dir: root.join(name),
        }
    }

    /// The bpffs directory the agent pins its packet-activity maps under.
    #[must_use]
    pub fn activity_root(&self) -> PathBuf {
        self.dir.join("bpf")
    }

    /// `sandbox.json`.
    #[must_use]
    pub fn state_file(&self) -> PathBuf {
        self.dir.join("sandbox.json")
    }

    /// The agent's socket.
    #[must_use]
    pub fn socket(&self) -> PathBuf {
        self.dir.join("vmnet.sock")
    }

    /// The agent's state directory.
    #[must_use]
    pub fn agent_state(&self) -> PathBuf {
        self.dir.join("state")
    }

    /// A log file.
    #[must_use]
    pub fn log(&self, what: &str) -> PathBuf {
        self.dir.join(format!("{what}.log"))
    }

    /// A readiness marker.
    #[must_use]
    pub fn ready(&self, what: &str) -> PathBuf {
        self.dir.join(format!("{what}.ready"))
    }

    /// Reads `sandbox.json`; `None` when it does not exist.
    ///
    /// # Errors
    /// `INTERNAL` when it exists but cannot be read or parsed.
    pub fn load(&self) -> Result<Option<SandboxState>, Error> {
        let file = self.state_file();
        match std::fs::read(&file) {
            Ok(b) => serde_json::from_slice(&b)
                .map(Some)
                .map_err(|e| Error::internal(format!("sandbox state {}: {e}", file.display()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::internal(format!(
                "sandbox state {}: {e}",
                file.display()
            ))),
        }
    }

    /// Writes `sandbox.json` (atomically, through a temporary file).
    ///
    /// # Errors
    /// `INTERNAL` when it cannot be written.
    pub fn save(&self, state: &SandboxState) -> Result<(), Error> {
        let file = self.state_file();
        let tmp = self.dir.join("sandbox.json.tmp");
        let text = serde_json::to_vec_pretty(state)
            .map_err(|e| Error::internal(format!("sandbox state: {e}")))?;
        std::fs::write(&tmp, text)
            .and_then(|()| std::fs::rename(&tmp, &file))
            .map_err(|e| Error::internal(format!("sandbox state {}: {e}", file.display())))
    }
}

/// Refuses a new sandbox `name` under `root` with `CONFLICT` when it exists already (its state
/// directory or any of its namespaces), or when an existing sandbox's name is a prefix of `name`
/// or starts with it: names of namespaces and links are matched by prefix, so the names of live
/// sandboxes must stay prefix-free.
///
/// # Errors
/// `CONFLICT` naming what is in the way and how to remove it.
pub fn check_free(root: &Path, name: &str) -> Result<(), Error> {
    let dir = root.join(name);
    if let Some(pid) = builder(&dir) {
        return Err(Error::conflict(format!(
            "sandbox {name} is being made by `vmnet-lab up` (pid {pid}); wait for it, or interrupt that run (Ctrl-C) to remove it"
        )));
    }
    let own = crate::sandbox::owned(name);
    if dir.exists() || !own.is_empty() {
        return Err(Error::conflict(format!(
            "sandbox {name} exists already (state {}, {} namespaces): run `vmnet-lab down --sandbox --name {name}` first",
            dir.display(),
            own.len()
        )));
    }
    let mut others: Vec<String> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|o| o != name && (o.starts_with(name) || name.starts_with(o.as_str())))
        .map(|o| format!("sandbox {o} (state {})", root.join(&o).display()))
        .collect();
    others.extend(
        crate::sandbox::prefix_conflicts(name)
            .into_iter()
            .map(|ns| format!("netns {ns}")),
    );
    if others.is_empty() {
        return Ok(());
    }
    Err(Error::conflict(format!(
        "sandbox {name}: the name and an existing sandbox's name are prefixes of one another ({}): choose another --name, or remove that sandbox first with `vmnet-lab down --sandbox --name <its name>`",
        others.join(", ")
    )))
}

/// Claims sandbox `name` under `root`: [`check_free`], then creates `<root>/<name>` with one
/// `mkdir`, so of two `up` runs racing for one name exactly one gets it.
///
/// # Errors
/// `CONFLICT` as [`check_free`], or when the directory appeared in the meantime; `INTERNAL`
/// when it cannot be created.
pub fn claim(root: &Path, name: &str) -> Result<Paths, Error> {
    check_free(root, name)?;
    std::fs::create_dir_all(root)
        .map_err(|e| Error::internal(format!("sandbox root {}: {e}", root.display())))?;
    let paths = Paths::new(root, name);
    match std::fs::create_dir(&paths.dir) {
        Ok(()) => {
            mark_building(&paths)?;
            Ok(paths)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Err(Error::conflict(format!(
            "sandbox {name} is being made by another `vmnet-lab up` (state {}): run `vmnet-lab down --sandbox --name {name}` once it is done",
            paths.dir.display()
        ))),
        Err(e) => Err(Error::internal(format!(
            "sandbox dir {}: {e}",
            paths.dir.display()
        ))),
    }
}

/// 0 until SIGINT (1) or SIGTERM (2) arrived after [`Interrupts::install`]: blocking steps of
/// `up` (readiness waits, the checks) look at it and stop early.
static STOPPING: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Whether `up` was interrupted (see [`Interrupts`]).
#[must_use]
pub fn stopping() -> bool {
    STOPPING.load(std::sync::atomic::Ordering::Relaxed) != 0
}

/// SIGINT and SIGTERM caught for `up`, so it removes what it built instead of dying half-way.
/// Install it before anything is built: the handlers are in place from the call on.
pub struct Interrupts(());

impl Interrupts {
    /// Installs the handlers and a task that records the first signal ([`stopping`]).
    ///
    /// # Errors
    /// `INTERNAL` when the handlers cannot be installed.
    pub fn install() -> Result<Self, Error> {
        use tokio::signal::unix::{SignalKind, signal};
        let handler = |e: std::io::Error| Error::internal(format!("signal handler: {e}"));
        let mut int = signal(SignalKind::interrupt()).map_err(handler)?;
        let mut term = signal(SignalKind::terminate()).map_err(handler)?;
        tokio::spawn(async move {
            let why = tokio::select! {
                _ = int.recv() => 1,
                _ = term.recv() => 2,
            };
            STOPPING.store(why, std::sync::atomic::Ordering::Relaxed);
        });
        Ok(Self(()))
    }

    /// `"interrupted"` or `"terminated"` once a signal arrived, else `None`.
    #[must_use]
    pub fn reason() -> Option<&'static str> {
        match STOPPING.load(std::sync::atomic::Ordering::Relaxed) {
            0 => None,
            2 => Some("terminated"),
            _ => Some("interrupted"),
        }
    }

    /// Resolves once a signal arrived: `"interrupted"` or `"terminated"`. It looks at the flag
    /// every 50 ms (a timer, so it is polled again even while the other `select!` branch spends
    /// its time in blocking steps that end early on the same flag).
    pub async fn wait(&mut self) -> &'static str {
        loop {
            match STOPPING.load(std::sync::atomic::Ordering::Relaxed) {
                0 => tokio::time::sleep(Duration::from_millis(50)).await,
                2 => return "terminated",
                _ => return "interrupted",
            }
        }
    }
}

/// The error of an interrupted `up` (`UNAVAILABLE`, as `bench` stopped by a signal).
#[must_use]
pub fn interrupted_error(why: &str, name: &str) -> Error {
    Error::unavailable(format!("{why}; sandbox {name} removed"))
}

/// Records this process as the `up` building `paths` (`up.pid`), so another `up` or a `down`
/// can tell a sandbox still being built from a finished one.
///
/// # Errors
/// `INTERNAL` when the file cannot be written.
pub fn mark_building(paths: &Paths) -> Result<(), Error> {
    let file = paths.dir.join("up.pid");
    std::fs::write(&file, std::process::id().to_string())
        .map_err(|e| Error::internal(format!("{}: {e}", file.display())))
}

/// Removes the `up.pid` mark (the sandbox is built, or gone).
pub fn done_building(paths: &Paths) {
    let _ = std::fs::remove_file(paths.dir.join("up.pid"));
}

/// The pid of the `vmnet-lab up` still building the sandbox in `dir`, if one is running.
#[must_use]
pub fn builder(dir: &Path) -> Option<u32> {
    let pid: u32 = std::fs::read_to_string(dir.join("up.pid"))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    if pid == std::process::id() {
        return None;
    }
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    cmdline
        .split(|b| *b == 0)
        .any(|a| a == b"up")
        .then_some(pid)
}

/// Marks every descriptor above stderr close-on-exec in `cmd`'s child. A process the lab leaves
/// running (an agent, a helper, qemu, PostgreSQL) must not keep a descriptor it inherited by
/// accident — the lock file of `flock LOCK vmnet-lab up …`, say, which it would hold for as long
/// as the sandbox lives. `CLOSE_RANGE_CLOEXEC` (Linux 5.11) closes them at exec, so the standard
/// library's exec-error pipe works until then; an older kernel leaves them as they are.
pub fn inherit_no_descriptors(cmd: &mut Command) -> &mut Command {
    let flags = libc::c_int::try_from(libc::CLOSE_RANGE_CLOEXEC).unwrap_or(0);
    // SAFETY: between fork and exec the closure only calls close_range(2), which is
    // async-signal-safe and touches no memory of the process.
    unsafe {
        cmd.pre_exec(move || {
            let _ = libc::close_range(3, libc::c_uint::MAX, flags);
            Ok(())
        })
    }
}

/// Starts `<this executable> ARGS…` (`vmnet-lab sandbox-helper …`) in the background (own
/// process group, stdin closed, output appended to `log`).
///
/// # Errors
/// `INTERNAL` when the binary or the log cannot be opened or the process not started.
pub fn spawn_background(args: &[String], log: &Path) -> Result<Child, Error> {
    let exe = crate::exe::this()?;
    let out = OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| Error::internal(format!("log {}: {e}", log.display())))?;
    let err = out
        .try_clone()
        .map_err(|e| Error::internal(format!("log {}: {e}", log.display())))?;
    inherit_no_descriptors(&mut Command::new(&exe))
        .args(args)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .process_group(0)
        .spawn()
        .map_err(|e| {
            Error::internal(format!(
                "cannot start {} {}: {e}",
                exe.display(),
                args.join(" ")
            ))
        })
}

/// Waits until `ready` exists (the helper wrote it) or the child exits or `timeout` passes.
///
/// # Errors
/// `INTERNAL` naming `what` and the tail of its log when it exited or timed out.
pub fn wait_ready(
    child: &mut Child,
    ready: &Path,
    log: &Path,
    what: &str,
    timeout: Duration,
) -> Result<(), Error> {
    let start = Instant::now();
    loop {
        if ready.exists() {
            return Ok(());
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(Error::internal(format!(
                "{what} exited ({status}): {}",
                log_tail(log)
            )));
        }
        if start.elapsed() > timeout {
            return Err(Error::internal(format!(
                "{what} not ready after {timeout:?}: {}",
                log_tail(log)
            )));
        }
        if stopping() {
            return Err(Error::unavailable(format!(
                "interrupted while waiting for {what}"
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The last lines of a log file, for error messages.
#[must_use]
pub fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let tail = lines[lines.len().saturating_sub(5)..].join(" | ");
    if tail.is_empty() {
        format!("(no output in {})", log.display())
    } else {
        tail
    }
}

/// Whether `pid` is a live process whose command line mentions `marker` (the sandbox dir).
#[must_use]
pub fn is_ours(pid: u32, marker: &str) -> bool {
    // A process that is still inside execve(2) (just spawned) shows an empty cmdline for a
    // moment: wait for it (up to 1 s) rather than take it for someone else's.
    let start = Instant::now();
    loop {
        match std::fs::read(format!("/proc/{pid}/cmdline")) {
            Ok(b)
                if b.is_empty() && !is_zombie(pid) && start.elapsed() < Duration::from_secs(1) =>
            {
                std::thread::sleep(Duration::from_millis(5));
            }
            Ok(b) => {
                return String::from_utf8_lossy(&b)
                    .replace('\0', " ")
                    .contains(marker);
            }
            Err(_) => return false,
        }
    }
}

/// Stops `pid` if it is still ours: SIGTERM, then SIGKILL after 3 s. Returns whether it was
/// running.
#[must_use]
pub fn stop(pid: u32, marker: &str) -> bool {
    stop_with(
        pid,
        marker,
        nix::sys::signal::Signal::SIGTERM,
        Duration::from_secs(3),
    )
}

/// Stops `pid` if it is still ours: `signal`, then SIGKILL after `grace`. Returns whether it
/// was running.
#[must_use]
pub fn stop_with(
    pid: u32,
    marker: &str,
    signal: nix::sys::signal::Signal,
    grace: Duration,
) -> bool {
    if !is_ours(pid, marker) {
        return false;
    }
    let Ok(raw) = i32::try_from(pid) else {
        return false;
    };
    let p = nix::unistd::Pid::from_raw(raw);
    let _ = nix::sys::signal::kill(p, signal);
    let start = Instant::now();
    while is_ours(pid, marker) && !is_zombie(pid) {
        if start.elapsed() > grace {
            let _ = nix::sys::signal::kill(p, nix::sys::signal::Signal::SIGKILL);
            // Gone (or a zombie) within moments of SIGKILL; wait for that, briefly.
            let killed = Instant::now();
            while is_ours(pid, marker)
                && !is_zombie(pid)
                && killed.elapsed() < Duration::from_secs(2)
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit_once(") ")
                .is_some_and(|(_, rest)| rest.starts_with('Z'))
        })
        .unwrap_or(true)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_sandbox_name_is_claimed_once() {
        let root = tempfile::tempdir().unwrap();
        let name = format!("vc{:06x}", std::process::id() & 0xff_ffff);
        let first = crate::state::claim(root.path(), &name).unwrap();
        assert!(first.dir.is_dir());
        let again = crate::state::claim(root.path(), &name).unwrap_err();
        assert_eq!(again.code, vmnet_model::ErrorCode::Conflict);
    }
}
