//! `wireguard-go` as the mesh interface's device: started in the foreground (`-f`) in the
//! calling process's network namespace, in a process group of its own, so it outlives the agent
//! (an agent restart must not interrupt tunnels). A later agent adopts a running instance
//! through its UAPI socket; the pid serving the socket (`SO_PEERCRED`) is the instance.

use std::fs::OpenOptions;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::WgError;
use super::sockbuf;
use super::uapi::Uapi;

/// How long a started `wireguard-go` may take to open its UAPI socket.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// One interface's `wireguard-go`.
#[derive(Debug)]
pub struct Daemon {
    ifname: String,
    exe: PathBuf,
    log: Option<PathBuf>,
    uapi: Uapi,
    /// The instance this process started and has not reaped yet.
    child: Mutex<Option<Child>>,
    /// The size its UDP sockets' buffers get ([`Daemon::size_sockets`]); `None`: left alone.
    socket_bytes: Option<u32>,
}

impl Daemon {
    /// The device of interface `ifname`, run by `exe` (e.g. `wireguard-go`), its output appended
    /// to `log` when given.
    #[must_use]
    pub fn new(ifname: &str, exe: &Path, log: Option<PathBuf>) -> Self {
        Self {
            ifname: ifname.to_owned(),
            exe: exe.to_owned(),
            log,
            uapi: Uapi::new(ifname),
            child: Mutex::new(None),
            socket_bytes: Some(sockbuf::DEFAULT_BYTES),
        }
    }

    /// Sizes the device's UDP socket buffers to `bytes` (`None`: leave them as the device sets
    /// them). The default is [`sockbuf::DEFAULT_BYTES`].
    #[must_use]
    pub fn socket_buffers(mut self, bytes: Option<u32>) -> Self {
        self.socket_bytes = bytes;
        self
    }

    /// Gives the running instance's UDP sockets the configured buffers, writing only those
    /// smaller ([`sockbuf::ensure`]); returns them as read back. Nothing when no instance runs
    /// or sizing is off. Call after every change that makes the device open sockets (its link
    /// coming up, its listen port set).
    ///
    /// # Errors
    /// See [`sockbuf::ensure`].
    pub fn size_sockets(&self) -> Result<Vec<sockbuf::UdpSocket>, WgError> {
        match (self.socket_bytes, self.pid()) {
            (Some(bytes), Some(pid)) => sockbuf::ensure(pid, bytes),
            _ => Ok(Vec::new()),
        }
    }

    /// The running instance's UDP sockets with their buffers as they are (nothing written).
    ///
    /// # Errors
    /// See [`sockbuf::read`].
    pub fn read_sockets(&self) -> Result<Vec<sockbuf::UdpSocket>, WgError> {
        self.pid().map_or_else(|| Ok(Vec::new()), sockbuf::read)
    }

    /// The UAPI client of the interface.
    #[must_use]
    pub fn uapi(&self) -> &Uapi {
        &self.uapi
    }

    /// Reaps our instance if it exited (so it leaves no zombie).
    fn reap(&self) {
        if let Ok(mut c) = self.child.lock()
            && let Some(ch) = c.as_mut()
            && !matches!(ch.try_wait(), Ok(None))
        {
            *c = None;
        }
    }

    /// The pid of the running instance (ours or adopted), or `None` when none answers.
    #[must_use]
    pub fn pid(&self) -> Option<u32> {
        self.reap();
        self.uapi.server_pid().ok()
    }

    /// Starts `wireguard-go` and waits until its socket answers. Returns its pid.
    ///
    /// # Errors
    /// `Io` when it cannot be started; `Device` when it exited or did not answer in time.
    pub fn start(&self) -> Result<u32, WgError> {
        self.reap();
        // A socket nobody serves (a killed instance) would make the new one refuse to start.
        if self.uapi.server_pid().is_err() {
            let _ = std::fs::remove_file(self.uapi.path());
        }
        let (out, err) = match &self.log {
            Some(p) => {
                let io = |e| WgError::Io {
                    what: format!("open {}", p.display()),
                    source: e,
                };
                let f = OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)
                    .map_err(io)?;
                let f2 = f.try_clone().map_err(io)?;
                (Stdio::from(f), Stdio::from(f2))
            }
            None => (Stdio::null(), Stdio::null()),
        };
        let mut child = Command::new(&self.exe)
            .arg("-f")
            .arg(&self.ifname)
            .env("WG_PROCESS_FOREGROUND", "1")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .spawn()
            .map_err(|e| WgError::Io {
                what: format!("start {} -f {}", self.exe.display(), self.ifname),
                source: e,
            })?;
        let pid = child.id();
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(WgError::Device(format!(
                    "{} -f {} exited at start ({status})",
                    self.exe.display(),
                    self.ifname
                )));
            }
            if self.uapi.server_pid().is_ok_and(|p| p == pid) {
                break;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(WgError::Device(format!(
                    "{} -f {}: no UAPI socket after {START_TIMEOUT:?}",
                    self.exe.display(),
                    self.ifname
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if let Ok(mut c) = self.child.lock() {
            *c = Some(child);
        }
        Ok(pid)
    }

    /// Stops the running instance (ours, or an adopted one that is `wireguard-go`): `SIGTERM`,
    /// then `SIGKILL` after 2 s. Its interface goes with it.
    pub fn stop(&self) {
        let ours = self.child.lock().ok().and_then(|mut c| c.take());
        if let Some(mut ch) = ours {
            let _ = kill(
                Pid::from_raw(i32::try_from(ch.id()).unwrap_or(0)),
                Signal::SIGTERM,
            );
            let deadline = Instant::now() + Duration::from_secs(2);
            while matches!(ch.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = ch.kill();
            let _ = ch.wait();
            return;
        }
        if let Ok(pid) = self.uapi.server_pid() {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            if comm.trim() == "wireguard-go"
                && let Ok(p) = i32::try_from(pid)
            {
                let _ = kill(Pid::from_raw(p), Signal::SIGTERM);
                let deadline = Instant::now() + Duration::from_secs(2);
                while self.uapi.server_pid().is_ok() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(20));
                }
                let _ = kill(Pid::from_raw(p), Signal::SIGKILL);
            }
        }
    }
}
