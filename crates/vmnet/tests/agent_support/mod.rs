//! Shared helpers of the agent's root tests: `vmnet serve --netns <sandbox host>` as a child
//! process with its own store and socket, readiness, logs, and running the CLI against it.

#![allow(dead_code)]

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};
use vmnet_agent::api::types::AgentStatus;
use vmnet_agent::client::Client;
use vmnet_testkit::{Sandbox, netns};

pub const VMNET: &str = env!("CARGO_BIN_EXE_vmnet");

/// A running `vmnet serve`, killed (SIGKILL, by pid) and reaped on drop.
pub struct Agent {
    pub child: Child,
}

impl Agent {
    pub fn start(sb: &Sandbox, dir: &Path) -> Self {
        Self::start_with(sb, dir, 1)
    }

    /// Starts the agent with a reconcile interval of `interval_secs`.
    pub fn start_with(sb: &Sandbox, dir: &Path, interval_secs: u64) -> Self {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("agent.log"))
            .unwrap();
        let child = Command::new(VMNET)
            .arg("--database-url")
            .arg(format!("sqlite://{}", dir.join("vmnet.db").display()))
            .arg("--socket")
            .arg(dir.join("vmnet.sock"))
            .args([
                "serve",
                "--netns",
                &sb.host(),
                "--name-prefix",
                &sb.agent_prefix(),
            ])
            .args(["--reconcile-interval-secs", &interval_secs.to_string()])
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn vmnet serve");
        Self { child }
    }

    pub fn pid(&self) -> Pid {
        Pid::from_raw(i32::try_from(self.child.id()).unwrap())
    }

    pub fn sigterm(&mut self) -> std::process::ExitStatus {
        kill(self.pid(), Signal::SIGTERM).expect("SIGTERM the agent");
        self.child.wait().unwrap()
    }

    pub fn sigkill(&mut self) {
        kill(self.pid(), Signal::SIGKILL).expect("SIGKILL the agent");
        let status = self.child.wait().unwrap();
        assert!(!status.success(), "the agent was killed: {status:?}");
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = kill(self.pid(), Signal::SIGKILL);
            let _ = self.child.wait();
        }
    }
}

pub async fn wait_ready(client: &Client, dir: &Path) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if client.get::<AgentStatus>("/v1/status").await.is_ok() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "agent not ready; log:\n{}",
            log(dir)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub fn log(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("agent.log")).unwrap_or_default()
}

pub fn vm(prefix_id: &str, uid: u32) -> Value {
    json!({"id": format!("{prefix_id}{uid}"), "user_id": uid, "tenant": 1, "mesh_ipv6": format!("fdaa:7::{uid:x}"),
           "network": {"routes": [{"destination": "0.0.0.0/0", "via": "host"}, {"destination": "::/0", "via": "host"}]}})
}

/// Link names in a namespace (via iproute2 inside the sandbox only).
pub fn links(ns: &str) -> Vec<String> {
    let out = netns::ip(ns, &["-o", "link", "show"]).unwrap_or_default();
    out.lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap_or(n).to_owned())
        .collect()
}

pub fn run_cli(dir: &Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(VMNET)
        .arg("--socket")
        .arg(dir.join("vmnet.sock"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}
