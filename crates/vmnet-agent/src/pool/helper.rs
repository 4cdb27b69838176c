//! The root helper for nftables (spec: "privilege separation"): a separate process, started by
//! the agent with `Command` (fork + exec, never a bare fork of the multi-threaded agent), spoken
//! to over a socketpair inherited as file descriptor 3.
//!
//! # Protocol
//! Both directions send frames of a 4-byte big-endian length and that many bytes of JSON.
//! Requests: `{"op":"apply","ruleset":"<nft JSON>"}` or `{"op":"list"}` (bcd's tables:
//! [`vmnet_kernel::pool::firewall::list_owned`]). Replies:
//! `{"ok":true,"output":"…"}` or `{"ok":false,"error":"…"}`. The helper applies a ruleset only
//! after [`vmnet_plan::pool::validate::validate_doc`] accepted it; a refusal carries the reason.
//! It serves one agent, one request at a time, and exits when the socket closes.
//!
//! # Design
//! The helper enters the target namespace on its main thread before doing anything else (it is
//! single-threaded), then opens one libnftables context there and keeps it for its whole life:
//! bcd's three tables are made by that context with the `owner` flag
//! ([`vmnet_kernel::pool::firewall::apply_owned`], from fixed table names, never from text the
//! agent sends), so no other process can flush, edit or delete them, and the kernel deletes
//! them when the helper exits. The agent side ([`HelperClient`]) implements [`NftExec`], so the
//! pool firewall drives the helper exactly as it drives an in-process context, and
//! [`OwnerWatch`]: it notices the helper's exit (a pidfd) and starts it again from the same
//! command, for the agent's watchdog to re-apply the tables
//! ([`super::runtime::PoolRuntime`]).

use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use vmnet_kernel::pool::firewall::{FirewallError, NftExec, OwnerWatch, apply_owned, list_owned};
use vmnet_kernel::pool::libnft::LibNft;

use vmnet_plan::pool::validate::validate_doc;

/// The descriptor number the helper finds its socket on.
pub const HELPER_FD: i32 = 3;

/// Largest frame either side accepts, bytes.
pub const MAX_FRAME: u32 = 64 << 20;

/// A request to the helper.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum Request {
    /// Validate, then apply one nft JSON batch.
    Apply {
        /// The nft JSON text.
        ruleset: String,
    },
    /// List the ruleset (JSON).
    List,
}

/// The helper's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reply {
    /// Whether the request succeeded.
    pub ok: bool,
    /// nft's output (listings).
    #[serde(default)]
    pub output: String,
    /// Why it failed.
    #[serde(default)]
    pub error: String,
}

/// Writes one frame.
///
/// # Errors
/// I/O errors, or a frame over [`MAX_FRAME`].
pub fn write_frame(w: &mut impl Write, body: &[u8]) -> std::io::Result<()> {
    let len = u32::try_from(body.len())
        .ok()
        .filter(|l| *l <= MAX_FRAME)
        .ok_or_else(|| std::io::Error::other("frame too large"))?;
    w.write_all(&len.to_be_bytes())?;
    w.write_all(body)?;
    w.flush()
}

/// Reads one frame; `None` at a clean end of stream.
///
/// # Errors
/// I/O errors, or a length over [`MAX_FRAME`].
pub fn read_frame(r: &mut impl Read) -> std::io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_be_bytes(len);
    if len > MAX_FRAME {
        return Err(std::io::Error::other(format!(
            "frame of {len} bytes is too large"
        )));
    }
    let mut body = vec![0u8; usize::try_from(len).unwrap_or(0)];
    r.read_exact(&mut body)?;
    Ok(Some(body))
}

/// Answers one request with `nft` (validation first for `apply`).
pub fn handle(nft: &LibNft, req: &Request) -> Reply {
    let result = match req {
        Request::Apply { ruleset } => match validate_doc(ruleset) {
            Ok(doc) => apply_owned(nft, &doc, ruleset)
                .map(|()| String::new())
                .map_err(|e| e.to_string()),
            Err(refusal) => Err(refusal.to_string()),
        },
        Request::List => list_owned(nft).map_err(|e| e.to_string()),
    };
    match result {
        Ok(output) => Reply {
            ok: true,
            output,
            error: String::new(),
        },
        Err(error) => Reply {
            ok: false,
            output: String::new(),
            error,
        },
    }
}

/// The helper's main loop: enters `netns` (when given) on this thread, opens libnftables there
/// and serves requests on `sock` until the agent closes it. Call it from a single-threaded
/// process (the helper entry point), never from the agent.
///
/// # Errors
/// A message when the namespace, libnftables or the socket fails.
pub fn serve(sock: &UnixStream, netns: Option<&str>) -> Result<(), String> {
    if let Some(ns) = netns {
        vmnet_kernel::netns::enter_current_thread(ns)
            .map_err(|e| format!("enter netns {ns}: {e}"))?;
    }
    let nft = LibNft::here().map_err(|e| e.to_string())?;
    let mut r = sock;
    let mut w = sock;
    while let Some(body) = read_frame(&mut r).map_err(|e| format!("read: {e}"))? {
        let reply = match serde_json::from_slice::<Request>(&body) {
            Ok(req) => handle(&nft, &req),
            Err(e) => Reply {
                ok: false,
                output: String::new(),
                error: format!("bad request: {e}"),
            },
        };
        let bytes = serde_json::to_vec(&reply).map_err(|e| e.to_string())?;
        write_frame(&mut w, &bytes).map_err(|e| format!("write: {e}"))?;
    }
    Ok(())
}

/// The helper's entry point for a process started by [`HelperClient::spawn`]: takes descriptor
/// [`HELPER_FD`] and serves it.
///
/// # Errors
/// As [`serve`].
pub fn main_from_fd(netns: Option<&str>) -> Result<(), String> {
    // SAFETY: the agent passed the socket as descriptor 3 and nothing else in this process owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(HELPER_FD) };
    serve(&UnixStream::from(fd), netns)
}

/// How to start the helper again: the first command's program, arguments, explicitly set
/// variables and directory (a restarted helper gets only those variables).
#[derive(Debug, Clone)]
struct Recipe {
    program: OsString,
    args: Vec<OsString>,
    envs: Vec<(OsString, OsString)>,
    dir: Option<PathBuf>,
}

impl Recipe {
    fn of(cmd: &Command) -> Self {
        Self {
            program: cmd.get_program().to_owned(),
            args: cmd.get_args().map(ToOwned::to_owned).collect(),
            envs: cmd
                .get_envs()
                .filter_map(|(k, v)| Some((k.to_owned(), v?.to_owned())))
                .collect(),
            dir: cmd.get_current_dir().map(ToOwned::to_owned),
        }
    }

    fn command(&self) -> Command {
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args).env_clear().envs(self.envs.clone());
        if let Some(d) = &self.dir {
            cmd.current_dir(d);
        }
        cmd
    }
}

/// One running helper: its socket, its process and a pidfd that becomes readable when it exits.
#[derive(Debug)]
struct Live {
    sock: UnixStream,
    child: Child,
    pidfd: Arc<OwnedFd>,
}

impl Live {
    fn start(mut cmd: Command) -> std::io::Result<Self> {
        let (ours, theirs) = UnixStream::pair()?;
        let fd = theirs.as_raw_fd();
        // SAFETY: the closure runs in the forked child before exec and calls only dup2 and
        // fcntl, which are async-signal-safe; it touches no memory shared with other threads.
        unsafe {
            cmd.pre_exec(move || {
                if fd == HELPER_FD {
                    let flags = libc::fcntl(fd, libc::F_GETFD);
                    if flags < 0 || libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                } else if libc::dup2(fd, HELPER_FD) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn()?;
        drop(theirs);
        let pid = libc::pid_t::try_from(child.id()).map_err(std::io::Error::other)?;
        // SAFETY: pidfd_open(2) with a pid of our own unreaped child (it cannot be reused before
        // we wait for it) and no flags; the result is checked.
        let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        let raw = match i32::try_from(raw) {
            Ok(fd) if fd >= 0 => fd,
            _ => {
                let e = std::io::Error::last_os_error();
                let _ = child.kill();
                let _ = child.wait();
                return Err(std::io::Error::other(format!("pidfd_open: {e}")));
            }
        };
        // SAFETY: `raw` is a new descriptor owned by nothing else.
        let pidfd = Arc::new(unsafe { OwnedFd::from_raw_fd(raw) });
        Ok(Self {
            sock: ours,
            child,
            pidfd,
        })
    }

    /// Closes our end (the helper exits on it) and reaps the process.
    fn stop(&mut self) {
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
        let _ = self.child.wait();
    }
}

#[derive(Debug)]
struct Shared {
    recipe: Recipe,
    live: Mutex<Live>,
}

impl Shared {
    fn live(&self) -> std::sync::MutexGuard<'_, Live> {
        self.live
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        if let Ok(l) = self.live.get_mut() {
            l.stop();
        }
    }
}

impl OwnerWatch for Shared {
    fn wait_lost(&self, timeout: Duration) -> bool {
        let fd = Arc::clone(&self.live().pidfd);
        let mut p = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
        // SAFETY: one valid pollfd for the duration of the call; `fd` stays open (we hold it).
        let n = unsafe { libc::poll(&raw mut p, 1, ms) };
        n > 0 && p.revents & libc::POLLIN != 0
    }

    fn restart(&self) -> Result<(), FirewallError> {
        let fresh = Live::start(self.recipe.command())
            .map_err(|e| FirewallError::Helper(format!("restart: {e}")))?;
        let mut old = std::mem::replace(&mut *self.live(), fresh);
        if matches!(old.child.try_wait(), Ok(None)) {
            // Not gone after all (a restart asked for by hand): stop our own child by its pid.
            let _ = old.child.kill();
        }
        old.stop();
        tracing::warn!(pid = self.live().child.id(), "pool root helper restarted");
        Ok(())
    }
}

/// The agent's end: a running helper and its socket; restartable ([`OwnerWatch`]).
#[derive(Debug)]
pub struct HelperClient {
    shared: Arc<Shared>,
}

impl HelperClient {
    /// Starts `cmd` (the helper entry: e.g. `vmnet-pool-helper --netns NS`) with one end of a
    /// new socketpair as descriptor 3. A restart ([`OwnerWatch::restart`]) runs the same
    /// program, arguments and directory with only the variables set explicitly on `cmd`.
    ///
    /// # Errors
    /// When the socketpair, the process or its pidfd cannot be made.
    pub fn spawn(cmd: Command) -> std::io::Result<Self> {
        let recipe = Recipe::of(&cmd);
        let live = Live::start(cmd)?;
        Ok(Self {
            shared: Arc::new(Shared {
                recipe,
                live: Mutex::new(live),
            }),
        })
    }

    /// Starts the helper binary `vmnet-pool-helper` installed next to the running executable,
    /// serving namespace `netns` (or the agent's own namespace with `None`).
    ///
    /// # Errors
    /// When the executable path is unknown or the process cannot be started.
    pub fn spawn_default(netns: Option<&str>) -> std::io::Result<Self> {
        let exe = std::env::current_exe()?;
        let dir = exe
            .parent()
            .ok_or_else(|| std::io::Error::other("executable has no directory"))?;
        let mut cmd = Command::new(dir.join("vmnet-pool-helper"));
        cmd.env_clear();
        if let Some(ns) = netns {
            cmd.env("VMNET_HELPER_NETNS", ns);
        }
        Self::spawn(cmd)
    }

    /// Sends one request and waits for the reply.
    ///
    /// # Errors
    /// [`FirewallError::Helper`] when the helper refused, failed or is gone.
    pub fn call(&self, req: &Request) -> Result<String, FirewallError> {
        let live = self.shared.live();
        let body = serde_json::to_vec(req).map_err(|e| FirewallError::Helper(e.to_string()))?;
        let mut w = &live.sock;
        write_frame(&mut w, &body).map_err(|e| FirewallError::Helper(format!("send: {e}")))?;
        let mut r = &live.sock;
        let bytes = read_frame(&mut r)
            .map_err(|e| FirewallError::Helper(format!("receive: {e}")))?
            .ok_or_else(|| FirewallError::Helper("the helper exited".into()))?;
        let reply: Reply = serde_json::from_slice(&bytes)
            .map_err(|e| FirewallError::Helper(format!("bad reply: {e}")))?;
        if reply.ok {
            Ok(reply.output)
        } else {
            Err(FirewallError::Helper(reply.error))
        }
    }

    /// The running helper's process id (it changes when the helper is restarted).
    pub fn pid(&self) -> u32 {
        self.shared.live().child.id()
    }
}

impl NftExec for HelperClient {
    fn apply(&self, batch: &str) -> Result<(), FirewallError> {
        self.call(&Request::Apply {
            ruleset: batch.to_owned(),
        })
        .map(drop)
    }

    fn list(&self) -> Result<String, FirewallError> {
        self.call(&Request::List)
    }

    fn owner_watch(&self) -> Option<Arc<dyn OwnerWatch>> {
        Some(Arc::clone(&self.shared) as Arc<dyn OwnerWatch>)
    }
}
