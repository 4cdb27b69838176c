//! Shared helpers of the agent's root tests: `vmnet serve --netns <sandbox host>` as a child
//! process with its own store and socket ([`vmnet_testkit::agent`]), and running the CLI
//! against it.

#![allow(dead_code)]

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};
use vmnet_testkit::agent::{AgentOptions, AgentProc};
use vmnet_testkit::{Sandbox, netns};

pub const VMNET: &str = env!("CARGO_BIN_EXE_vmnet");

/// How long an agent may take to answer after its start.
pub const READY: Duration = Duration::from_secs(20);

/// The tests' agent: this package's `vmnet` in the sandbox host under the sandbox's agent
/// prefix, socket, state, database and log under `dir`, a reconcile pass every
/// `interval_secs`.
pub fn options(sb: &Sandbox, dir: &Path, interval_secs: u64) -> AgentOptions {
    AgentOptions::new(sb.host(), sb.agent_prefix(), dir)
        .exe(VMNET)
        .args([
            "--reconcile-interval-secs".to_owned(),
            interval_secs.to_string(),
        ])
}

/// Starts the agent and waits until it answers (panics with its log otherwise); it is stopped
/// when the returned guard drops.
pub async fn start(options: &AgentOptions) -> AgentProc {
    options
        .start(READY)
        .await
        .unwrap_or_else(|e| panic!("vmnet serve: {e}"))
}

/// SIGKILLs the agent and asserts it died of it.
pub fn sigkill(agent: &mut AgentProc) {
    let status = agent.sigkill().expect("SIGKILL the agent");
    assert!(!status.success(), "the agent was killed: {status:?}");
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
