//! How the agent starts a worker process: the `vmnet` binary's hidden `serve --worker-serve
//! UID:GID`, with one end of a socketpair as descriptor [`WORKER_FD`].

use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;

use super::child::WORKER_FD;
use super::confine::WorkerUser;
use crate::provider::http::HttpSettings;

/// How the agent runs the worker.
pub struct WorkerSettings {
    /// The worker's command without its `UID:GID` argument (`vmnet serve --worker-serve`),
    /// made again for every start.
    pub command: Box<dyn Fn() -> std::process::Command + Send + Sync>,
    /// The user it runs as.
    pub user: WorkerUser,
    /// The provider client's settings.
    pub http: HttpSettings,
}

impl std::fmt::Debug for WorkerSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerSettings")
            .field("user", &self.user)
            .field("http", &self.http)
            .finish_non_exhaustive()
    }
}

/// The binary that runs the worker (`serve --worker-serve`): this executable when it is the
/// agent's own `vmnetd`, else `vmnetd` next to it.
///
/// # Errors
/// When the executable's path is unknown.
pub fn vmnet_exe() -> std::io::Result<std::path::PathBuf> {
    let exe = std::env::current_exe()?;
    if exe.file_name().is_some_and(|n| n == "vmnetd") {
        Ok(exe)
    } else {
        Ok(exe.with_file_name("vmnetd"))
    }
}

/// The worker command of the `vmnetd` binary `exe`: `exe serve --worker-serve`, environment
/// cleared but `RUST_LOG`, stdin closed, stdout and stderr the agent's.
#[must_use]
pub fn command(exe: std::path::PathBuf) -> Box<dyn Fn() -> std::process::Command + Send + Sync> {
    command_with(exe, Vec::new())
}

/// Like [`command`], with `serve_args` (e.g. the agent's `--log-format`) given to `serve`
/// before `--worker-serve`.
#[must_use]
pub fn command_with(
    exe: std::path::PathBuf,
    serve_args: Vec<String>,
) -> Box<dyn Fn() -> std::process::Command + Send + Sync> {
    let log = std::env::var("RUST_LOG").ok();
    Box::new(move || {
        let mut c = std::process::Command::new(&exe);
        c.arg("serve")
            .args(&serve_args)
            .arg("--worker-serve")
            .env_clear()
            .stdin(std::process::Stdio::null());
        if let Some(l) = &log {
            c.env("RUST_LOG", l);
        }
        c
    })
}

/// Starts one worker process as `settings` say, with its socket as descriptor 3.
///
/// # Errors
/// When the socketpair or the process cannot be made.
pub fn spawn(
    settings: &WorkerSettings,
) -> std::io::Result<(tokio::process::Child, tokio::net::UnixStream)> {
    let (ours, theirs) = std::os::unix::net::UnixStream::pair()?;
    ours.set_nonblocking(true)?;
    let fd = theirs.as_raw_fd();
    let mut cmd = (settings.command)();
    cmd.arg(settings.user.ids());
    // SAFETY: the closure runs in the forked child before exec and calls only dup2 and
    // fcntl, which are async-signal-safe; it touches no memory shared with other threads.
    unsafe {
        cmd.pre_exec(move || {
            if fd == WORKER_FD {
                let flags = libc::fcntl(fd, libc::F_GETFD);
                if flags < 0 || libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            } else if libc::dup2(fd, WORKER_FD) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = tokio::process::Command::from(cmd)
        .kill_on_drop(true)
        .spawn()?;
    drop(theirs);
    Ok((child, tokio::net::UnixStream::from_std(ours)?))
}
