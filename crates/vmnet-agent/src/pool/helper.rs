//! The root helper for nftables (spec: "privilege separation"): a separate process, started by
//! the agent with `Command` (fork + exec, never a bare fork of the multi-threaded agent), spoken
//! to over a socketpair inherited as file descriptor 3.
//!
//! # Protocol
//! Both directions send frames of a 4-byte big-endian length and that many bytes of JSON.
//! Requests: `{"op":"apply","ruleset":"<nft JSON>"}` or `{"op":"list"}`. Replies:
//! `{"ok":true,"output":"…"}` or `{"ok":false,"error":"…"}`. The helper applies a ruleset only
//! after [`vmnet_plan::pool::validate::validate`] accepted it; a refusal carries the reason. It serves one
//! agent, one request at a time, and exits when the socket closes.
//!
//! # Design
//! The helper enters the target namespace on its main thread before doing anything else (it is
//! single-threaded), then opens one libnftables context there and keeps it. The agent side
//! ([`HelperClient`]) implements [`NftExec`], so the pool firewall drives the helper exactly as it
//! drives an in-process context.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use vmnet_kernel::pool::firewall::{FirewallError, LIST_RULESET, NftExec};
use vmnet_kernel::pool::libnft::LibNft;
use vmnet_model::error::chain;

use vmnet_plan::pool::validate::validate;

/// The descriptor number the helper finds its socket on.
pub const HELPER_FD: i32 = 3;

/// The longest the agent waits for the helper to take a request or answer it; a helper that
/// takes longer is killed and started again (the request fails).
pub const HELPER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

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
        Request::Apply { ruleset } => match validate(ruleset) {
            Ok(()) => nft.run(ruleset).map_err(|e| chain(&e)),
            Err(refusal) => Err(refusal.to_string()),
        },
        Request::List => nft.run(LIST_RULESET).map_err(|e| chain(&e)),
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
            .map_err(|e| format!("enter netns {ns}: {}", chain(&e)))?;
    }
    let nft = LibNft::here().map_err(|e| chain(&e))?;
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

/// How the agent starts a helper: a fresh [`Command`] for each start (the first and every
/// restart after the helper died).
pub type HelperCommand = Box<dyn Fn() -> Command + Send + Sync>;

/// A running helper process and the agent's end of its socket.
#[derive(Debug)]
struct Running {
    sock: UnixStream,
    child: Child,
}

impl Running {
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
        let child = cmd.spawn()?;
        drop(theirs);
        ours.set_read_timeout(Some(HELPER_TIMEOUT))?;
        ours.set_write_timeout(Some(HELPER_TIMEOUT))?;
        Ok(Self { sock: ours, child })
    }

    /// One request and its reply on this helper's socket.
    fn exchange(&self, body: &[u8]) -> Result<Vec<u8>, String> {
        let mut w = &self.sock;
        write_frame(&mut w, body).map_err(|e| format!("send: {e}"))?;
        let mut r = &self.sock;
        read_frame(&mut r)
            .map_err(|e| format!("receive: {e}"))?
            .ok_or_else(|| "the helper exited before its reply".to_owned())
    }

    /// Closes the socket (the helper exits when it sees the end) and reaps the process, killing
    /// it first when `kill` (a helper that failed may hang); how it ended, for the log.
    fn stop(mut self, kill: bool) -> String {
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
        if kill {
            // Our own child, not reaped yet: the pid cannot belong to another process.
            let _ = self.child.kill();
        }
        match self.child.wait() {
            Ok(st) => st.to_string(),
            Err(e) => format!("not reaped: {e}"),
        }
    }
}

/// The agent's end: the running helper, restarted when it dies.
///
/// A helper that vanishes (killed, crashed, or gone before its reply) fails the request in
/// flight with [`FirewallError::Helper`] naming what happened; the agent logs it with the
/// helper's pid and exit status and starts a new helper at once, so the next request (the drift
/// audit's listing, the next pass) finds one. Nothing is retried blindly: the caller's next pass
/// compares the kernel with what it wants and converges.
pub struct HelperClient {
    make: HelperCommand,
    running: Mutex<Option<Running>>,
}

impl std::fmt::Debug for HelperClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HelperClient")
            .field("pid", &self.pid())
            .finish()
    }
}

impl HelperClient {
    /// Starts the helper `make` describes (e.g. `vmnet-pool-helper` with `VMNET_HELPER_NETNS`)
    /// with one end of a new socketpair as descriptor 3; `make` is called again for every
    /// restart.
    ///
    /// # Errors
    /// When the socketpair or the process cannot be made.
    pub fn spawn(make: impl Fn() -> Command + Send + Sync + 'static) -> std::io::Result<Self> {
        let running = Running::start(make())?;
        Ok(Self {
            make: Box::new(make),
            running: Mutex::new(Some(running)),
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
            .ok_or_else(|| std::io::Error::other("executable has no directory"))?
            .to_owned();
        let netns = netns.map(str::to_owned);
        Self::spawn(move || {
            let mut cmd = Command::new(dir.join("vmnet-pool-helper"));
            cmd.env_clear();
            if let Some(ns) = &netns {
                cmd.env("VMNET_HELPER_NETNS", ns);
            }
            cmd
        })
    }

    /// Sends one request and waits for the reply. When the helper is gone (see the type's
    /// docs) the request fails and a new helper is started for the next one.
    ///
    /// # Errors
    /// [`FirewallError::Helper`] when the helper refused, failed or is gone.
    pub fn call(&self, req: &Request) -> Result<String, FirewallError> {
        let body = serde_json::to_vec(req).map_err(|e| FirewallError::Helper(e.to_string()))?;
        let mut slot = self
            .running
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if slot.is_none() {
            *slot = Some(self.restart("no helper was running")?);
        }
        let Some(running) = slot.as_ref() else {
            return Err(FirewallError::Helper("no helper is running".into()));
        };
        let bytes = match running.exchange(&body) {
            Ok(b) => b,
            Err(why) => {
                let dead = slot.take();
                let (pid, ended) =
                    dead.map_or((0, String::new()), |r| (r.child.id(), r.stop(true)));
                tracing::warn!(
                    pid,
                    "pool root helper failed ({why}; it ended: {ended}); starting a new one"
                );
                *slot = self.restart(&why).ok();
                return Err(FirewallError::Helper(format!(
                    "the root helper (pid {pid}) failed: {why}; it ended: {ended}"
                )));
            }
        };
        drop(slot);
        let reply: Reply = serde_json::from_slice(&bytes)
            .map_err(|e| FirewallError::Helper(format!("bad reply: {e}")))?;
        if reply.ok {
            Ok(reply.output)
        } else {
            Err(FirewallError::Helper(reply.error))
        }
    }

    fn restart(&self, after: &str) -> Result<Running, FirewallError> {
        match Running::start((self.make)()) {
            Ok(r) => {
                tracing::info!(pid = r.child.id(), "pool root helper started again");
                Ok(r)
            }
            Err(e) => {
                tracing::error!("pool root helper cannot be started again: {e}");
                Err(FirewallError::Helper(format!(
                    "{after}; starting a new helper failed: {e}"
                )))
            }
        }
    }

    /// The running helper's process id (0 while none runs).
    pub fn pid(&self) -> u32 {
        self.running
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map_or(0, |r| r.child.id())
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
}

impl Drop for HelperClient {
    fn drop(&mut self) {
        // Closing our end makes the helper exit; reap it.
        if let Some(r) = self
            .running
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
        {
            r.stop(false);
        }
    }
}
