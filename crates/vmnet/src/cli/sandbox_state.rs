//! The state of a sandbox made by `vmnet up --sandbox`: its directory, the recorded background
//! processes, and starting and stopping those processes by pid.
//!
//! Layout of `<root>/<name>/` (default root `/run/vmnet-sandbox`):
//!
//! | file | what |
//! |---|---|
//! | `sandbox.json` | [`SandboxState`]: prefix, namespaces, pids of the agent, echo service and relays |
//! | `vmnet.sock` | the sandbox agent's API socket |
//! | `state/` | the agent's state directory (its SQLite store) |
//! | `agent.log`, `echo.log`, `relay-<vm>.log` | the background processes' output |
//! | `*.ready` | readiness markers written by the helpers |
//!
//! # Design
//! Background processes are started from the `vmnet` binary itself in their own process group,
//! so they outlive `vmnet up` and ignore the terminal's Ctrl-C. The agent gets `serve --netns`
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
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Proc {
    /// What it is: `agent`, `echo` or `relay <vm>`.
    pub role: String,
    /// Its pid.
    pub pid: u32,
}

/// What `vmnet down --sandbox` needs to remove a sandbox.
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
    let own = vmnet_testkit::sandbox::owned(name);
    if dir.exists() || !own.is_empty() {
        return Err(Error::conflict(format!(
            "sandbox {name} exists already (state {}, {} namespaces): run `vmnet down --sandbox --name {name}` first",
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
        vmnet_testkit::sandbox::prefix_conflicts(name)
            .into_iter()
            .map(|ns| format!("netns {ns}")),
    );
    if others.is_empty() {
        return Ok(());
    }
    Err(Error::conflict(format!(
        "sandbox {name}: the name and an existing sandbox's name are prefixes of one another ({}): choose another --name, or remove that sandbox first with `vmnet down --sandbox --name <its name>`",
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
        Ok(()) => Ok(paths),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Err(Error::conflict(format!(
            "sandbox {name} is being made by another `vmnet up` (state {}): run `vmnet down --sandbox --name {name}` once it is done",
            paths.dir.display()
        ))),
        Err(e) => Err(Error::internal(format!(
            "sandbox dir {}: {e}",
            paths.dir.display()
        ))),
    }
}

/// Waits for SIGINT or SIGTERM (for `up` to remove what it built instead of dying half-way).
///
/// # Errors
/// `INTERNAL` when the handlers cannot be installed.
pub async fn interrupted() -> Result<&'static str, Error> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut int = signal(SignalKind::interrupt())
        .map_err(|e| Error::internal(format!("signal handler: {e}")))?;
    let mut term = signal(SignalKind::terminate())
        .map_err(|e| Error::internal(format!("signal handler: {e}")))?;
    Ok(tokio::select! {
        _ = int.recv() => "interrupted",
        _ = term.recv() => "terminated",
    })
}

/// Starts `vmnet ARGS…` in the background (own process group, stdin closed, output appended to
/// `log`).
///
/// # Errors
/// `INTERNAL` when the binary or the log cannot be opened or the process not started.
pub fn spawn_background(args: &[String], log: &Path) -> Result<Child, Error> {
    let exe = std::env::current_exe()
        .map_err(|e| Error::internal(format!("cannot find the vmnet binary: {e}")))?;
    let out = OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| Error::internal(format!("log {}: {e}", log.display())))?;
    let err = out
        .try_clone()
        .map_err(|e| Error::internal(format!("log {}: {e}", log.display())))?;
    Command::new(exe)
        .args(args)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .process_group(0)
        .spawn()
        .map_err(|e| Error::internal(format!("cannot start vmnet {}: {e}", args.join(" "))))
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
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            String::from_utf8_lossy(&b)
                .replace('\0', " ")
                .contains(marker)
        })
        .unwrap_or(false)
}

/// Stops `pid` if it is still ours: SIGTERM, then SIGKILL after 3 s. Returns whether it was
/// running.
#[must_use]
pub fn stop(pid: u32, marker: &str) -> bool {
    if !is_ours(pid, marker) {
        return false;
    }
    let Ok(raw) = i32::try_from(pid) else {
        return false;
    };
    let p = nix::unistd::Pid::from_raw(raw);
    let _ = nix::sys::signal::kill(p, nix::sys::signal::Signal::SIGTERM);
    let start = Instant::now();
    while is_ours(pid, marker) && !is_zombie(pid) {
        if start.elapsed() > Duration::from_secs(3) {
            let _ = nix::sys::signal::kill(p, nix::sys::signal::Signal::SIGKILL);
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
