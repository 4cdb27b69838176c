//! One way to run the agent as a child process: `vmnet serve --netns <host namespace>` with its
//! own socket, state directory, database and log, for the sandbox jobs, the benchmarks and the
//! root tests.
//!
//! [`AgentOptions`] says how to run it (binary, namespace, name prefix, paths, extra `serve`
//! arguments); [`AgentOptions::spawn`] starts it and [`AgentProc::wait_ready`] waits until its
//! API answers `GET /v1/status` ([`AgentOptions::start`] does both).
//!
//! # Stopping
//! An [`AgentProc`] stops its process when dropped: `SIGCONT` (it may be held with `SIGSTOP`),
//! `SIGTERM`, and `SIGKILL` once the grace period ([`AgentOptions::stop_grace`], 10 s by default)
//! passed; then it is reaped. Signals go to the pid of the child this process started and has
//! not reaped yet, so never to a reused pid. [`AgentProc::detach`] disarms the guard for an agent
//! that outlives its starter (the sandbox records its pid and `vmnet-lab down` stops it).

use std::ffi::OsString;
use std::fs::OpenOptions;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use vmnet_agent::client::Client;
use vmnet_model::Error;

/// How often readiness and exit are polled.
const POLL: Duration = Duration::from_millis(50);

/// How to run one agent (a builder; see the module docs).
#[derive(Debug, Clone)]
pub struct AgentOptions {
    exe: Option<PathBuf>,
    netns: String,
    name_prefix: String,
    socket: PathBuf,
    state_dir: PathBuf,
    database_url: Option<String>,
    log: PathBuf,
    args: Vec<OsString>,
    rust_log: Option<String>,
    process_group: bool,
    stop_grace: Duration,
}

impl AgentOptions {
    /// An agent in namespace `netns` with name prefix `name_prefix`, everything of its own under
    /// `dir`: socket `dir/vmnet.sock`, state directory `dir/state`, database
    /// `sqlite://dir/vmnet.db`, log `dir/agent.log` (appended to, stdout and stderr). The binary
    /// is the product's `vmnet` ([`crate::exe::vmnet`]).
    #[must_use]
    pub fn new(netns: impl Into<String>, name_prefix: impl Into<String>, dir: &Path) -> Self {
        Self {
            exe: None,
            netns: netns.into(),
            name_prefix: name_prefix.into(),
            socket: dir.join("vmnet.sock"),
            state_dir: dir.join("state"),
            database_url: Some(format!("sqlite://{}", dir.join("vmnet.db").display())),
            log: dir.join("agent.log"),
            args: Vec::new(),
            rust_log: None,
            process_group: false,
            stop_grace: Duration::from_secs(10),
        }
    }

    /// Runs `exe` (a `vmnet` binary) instead of the one [`crate::exe::vmnet`] finds.
    #[must_use]
    pub fn exe(mut self, exe: impl Into<PathBuf>) -> Self {
        self.exe = Some(exe.into());
        self
    }

    /// The API socket.
    #[must_use]
    pub fn socket(mut self, socket: impl Into<PathBuf>) -> Self {
        self.socket = socket.into();
        self
    }

    /// The state directory (created on spawn when missing).
    #[must_use]
    pub fn state_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.state_dir = dir.into();
        self
    }

    /// The database URL (`sqlite://…` or `postgres://…`).
    #[must_use]
    pub fn database_url(mut self, url: impl Into<String>) -> Self {
        self.database_url = Some(url.into());
        self
    }

    /// No `--database-url`: the agent's default, a SQLite file under the state directory.
    #[must_use]
    pub fn default_database(mut self) -> Self {
        self.database_url = None;
        self
    }

    /// The log file (appended to).
    #[must_use]
    pub fn log(mut self, log: impl Into<PathBuf>) -> Self {
        self.log = log.into();
        self
    }

    /// One more argument of `serve` (after `--netns` and `--name-prefix`).
    #[must_use]
    pub fn arg(mut self, arg: impl Into<OsString>) -> Self {
        self.args.push(arg.into());
        self
    }

    /// More arguments of `serve`.
    #[must_use]
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// The agent's `RUST_LOG` (default: this process's `RUST_LOG`, else `info`).
    #[must_use]
    pub fn rust_log(mut self, filter: impl Into<String>) -> Self {
        self.rust_log = Some(filter.into());
        self
    }

    /// Starts it in a process group of its own, so a Ctrl-C at the terminal does not reach it
    /// (for an agent its starter stops, or leaves running, itself).
    #[must_use]
    pub fn own_process_group(mut self) -> Self {
        self.process_group = true;
        self
    }

    /// How long a stop waits after `SIGTERM` before `SIGKILL`.
    #[must_use]
    pub fn stop_grace(mut self, grace: Duration) -> Self {
        self.stop_grace = grace;
        self
    }

    /// The API socket it will listen on.
    #[must_use]
    pub fn socket_path(&self) -> &Path {
        &self.socket
    }

    /// The whole command line after the binary: global options, then `serve` and its own.
    #[must_use]
    pub fn command_args(&self) -> Vec<OsString> {
        let mut a: Vec<OsString> = Vec::new();
        if let Some(url) = &self.database_url {
            a.extend(["--database-url".into(), url.into()]);
        }
        a.extend([
            "--socket".into(),
            self.socket.clone().into(),
            "--state-dir".into(),
            self.state_dir.clone().into(),
            "serve".into(),
            "--netns".into(),
            (&self.netns).into(),
            "--name-prefix".into(),
            (&self.name_prefix).into(),
        ]);
        // A sandbox agent takes its settings from this line (and a file it is given), never
        // from a host's /etc/vmnet/vmnet.toml.
        let own_file = self.args.iter().any(|a| {
            a.to_str()
                .is_some_and(|a| a == "--config" || a.starts_with("--config="))
        });
        if !own_file {
            a.extend(["--config".into(), "/dev/null".into()]);
        }
        a.extend(self.args.iter().cloned());
        a
    }

    /// Starts the agent (stdin closed, stdout and stderr appended to the log); does not wait.
    ///
    /// # Errors
    /// `INTERNAL` when the binary, the state directory or the log cannot be had, or the process
    /// cannot be started.
    pub fn spawn(&self) -> Result<AgentProc, Error> {
        let exe = match &self.exe {
            Some(e) => e.clone(),
            None => crate::exe::vmnet()?,
        };
        std::fs::create_dir_all(&self.state_dir)
            .map_err(|e| Error::internal(format!("{}: {e}", self.state_dir.display())))?;
        crate::worker_user::ensure(vmnet_agent::worker::DEFAULT_USER).map_err(Error::internal)?;
        let log_err = |e: std::io::Error| Error::internal(format!("{}: {e}", self.log.display()));
        let out = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(log_err)?;
        let err = out.try_clone().map_err(log_err)?;
        let rust_log = self
            .rust_log
            .clone()
            .or_else(|| std::env::var("RUST_LOG").ok())
            .unwrap_or_else(|| "info".into());
        let args = self.command_args();
        let command = crate::agent_args::command_line(&exe, &args);
        let mut cmd = Command::new(&exe);
        crate::state::inherit_no_descriptors(&mut cmd);
        cmd.args(args)
            .env("RUST_LOG", rust_log)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        if self.process_group {
            cmd.process_group(0);
        }
        let child = cmd
            .spawn()
            .map_err(|e| Error::internal(format!("cannot start {} serve: {e}", exe.display())))?;
        Ok(AgentProc {
            child,
            client: Client::new(self.socket.clone()),
            log: self.log.clone(),
            command,
            grace: self.stop_grace,
            armed: true,
            reaped: false,
        })
    }

    /// [`spawn`](Self::spawn) and [`AgentProc::wait_ready`].
    ///
    /// # Errors
    /// As those two; the agent is stopped again when it does not become ready.
    pub async fn start(&self, timeout: Duration) -> Result<AgentProc, Error> {
        let mut agent = self.spawn()?;
        agent.wait_ready(timeout).await?;
        Ok(agent)
    }
}

/// A running agent this process started; stopped on drop unless [detached](Self::detach).
#[derive(Debug)]
pub struct AgentProc {
    child: Child,
    client: Client,
    log: PathBuf,
    command: Vec<String>,
    grace: Duration,
    armed: bool,
    /// Whether the child was reaped (its pid may belong to another process since).
    reaped: bool,
}

impl AgentProc {
    /// Waits until the API answers `GET /v1/status`.
    ///
    /// # Errors
    /// `INTERNAL` with the tail of the log when the agent exits first or does not answer
    /// within `timeout`.
    pub async fn wait_ready(&mut self, timeout: Duration) -> Result<(), Error> {
        let start = Instant::now();
        loop {
            let e = match self.client.get::<serde_json::Value>("/v1/status").await {
                Ok(_) => return Ok(()),
                Err(e) => e,
            };
            if let Some(status) = self.try_wait() {
                return Err(Error::internal(format!(
                    "the agent exited ({status}): {}",
                    self.log_tail()
                )));
            }
            if start.elapsed() > timeout {
                return Err(Error::internal(format!(
                    "the agent did not answer within {timeout:?}: {e}; {}",
                    self.log_tail()
                )));
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// A client of its API.
    #[must_use]
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Its process id.
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its log file.
    #[must_use]
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// Its whole command line: the binary, then every argument.
    #[must_use]
    pub fn command(&self) -> &[String] {
        &self.command
    }

    /// The whole log (empty when unreadable).
    #[must_use]
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last lines of the log, for error messages.
    #[must_use]
    pub fn log_tail(&self) -> String {
        crate::state::log_tail(&self.log)
    }

    /// Whether it still runs (reaps it when it has exited).
    pub fn running(&mut self) -> bool {
        self.try_wait().is_none()
    }

    /// Sends `sig` (e.g. `SIGSTOP` to hold its loops off, `SIGCONT` to let them run again). An
    /// exited child that was not reaped yet keeps its pid, so the signal never reaches another
    /// process.
    ///
    /// # Errors
    /// `INTERNAL` when it was reaped already or the signal cannot be sent.
    pub fn signal(&self, sig: Signal) -> Result<(), Error> {
        if self.reaped {
            return Err(Error::internal(format!(
                "{sig} to the agent: it has exited; {}",
                self.log_tail()
            )));
        }
        kill(self.nix_pid()?, sig).map_err(|e| Error::internal(format!("{sig} to the agent: {e}")))
    }

    /// Sends `SIGTERM` and waits until it exits (a graceful stop has no deadline here).
    ///
    /// # Errors
    /// As [`signal`](Self::signal), or when waiting fails.
    pub fn sigterm(&mut self) -> Result<ExitStatus, Error> {
        self.signal(Signal::SIGTERM)?;
        self.wait()
    }

    /// Sends `SIGKILL` and reaps it.
    ///
    /// # Errors
    /// As [`signal`](Self::signal), or when waiting fails.
    pub fn sigkill(&mut self) -> Result<ExitStatus, Error> {
        self.signal(Signal::SIGKILL)?;
        self.wait()
    }

    /// Stops it as the drop guard does (`SIGCONT`, `SIGTERM`, `SIGKILL` after the grace period)
    /// and reaps it; its exit status (`None` when waiting failed).
    pub fn stop(&mut self) -> Option<ExitStatus> {
        if let Some(status) = self.try_wait() {
            return Some(status);
        }
        let _ = self.signal(Signal::SIGCONT);
        let _ = self.signal(Signal::SIGTERM);
        let start = Instant::now();
        while start.elapsed() < self.grace {
            if let Some(status) = self.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.signal(Signal::SIGKILL);
        self.wait().ok()
    }

    /// Disarms the drop guard and leaves the agent running; returns its pid, by which its
    /// starter stops it later.
    #[must_use]
    pub fn detach(mut self) -> u32 {
        self.armed = false;
        self.child.id()
    }

    fn wait(&mut self) -> Result<ExitStatus, Error> {
        let status = self
            .child
            .wait()
            .map_err(|e| Error::internal(format!("waiting for the agent: {e}")))?;
        self.reaped = true;
        Ok(status)
    }

    /// Its exit status when it has exited (reaping it), `None` while it runs.
    fn try_wait(&mut self) -> Option<ExitStatus> {
        let status = self.child.try_wait().ok().flatten();
        self.reaped |= status.is_some();
        status
    }

    fn nix_pid(&self) -> Result<Pid, Error> {
        i32::try_from(self.child.id())
            .map(Pid::from_raw)
            .map_err(|e| Error::internal(format!("agent pid {}: {e}", self.child.id())))
    }
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.stop();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;

    use super::*;

    /// An executable shell script standing in for `vmnet` (it ignores the arguments).
    ///
    /// A short-lived `sh` writes it, not this process: a test thread that forks while this
    /// process holds the file open for writing would hand that descriptor to its child, and
    /// exec'ing the script would then fail with ETXTBSY until the child execs.
    fn script(dir: &Path, body: &str) -> PathBuf {
        let p = dir.join("fake-vmnet");
        let status = std::process::Command::new("sh")
            .args(["-c", r#"printf '%s\n' "$1" > "$2" && chmod 755 "$2""#, "sh"])
            .arg(format!("#!/bin/sh\n{body}"))
            .arg(&p)
            .status()
            .unwrap();
        assert!(status.success(), "writing {}: {status}", p.display());
        p
    }

    #[test]
    fn the_command_line_holds_every_option_in_order() {
        let dir = Path::new("/d");
        let args = |o: &AgentOptions| -> Vec<String> {
            o.command_args()
                .iter()
                .map(|a| a.to_string_lossy().into_owned())
                .collect()
        };
        let o = AgentOptions::new("h1host", "h1", dir);
        assert_eq!(
            args(&o),
            [
                "--database-url",
                "sqlite:///d/vmnet.db",
                "--socket",
                "/d/vmnet.sock",
                "--state-dir",
                "/d/state",
                "serve",
                "--netns",
                "h1host",
                "--name-prefix",
                "h1",
                "--config",
                "/dev/null",
            ]
        );
        let own = AgentOptions::new("h1host", "h1", dir).args(["--config", "/c.toml"]);
        assert_eq!(args(&own)[args(&own).len() - 2..], ["--config", "/c.toml"]);
        assert_eq!(args(&own).iter().filter(|a| *a == "--config").count(), 1);
        let o = o
            .socket("/s/api.sock")
            .state_dir("/s/st")
            .default_database()
            .args(["--host-id", "h1"])
            .arg("--create-bridge");
        assert_eq!(
            args(&o),
            [
                "--socket",
                "/s/api.sock",
                "--state-dir",
                "/s/st",
                "serve",
                "--netns",
                "h1host",
                "--name-prefix",
                "h1",
                "--config",
                "/dev/null",
                "--host-id",
                "h1",
                "--create-bridge",
            ]
        );
        assert_eq!(o.socket_path(), Path::new("/s/api.sock"));
        let o = o.database_url("postgres:///x?host=/run/pg");
        assert_eq!(
            args(&o)[..2],
            ["--database-url", "postgres:///x?host=/run/pg"]
        );
    }

    #[tokio::test]
    async fn an_agent_that_exits_is_reported_with_its_log() {
        let tmp = tempfile::tempdir().unwrap();
        let exe = script(tmp.path(), "echo 'no such namespace: h1host' >&2; exit 3");
        let err = AgentOptions::new("h1host", "h1", tmp.path())
            .exe(exe)
            .start(Duration::from_secs(10))
            .await
            .unwrap_err();
        assert!(
            err.message.contains("the agent exited (exit status: 3)")
                && err.message.contains("no such namespace: h1host"),
            "{err}"
        );
        assert!(tmp.path().join("state").is_dir(), "state dir made");
    }

    #[tokio::test]
    async fn a_silent_agent_times_out_and_is_killed_after_the_grace() {
        let tmp = tempfile::tempdir().unwrap();
        // Ignores SIGTERM, never listens.
        let exe = script(
            tmp.path(),
            "trap '' TERM\necho started\nwhile :; do sleep 0.05; done",
        );
        let options = AgentOptions::new("h1host", "h1", tmp.path())
            .exe(exe)
            .stop_grace(Duration::from_millis(300));
        let mut agent = options.spawn().unwrap();
        let err = agent
            .wait_ready(Duration::from_millis(300))
            .await
            .unwrap_err();
        assert!(
            err.message.contains("did not answer within 300ms") && err.message.contains("started"),
            "{err}"
        );
        assert!(agent.running());
        agent.signal(Signal::SIGTERM).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        assert!(agent.running(), "SIGTERM is ignored");
        let t = Instant::now();
        let status = agent.stop().expect("reaped");
        assert!(
            t.elapsed() >= Duration::from_millis(300),
            "waited the grace"
        );
        assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
        assert!(!agent.running());
        let err = agent.signal(Signal::SIGCONT).unwrap_err();
        assert!(err.message.contains("it has exited"), "{err}");
    }

    #[tokio::test]
    async fn a_detached_agent_keeps_running() {
        let tmp = tempfile::tempdir().unwrap();
        let exe = script(tmp.path(), "exec sleep 30");
        let agent = AgentOptions::new("h1host", "h1", tmp.path())
            .exe(exe)
            .own_process_group()
            .spawn()
            .unwrap();
        let pid = agent.detach();
        let raw = Pid::from_raw(i32::try_from(pid).unwrap());
        assert!(
            kill(raw, None).is_ok(),
            "still running after the guard dropped"
        );
        kill(raw, Signal::SIGKILL).unwrap();
        nix::sys::wait::waitpid(raw, None).unwrap();
    }
}
