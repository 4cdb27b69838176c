//! Named network namespaces for tests: create, delete, list, run code inside, run `ip` and
//! other commands inside, each with a timeout.
//!
//! # Design
//! Namespaces are made, listed and deleted by [`vmnet_kernel::netns`] (the one implementation;
//! iproute2's layout under `/run/netns`), so `ip -n` and `ip netns exec` work on them. Code runs inside a namespace on a dedicated thread that
//! called `setns(2)`; the caller's thread never changes namespace. Threads spawned from such a
//! thread inherit its namespace.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::SandboxError;

/// The mount path of the namespace `name` (`/run/netns/<name>`, iproute2's layout).
#[must_use]
pub fn path(name: &str) -> PathBuf {
    vmnet_kernel::netns::path(name)
}

/// Whether the named namespace exists.
#[must_use]
pub fn exists(name: &str) -> bool {
    vmnet_kernel::netns::exists(name)
}

fn kernel(what: String) -> impl FnOnce(vmnet_kernel::netns::NetnsError) -> SandboxError {
    move |e| SandboxError::io(what, std::io::Error::other(e))
}

/// Creates the named namespace (through [`vmnet_kernel::netns`], no process started), brings
/// its loopback up and turns IPv6 duplicate address detection off for links made in it later.
///
/// # Errors
/// When the name exists or the namespace cannot be made.
pub fn create(name: &str) -> Result<(), SandboxError> {
    vmnet_kernel::netns::create(name).map_err(kernel(format!("netns {name}: create")))?;
    ip(name, &["link", "set", "lo", "up"])?;
    // No duplicate address detection on the links made here later: on a machine busy with
    // other namespaces the kernel's address work queue can leave a new link's addresses
    // tentative for seconds, and no address here can be a duplicate.
    for key in ["all", "default"] {
        sysctl(name, &format!("net/ipv6/conf/{key}/accept_dad"), "0")?;
    }
    Ok(())
}

/// Deletes the named namespace; a missing one is not an error.
///
/// # Errors
/// When an existing namespace cannot be unmounted or removed.
pub fn delete(name: &str) -> Result<(), SandboxError> {
    vmnet_kernel::netns::delete(name).map_err(kernel(format!("netns {name}: delete")))
}

/// The named namespaces whose names start with `prefix`, sorted (empty when `/run/netns`
/// cannot be read).
#[must_use]
pub fn list(prefix: &str) -> Vec<String> {
    vmnet_kernel::netns::list(prefix).unwrap_or_default()
}

/// Moves the calling thread into the named namespace. Use only on a thread made for that
/// purpose (see [`run_in`], [`spawn_in`]).
///
/// # Errors
/// When the namespace does not exist or `setns` fails.
pub fn enter(name: &str) -> Result<(), SandboxError> {
    vmnet_kernel::netns::enter_current_thread(name).map_err(kernel(format!("netns {name}: setns")))
}

/// Runs `f` on a fresh thread inside the named namespace and returns its result.
///
/// # Errors
/// When the namespace cannot be entered or `f` panics.
pub fn run_in<T, F>(name: &str, f: F) -> Result<T, SandboxError>
where
    T: Send,
    F: FnOnce() -> T + Send,
{
    std::thread::scope(|s| {
        s.spawn(|| {
            enter(name)?;
            Ok(f())
        })
        .join()
        .unwrap_or_else(|_| Err(SandboxError::Panicked(format!("netns {name}"))))
    })
}

/// Runs `f` on a fresh thread inside the named namespace and waits at most `timeout` for it.
/// On a timeout the thread is left to finish on its own (threads cannot be killed), so `f`
/// should bound its own blocking calls too.
///
/// # Errors
/// [`SandboxError::Timeout`], or when the namespace cannot be entered or `f` panics.
pub fn run_in_timeout<T, F>(name: &str, timeout: Duration, f: F) -> Result<T, SandboxError>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let (tx, rx) = std::sync::mpsc::channel();
    let handle = spawn_in(name, &format!("run-in-{name}"), move || {
        let _ = tx.send(f());
    })?;
    match rx.recv_timeout(timeout) {
        Ok(v) => Ok(v),
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(SandboxError::Timeout {
            what: format!("netns {name}: closure"),
            timeout,
        }),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => match handle.join() {
            Ok(Err(e)) => Err(e),
            _ => Err(SandboxError::Panicked(format!("netns {name}"))),
        },
    }
}

/// Spawns a long-lived thread inside the named namespace running `f`. The thread enters the
/// namespace before `f` runs; if it cannot, `f` is not run and the error is the thread's result.
///
/// # Errors
/// When the thread cannot be spawned.
pub fn spawn_in<T, F>(
    name: &str,
    thread_name: &str,
    f: F,
) -> Result<std::thread::JoinHandle<Result<T, SandboxError>>, SandboxError>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let ns = name.to_owned();
    std::thread::Builder::new()
        .name(thread_name.to_owned())
        .spawn(move || {
            enter(&ns)?;
            Ok(f())
        })
        .map_err(|e| SandboxError::io(format!("spawn thread {thread_name}"), e))
}

/// Runs `ip -n NS ARGS…` and returns its stdout.
///
/// # Errors
/// When `ip` exits unsuccessfully; the error carries its stderr.
pub fn ip(ns: &str, args: &[&str]) -> Result<String, SandboxError> {
    let out = run_checked(Command::new("ip").arg("-n").arg(ns).args(args))?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Writes a sysctl inside the named namespace, e.g. `("net/ipv4/ip_forward", "1")`.
///
/// # Errors
/// When the namespace cannot be entered or the file cannot be written.
pub fn sysctl(ns: &str, key: &str, value: &str) -> Result<(), SandboxError> {
    let file = Path::new("/proc/sys").join(key);
    run_in(ns, || std::fs::write(&file, value))?
        .map_err(|e| SandboxError::io(format!("netns {ns}: sysctl {key}={value}"), e))
}

/// Reads a sysctl inside the named namespace (trimmed).
///
/// # Errors
/// When the namespace cannot be entered or the file cannot be read.
pub fn sysctl_get(ns: &str, key: &str) -> Result<String, SandboxError> {
    let file = Path::new("/proc/sys").join(key);
    let v = run_in(ns, || std::fs::read_to_string(&file))?
        .map_err(|e| SandboxError::io(format!("netns {ns}: read sysctl {key}"), e))?;
    Ok(v.trim().to_owned())
}

/// Runs `ip netns exec NS PROGRAM ARGS…` under a time limit and returns its output, whatever
/// its exit status. The child is killed when the limit passes.
///
/// # Errors
/// When it cannot be started, or [`SandboxError::Timeout`] when it had to be killed.
pub fn exec(
    ns: &str,
    program: &str,
    args: &[&str],
    timeout: Duration,
) -> Result<Output, SandboxError> {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns, program]).args(args);
    run_with_timeout(&mut cmd, timeout)
}

/// Runs `cmd` (stdin closed, output captured) and kills it when `timeout` passes.
///
/// # Errors
/// When it cannot be started, or [`SandboxError::Timeout`] when it had to be killed.
pub fn run_with_timeout(cmd: &mut Command, timeout: Duration) -> Result<Output, SandboxError> {
    let line = describe(cmd);
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| SandboxError::io(format!("start `{line}`"), e))?;
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if start.elapsed() >= timeout => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(SandboxError::Timeout {
                    what: line,
                    timeout,
                });
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => return Err(SandboxError::io(format!("wait for `{line}`"), e)),
        }
    }
    child
        .wait_with_output()
        .map_err(|e| SandboxError::io(format!("collect `{line}`"), e))
}

/// Runs `cmd` with a 30 s limit and fails unless it exits successfully.
///
/// # Errors
/// [`SandboxError::Command`] with its stderr, or a start/timeout error.
pub fn run_checked(cmd: &mut Command) -> Result<Output, SandboxError> {
    let out = run_with_timeout(cmd, Duration::from_secs(30))?;
    if out.status.success() {
        Ok(out)
    } else {
        Err(SandboxError::Command {
            command: describe(cmd),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}
