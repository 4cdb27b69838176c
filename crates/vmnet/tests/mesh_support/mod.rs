//! Shared helpers of the mesh's root tests: fleet hosts (test kit [`Fleet`]) each running
//! `vmnet serve --mesh` in its host namespace with a test-unique interface name (the UAPI socket
//! directory is global), syncing them with each other, and stopping every `wireguard-go` the
//! agents started when the test ends (pass or fail).

#![allow(dead_code)]

pub mod vms;

use std::net::{IpAddr, Ipv6Addr};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use vmnet_agent::mesh::view::{MeshView, SyncOutcome};
use vmnet_kernel::wg::uapi::Uapi;
use vmnet_model::Error;
use vmnet_testkit::agent::{AgentOptions, AgentProc};
use vmnet_testkit::fleet::HostNet;
use vmnet_testkit::{Fleet, traffic};

pub const VMNET: &str = env!("CARGO_BIN_EXE_vmnet");
pub const PORT: u16 = 51820;

/// One fleet host with its agent.
pub struct Node {
    pub host: HostNet,
    pub agent: Option<AgentProc>,
    pub ifname: String,
    pub mesh: Ipv6Addr,
    pub key: String,
    pub dir: PathBuf,
    /// More `vmnet serve` arguments (kept for restarts).
    pub extra: Vec<String>,
}

/// The mesh address of host `i`.
pub fn mesh_of(i: u8) -> Ipv6Addr {
    Ipv6Addr::new(0xfdaa, 0, 0, 0, 0, 0, 0, u16::from(i))
}

/// Kills every `wireguard-go` serving the given interfaces (started by our agents) on drop and
/// removes their sockets.
pub struct WgGuard(pub Vec<String>);

impl Drop for WgGuard {
    fn drop(&mut self) {
        for i in &self.0 {
            if let Ok(pid) = Uapi::new(i).server_pid() {
                let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
                if comm.trim() == "wireguard-go" {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap()),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
            }
            // A killed wireguard-go leaves its socket behind; the directory is the machine's.
            std::thread::sleep(Duration::from_millis(50));
            if Uapi::new(i).server_pid().is_err() {
                let _ = std::fs::remove_file(Uapi::new(i).path());
            }
        }
    }
}

/// The agent options of `host` with the mesh on, its mesh address `mesh`.
pub fn options(
    host: &HostNet,
    ifname: &str,
    mesh: Ipv6Addr,
    dir: &std::path::Path,
) -> AgentOptions {
    AgentOptions::new(&host.ns, &host.prefix, dir)
        .exe(VMNET)
        .args([
            "--reconcile-interval-secs".to_owned(),
            "1".to_owned(),
            "--mesh".to_owned(),
            "--wg-interface".to_owned(),
            ifname.to_owned(),
            "--mesh-address".to_owned(),
            mesh.to_string(),
        ])
}

impl Node {
    pub fn client(&self) -> &vmnet_agent::client::Client {
        self.agent.as_ref().expect("agent running").client()
    }

    /// The agent's log and wireguard-go's, for failure messages.
    pub fn logs(&self) -> String {
        let wg = std::fs::read_to_string(
            self.dir
                .join("state")
                .join(format!("wireguard-go-{}.log", self.ifname)),
        )
        .unwrap_or_default();
        format!(
            "agent:\n{}\nwireguard-go:\n{wg}",
            self.agent
                .as_ref()
                .map(|a| a.log_text())
                .unwrap_or_default()
        )
    }

    pub async fn view(&self) -> MeshView {
        self.client().get("/v1/mesh").await.expect("GET /v1/mesh")
    }

    pub async fn sync(&self, body: &Value) -> Result<SyncOutcome, Error> {
        self.client().post("/v1/sync", Some(body)).await
    }

    /// `kill -9` of the agent (nothing of it runs its shutdown), then a fresh start.
    pub async fn kill9_and_restart(&mut self) {
        let mut a = self.agent.take().expect("agent running");
        let status = a.sigkill().expect("SIGKILL the agent");
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(9),
            "the agent died of SIGKILL: {status:?}"
        );
        self.start_again().await;
    }

    pub async fn restart(&mut self) {
        drop(self.agent.take());
        self.start_again().await;
    }

    async fn start_again(&mut self) {
        let o = options(&self.host, &self.ifname, self.mesh, &self.dir).args(self.extra.clone());
        self.agent = Some(
            o.start(Duration::from_secs(30))
                .await
                .expect("agent restart"),
        );
    }
}

/// The peer entry of `n` as seen from the others (endpoint on the private network, IPv6).
pub fn peer_of(n: &Node) -> Value {
    json!({"public_key": n.key, "endpoint": format!("[{}]:{PORT}", n.host.private_v6),
           "mesh_address": n.mesh.to_string()})
}

/// The sync body for `nodes[i]`: every other node.
pub fn body_for(nodes: &[Node], i: usize) -> Value {
    let peers: Vec<Value> = nodes
        .iter()
        .enumerate()
        .filter(|(j, _)| *j != i)
        .map(|(_, n)| peer_of(n))
        .collect();
    json!({"peers": peers, "whitelist": []})
}

/// A fleet of `n` hosts, each with its mesh agent.
pub struct Mesh {
    pub nodes: Vec<Node>,
    pub _wg: WgGuard,
    pub fleet: Fleet,
    pub _tmp: tempfile::TempDir,
}

impl Mesh {
    pub async fn start(n: usize) -> Self {
        Self::start_with(n, |_| Vec::new()).await
    }

    /// As [`Mesh::start`], each agent with the more arguments `extra` gives for its host.
    pub async fn start_with(n: usize, extra: impl Fn(&HostNet) -> Vec<String>) -> Self {
        vmnet_testkit::require_root();
        let fleet = Fleet::new(n).expect("fleet");
        let tmp = tempfile::tempdir().unwrap();
        let ifnames: Vec<String> = fleet
            .hosts()
            .iter()
            .map(|h| format!("{}wg", h.prefix))
            .collect();
        let guard = WgGuard(ifnames.clone());
        let mut nodes = Vec::new();
        for (h, ifname) in fleet.hosts().iter().zip(&ifnames) {
            let dir = tmp.path().join(&h.prefix);
            std::fs::create_dir_all(&dir).unwrap();
            let more = extra(h);
            let agent = options(h, ifname, mesh_of(h.index), &dir)
                .args(more.clone())
                .start(Duration::from_secs(30))
                .await
                .unwrap_or_else(|e| panic!("agent of {}: {e}", h.ns));
            let mut node = Node {
                host: h.clone(),
                agent: Some(agent),
                ifname: ifname.clone(),
                mesh: mesh_of(h.index),
                key: String::new(),
                dir,
                extra: more,
            };
            node.key = node.view().await.public_key;
            nodes.push(node);
        }
        Self {
            nodes,
            _wg: guard,
            fleet,
            _tmp: tmp,
        }
    }

    /// Syncs every node with all the others.
    pub async fn sync_all(&self) {
        for i in 0..self.nodes.len() {
            self.nodes[i]
                .sync(&body_for(&self.nodes, i))
                .await
                .unwrap_or_else(|e| panic!("sync of node {i}: {e}"));
        }
    }
}

/// Pings `to` from `from`'s host namespace until one answers (up to `wait`).
pub fn answers(from: &Node, to: Ipv6Addr, wait: Duration) -> bool {
    let deadline = Instant::now() + wait;
    loop {
        if let Ok(p) = traffic::ping(&from.host.ns, IpAddr::V6(to), 1, Duration::from_millis(500))
            && p.received == 1
        {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits until `cond` holds (polled every 100 ms) or `wait` passed.
pub async fn eventually<F, Fut>(wait: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + wait;
    loop {
        if cond().await {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `wg show <if> dump` lines (peers only), through the interface's UAPI socket.
pub fn wg_dump(ifname: &str) -> String {
    let out = std::process::Command::new("wg")
        .args(["show", ifname, "dump"])
        .output()
        .expect("wg");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .skip(1)
        .collect::<Vec<_>>()
        .join("\n")
}

/// The /128 routes into `ifname` in `ns` (iproute2 text, sorted), without the kernel's route
/// of the host's own address.
pub fn routes(ns: &str, ifname: &str) -> Vec<String> {
    let out =
        vmnet_testkit::netns::ip(ns, &["-6", "route", "show", "dev", ifname]).unwrap_or_default();
    let mut v: Vec<String> = out
        .lines()
        .filter(|l| !l.starts_with("fe80") && !l.contains("proto kernel"))
        .map(|l| l.split_whitespace().next().unwrap_or("").to_owned())
        .collect();
    v.sort();
    v
}
