//! `vmnet-lab bench mesh`: `POST /v1/sync` against the real agent (`vmnet serve --mesh`, with
//! `wireguard-go`) on one throwaway fleet host: a sync of N peers (default 1,000) from empty, a
//! sync changing one peer among N, and a no-op sync, each timed at the client from sending an
//! encoded body to the decoded answer (HTTP over the unix socket, validation, plan, record, UAPI,
//! routes).
//!
//! Every run checks the agent's answer: from empty, N peers and N routes added; one change, one
//! peer updated and nothing else rewritten (0 added, 0 removed, at most one route changed); a
//! no-op, nothing at all. The peers' endpoints are unused addresses on the fleet's private
//! network (`fd00:10::1:…`), so handshake attempts stay inside the fleet's namespaces.
//!
//! `VMNET_BENCH_AGENT_LOG=<filter>` runs the agent with that log filter and prints its log (e.g.
//! `warn,vmnet_agent::mesh=debug` shows the phases of each sync).
//!
//! # Cleanup
//! The agent is stopped by its guard; the `wireguard-go` it started is killed by the pid serving
//! the interface's UAPI socket (checked to be `wireguard-go`) and its socket removed; the fleet
//! guard deletes every namespace; the state directory is removed.

use std::fmt::Write as _;
use std::net::Ipv6Addr;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use vmnet_agent::mesh::view::SyncOutcome;
use vmnet_kernel::wg::uapi::Uapi;
use vmnet_model::Error;
use vmnet_sandbox::Fleet;
use vmnet_sandbox::agent::AgentOptions;

use crate::vms::stats;

/// Arguments of this command.
#[derive(Debug, clap::Args)]
pub struct MeshBenchArgs {
    /// Peers in the set.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=10000))]
    pub peers: u32,
    /// Timed runs of each case.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub runs: u32,
    /// What to measure: the syncs, the data plane's forwarding throughput, or both.
    #[arg(long, value_enum, default_value_t = Case::All)]
    pub case: Case,
    /// Forwarding: seconds per iperf3 run.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=60))]
    pub secs: u32,
    /// Forwarding: the size of `wireguard-go`'s UDP socket buffers in the second half (the
    /// first half leaves them as `wireguard-go` sets them), as `vmnet serve
    /// --wg-socket-buffer-bytes`.
    #[arg(long, value_name = "BYTES", default_value_t = vmnet_kernel::wg::sockbuf::DEFAULT_BYTES,
          value_parser = clap::value_parser!(u32).range(1..=1 << 30))]
    pub wg_socket_buffer_bytes: u32,
    /// Propagation: registrations in the store on each of two other hosts.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=20000))]
    pub vms: u32,
}

/// `vmnet-lab bench mesh --case`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Case {
    /// `POST /v1/sync` of N peers.
    Sync,
    /// TCP VM to VM across hosts against host to host ([`crate::mesh_forward`]).
    Forwarding,
    /// A VM registration reaching another host ([`crate::mesh_propagation`]).
    Propagation,
    /// All three.
    All,
}

/// The sync goals of the issue, in milliseconds: from empty, one change, no-op.
pub const GOALS_MS: [f64; 3] = [200.0, 5.0, 5.0];

/// Kills the `wireguard-go` of `ifname` and removes its socket on drop.
struct WgGuard(String);

impl Drop for WgGuard {
    fn drop(&mut self) {
        let u = Uapi::new(&self.0);
        if let Ok(pid) = u.server_pid() {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            if comm.trim() == "wireguard-go"
                && let Ok(p) = i32::try_from(pid)
            {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(p),
                    nix::sys::signal::Signal::SIGKILL,
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        if u.server_pid().is_err() {
            let _ = std::fs::remove_file(u.path());
        }
    }
}

/// Peer `i` of the set; `variant` changes its endpoint port (a change of one peer).
#[must_use]
pub fn peer(i: u32, variant: u16) -> Value {
    let mut k = [0x42u8; 32];
    k[..4].copy_from_slice(&i.to_be_bytes());
    let hi = u16::try_from(i >> 16).unwrap_or(0);
    let lo = u16::try_from(i & 0xffff).unwrap_or(0);
    json!({
        "public_key": base64_key(&k),
        "endpoint": format!("[{}]:{}", Ipv6Addr::new(0xfd00, 0x10, 0, 0, 0, 1, hi, lo), 51820 + variant),
        "mesh_address": Ipv6Addr::new(0xfdaa, 0x100, 0, 0, 0, 0, hi, lo + 2).to_string(),
    })
}

fn base64_key(k: &[u8; 32]) -> String {
    vmnet_agent::mesh::body::WgKey(*k).to_string()
}

fn encode(v: &Value) -> Result<Vec<u8>, Error> {
    serde_json::to_vec(v).map_err(|e| Error::internal(format!("bench mesh: encode: {e}")))
}

fn fail(what: &str, o: &SyncOutcome) -> Error {
    Error::internal(format!("bench mesh: {what}: unexpected outcome {o:?}"))
}

/// Runs the bench and prints its table.
///
/// # Errors
/// `UNAVAILABLE` when the fleet or the agent cannot start; `INTERNAL` when an answer is not
/// what the case must produce.
pub async fn run(a: MeshBenchArgs) -> Result<(), Error> {
    if matches!(a.case, Case::Propagation | Case::All) {
        print!("{}", crate::mesh_propagation::run(a.vms, a.runs).await?);
        if a.case == Case::Propagation {
            return Ok(());
        }
    }
    if a.case != Case::Sync {
        let (runs, secs, bytes) = (a.runs, a.secs, a.wg_socket_buffer_bytes);
        let table =
            tokio::task::spawn_blocking(move || crate::mesh_forward::run(runs, secs, bytes))
                .await
                .map_err(|e| Error::internal(format!("bench mesh forwarding: {e}")))??;
        print!("{table}");
        if a.case == Case::Forwarding {
            return Ok(());
        }
    }
    let fleet = Fleet::new(1).map_err(|e| Error::unavailable(format!("bench mesh: fleet: {e}")))?;
    let host = fleet.hosts()[0].clone();
    let ifname = format!("{}wg", host.prefix);
    let _wg = WgGuard(ifname.clone());
    let dir = tempfile_dir()?;
    let exe = vmnet_sandbox::exe::vmnet()?;
    let agent = AgentOptions::new(&host.ns, &host.prefix, dir.path())
        .exe(exe)
        .rust_log(std::env::var("VMNET_BENCH_AGENT_LOG").unwrap_or_else(|_| "warn".to_owned()))
        .args([
            "--mesh",
            "--wg-interface",
            ifname.as_str(),
            "--mesh-address",
            "fdaa::1",
        ])
        .start(Duration::from_secs(30))
        .await?;
    let c = agent.client();
    let n = a.peers;
    let set = |changed: Option<u16>| {
        let peers: Vec<Value> = (0..n)
            .map(|i| peer(i, if i == n / 2 { changed.unwrap_or(0) } else { 0 }))
            .collect();
        json!({"peers": peers, "whitelist": ["fdaa:100::/32"]})
    };
    let empty = json!({"peers": []});
    let full = encode(&set(None))?;
    // The bodies are encoded before the clock starts: the time is the agent's (HTTP over the
    // unix socket, validation, plan, record, UAPI, routes) and the answer's decoding.
    let post = |body: Vec<u8>| async move {
        let (status, bytes) = c
            .send_raw(hyper::Method::POST, "/v1/sync", Some(body))
            .await?;
        if !status.is_success() {
            return Err(Error::internal(format!(
                "bench mesh: sync answered {status}: {}",
                String::from_utf8_lossy(&bytes)
            )));
        }
        serde_json::from_slice::<SyncOutcome>(&bytes)
            .map_err(|e| Error::internal(format!("bench mesh: sync answer: {e}")))
    };
    let mut times: [Vec<Duration>; 3] = Default::default();
    for run in 0..a.runs {
        let o: SyncOutcome = c.post("/v1/sync", Some(&empty)).await?;
        if o.peers != 0 {
            return Err(fail("emptying", &o));
        }
        let body = full.clone();
        let t = Instant::now();
        let o = post(body).await?;
        times[0].push(t.elapsed());
        let n = usize::try_from(n).unwrap_or(0);
        if (o.added, o.routes_added, o.updated, o.removed) != (n, n, 0, 0) {
            return Err(fail("from empty", &o));
        }
        for k in 0..a.runs {
            // Alternate between two endpoints of the middle peer, so each sync changes it.
            let variant = u16::try_from(1 + (run * a.runs + k) % 2).unwrap_or(1);
            let body = encode(&set(Some(variant)))?;
            let again = body.clone();
            let t = Instant::now();
            let o = post(body).await?;
            times[1].push(t.elapsed());
            if (
                o.updated,
                o.added,
                o.removed,
                o.routes_added,
                o.routes_removed,
            ) != (1, 0, 0, 0, 0)
            {
                return Err(fail("one change", &o));
            }
            let t = Instant::now();
            let o = post(again).await?;
            times[2].push(t.elapsed());
            if (
                o.updated,
                o.added,
                o.removed,
                o.routes_added,
                o.routes_removed,
            ) != (0, 0, 0, 0, 0)
            {
                return Err(fail("no-op", &o));
            }
        }
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "POST /v1/sync, {n} peers, wireguard-go, round trip of an encoded body ({} runs from empty, {} of the others)",
        a.runs,
        a.runs * a.runs
    );
    let _ = writeln!(
        out,
        "{:<34} {:>10} {:>10} {:>10} {:>8}",
        "case", "median ms", "p99 ms", "goal ms", "met"
    );
    let names = [
        format!("{n} peers from empty"),
        format!("one peer changed among {n}"),
        format!("no-op ({n} peers)"),
    ];
    for ((name, t), goal) in names.iter().zip(&times).zip(GOALS_MS) {
        let s = stats(t);
        let _ = writeln!(
            out,
            "{name:<34} {:>10.2} {:>10.2} {goal:>10.0} {:>8}",
            s.median,
            s.p99,
            if s.median <= goal { "yes" } else { "NO" }
        );
    }
    print!("{out}");
    if std::env::var_os("VMNET_BENCH_AGENT_LOG").is_some() {
        eprint!("{}", agent.log_text());
    }
    drop(agent);
    Ok(())
}

/// A state directory removed on drop.
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tempfile_dir() -> Result<TempDir, Error> {
    let d = std::env::temp_dir().join(format!("vmnet-bench-mesh.{}", std::process::id()));
    std::fs::create_dir_all(&d)
        .map_err(|e| Error::unavailable(format!("bench mesh: state directory: {e}")))?;
    Ok(TempDir(d))
}
