//! `vmnet-lab bench wake`: what wake on packet saves a client, and what it costs an awake VM.
//!
//! Two throwaway sandboxes run side by side, each with the real agent (`vmnet serve`, packet
//! activity on) and one VM (a mesh address, `::/0` via host) whose guest is a namespace with a
//! tap of its own: one agent with wake on packet as it ships (`hold`), the other started with
//! `--wake-hold-secs 0` (`no hold`). The sandbox's frame relay stands in for the VMM: while it is
//! detached the VM sleeps (its tap has no carrier), attaching it wakes the VM.
//!
//! 1. **Connect to a sleeping VM**: `--connections` times per mode, alternately, a client in the
//!    sandbox's fake internet calls `connect()` to the guest's mesh address while the VM
//!    sleeps; the relay attaches `--attach-ms` after the call. The table shows the time from
//!    `connect()` to established (median, p90, max) and the SYN retransmissions the client made
//!    (`TCP_INFO` `tcpi_total_retrans`), and the agent's wake counters. Without the hold the
//!    first SYN is dropped and the client retransmits after its initial timeout (1 s on Linux).
//!    After each connection the echo is read to its end and the connection closed while
//!    attached (50 ms), the relay detached, and the VM left asleep for 150 ms (the agent hears
//!    the carrier go).
//! 2. **Awake cost** (`--rounds`, 0 to skip): both relays attached (again for each round),
//!    iperf3 downloads from each fake internet to its guest, alternately (each round starts
//!    with the mode the round before ended with), `--secs` each. The ratio of the medians, and
//!    the median of the rounds' ratios (robust to a drift of the host's load), is the cost of
//!    wake on packet on an awake VM (target ≥ 98 %). Both agents' activity programs run for
//!    every frame the host queues (one BTF tracepoint program per agent), so each measurement
//!    pays for the other agent's program alike: the only difference is the hold's check of the
//!    tap's queue in one of them.
//!
//! # Limitations
//! The guest is joined to the tap by a userspace relay, which bounds the throughput (not the
//! kernel path). The relay's attach is the VMM's open of the tap, not a VMM's start.
//!
//! # Cleanup
//! Each side's servers and relay stop first, then its agent (by pid, see
//! [`vmnet_sandbox::agent::AgentProc`]), its state directory and pin root, and its sandbox's
//! namespaces, also on an error.

mod report;

use std::fs::File;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use vmnet_agent::activity::VmActivity;
use vmnet_agent::status::VmView;
use vmnet_agent::wake::hold::Counters;
use vmnet_model::Error;
use vmnet_plan::ns::HOST_LINK_LOCAL;
use vmnet_sandbox::agent::{AgentOptions, AgentProc};
use vmnet_sandbox::echo::EchoService;
use vmnet_sandbox::guest::{self, GuestConfig, GuestRoute6};
use vmnet_sandbox::relay::Relay;
use vmnet_sandbox::tap::{self, Framing};
use vmnet_sandbox::{Sandbox, netns};

use crate::iperf::Server;
pub use report::{Connected, Mode, ModeResult, percentile, render_connect, render_iperf};

/// Arguments of `vmnet-lab bench wake`.
#[derive(Debug, clap::Args)]
pub struct WakeBenchArgs {
    /// Connections to the sleeping VM per mode.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=200))]
    pub connections: u32,
    /// How long after `connect()` the relay (the VMM) attaches, ms.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(0..=2000))]
    pub attach_ms: u64,
    /// iperf3 rounds through the awake VM per mode (0: skip the awake cost).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(0..=20))]
    pub rounds: u32,
    /// Seconds per iperf3 measurement (after one second of slow start).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=60))]
    pub secs: u32,
}

/// The VM's id in both agents.
const VM_ID: &str = "wake";
/// The guest's mesh address (each sandbox has its own fake internet and host).
const MESH: Ipv6Addr = Ipv6Addr::new(0xfdaa, 1, 0, 0, 0, 0, 0, 1);
/// The guest's echo port.
const ECHO_PORT: u16 = 7002;
/// The guest's iperf3 port.
const IPERF_PORT: u16 = 5201;
/// How long a client waits for established.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the relay stays attached after a connection was closed.
const LINGER: Duration = Duration::from_millis(50);
/// How long the VM stays asleep between two connections.
const ASLEEP: Duration = Duration::from_millis(150);

fn unavailable(what: &str) -> impl Fn(String) -> Error + '_ {
    move |e| Error::unavailable(format!("bench wake: {what}: {e}"))
}

/// A directory of the agent's own (store, socket, state, pin root), removed on drop after the
/// agent stopped.
struct Dir(PathBuf);

impl Dir {
    fn new(mode: Mode) -> Result<Self, Error> {
        let p = std::env::temp_dir().join(format!(
            "vmnet-bench-wake-{}-{}",
            std::process::id(),
            mode.tag()
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir(&p).map_err(|e| unavailable("state dir")(e.to_string()))?;
        Ok(Self(p))
    }

    fn pins(&self) -> PathBuf {
        self.0.join("bpf")
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = vmnet_kernel::activity::remove_root(&self.pins());
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One mode's sandbox, agent, VM and guest. Fields drop in order: the guest's servers and tap,
/// the agent, its directory, the sandbox.
struct Side {
    mode: Mode,
    _echo: EchoService,
    _iperf: Option<Server>,
    /// The guest's `eth0`, kept open: detaching the relay leaves the guest configured.
    eth0: File,
    guest_ns: String,
    vm_ns: String,
    vm_tap: String,
    agent: AgentProc,
    _dir: Dir,
    sb: Sandbox,
}

impl Side {
    async fn start(mode: Mode) -> Result<Self, Error> {
        let sb = Sandbox::new("bw").map_err(|e| unavailable("sandbox")(e.to_string()))?;
        let dir = Dir::new(mode)?;
        let agent = AgentOptions::new(sb.host(), sb.agent_prefix(), &dir.0)
            .arg("--activity-root")
            .arg(dir.pins())
            .args(mode.agent_args())
            .rust_log("warn")
            .start(Duration::from_secs(30))
            .await?;
        let body = serde_json::json!({
            "id": VM_ID,
            "user_id": 1,
            "tenant": 1,
            "mesh_ipv6": MESH.to_string(),
            "network": {"routes": [{"destination": "::/0", "via": "host"}]}
        });
        let view: VmView = agent
            .client()
            .put(&format!("/v1/vms/{VM_ID}"), &body)
            .await
            .map_err(|e| unavailable("PUT")(format!("{}; {}", e.message, agent.log_tail())))?;
        let sandbox = |what: &'static str| {
            move |e: vmnet_sandbox::SandboxError| unavailable(what)(e.to_string())
        };
        let guest_ns = sb.add_netns("g").map_err(sandbox("guest netns"))?;
        let eth0 = tap::create_tap(&guest_ns, guest::GUEST_IF, Framing::VirtioNet)
            .map_err(sandbox("guest tap"))?;
        let cfg = GuestConfig {
            mesh_ipv6: Some(MESH),
            routes_v6: vec![GuestRoute6 {
                destination: "::/0".into(),
                via: Some(HOST_LINK_LOCAL),
            }],
            ..GuestConfig::default()
        };
        guest::configure(&guest_ns, guest::GUEST_IF, &cfg).map_err(sandbox("guest"))?;
        let echo = EchoService::start(&guest_ns, &[SocketAddr::new(IpAddr::V6(MESH), ECHO_PORT)])
            .map_err(sandbox("guest echo"))?;
        eprintln!(
            "bench wake: {} in sandbox {} (agent pid {})",
            mode.name(),
            sb.prefix(),
            agent.pid()
        );
        Ok(Self {
            mode,
            _echo: echo,
            _iperf: None,
            eth0,
            guest_ns,
            vm_ns: view.status.netns.clone(),
            vm_tap: view.status.tap.clone(),
            agent,
            _dir: dir,
            sb,
        })
    }

    /// Attaches the relay: the VMM opens the VM's tap, the VM is awake.
    fn attach(&self) -> Result<Relay, Error> {
        let vm = tap::open_existing_tap_with(&self.vm_ns, &self.vm_tap, Framing::VirtioNet)
            .map_err(|e| unavailable("open the VM's tap")(e.to_string()))?;
        let g = self
            .eth0
            .try_clone()
            .map_err(|e| unavailable("guest tap")(e.to_string()))?;
        Relay::between(vm, g).map_err(|e| unavailable("relay")(e.to_string()))
    }

    /// The VM's wake counters (`None` without wake on packet).
    async fn counters(&self) -> Option<Counters> {
        let a: VmActivity = self
            .agent
            .client()
            .get(&format!("/v1/vms/{VM_ID}/activity"))
            .await
            .ok()?;
        a.wake
    }

    /// One connection to the sleeping VM, the relay attached `attach` after `connect()`; the
    /// relay is detached again once the echo was read.
    fn connect_sleeping(&self, attach: Duration) -> Result<Connected, Error> {
        let (tx, rx) = mpsc::channel();
        let to = SocketAddr::new(IpAddr::V6(MESH), ECHO_PORT);
        let client = netns::spawn_in(&self.sb.inet(), "wake-client", move || connect(to, &tx))
            .map_err(|e| unavailable("client")(e.to_string()))?;
        let started = rx
            .recv_timeout(Duration::from_secs(5))
            .map_err(|_| unavailable("client")("did not start".into()))?;
        std::thread::sleep(attach.saturating_sub(started.elapsed()));
        let relay = self.attach();
        let c = client
            .join()
            .map_err(|_| unavailable("client")("panicked".into()))?
            .map_err(|e| unavailable("client")(e.to_string()))?
            .map_err(unavailable("connect"));
        // The client's FIN and the guest's answer cross before the VMM goes.
        std::thread::sleep(LINGER);
        drop(relay?);
        std::thread::sleep(ASLEEP);
        c
    }
}

/// `connect()` to `to` (sending the time just before the call), `TCP_INFO` once established,
/// then one echo read to its end.
fn connect(to: SocketAddr, started: &mpsc::Sender<Instant>) -> Result<Connected, String> {
    let t = Instant::now();
    let _ = started.send(t);
    let mut s =
        TcpStream::connect_timeout(&to, CONNECT_TIMEOUT).map_err(|e| format!("{to}: {e}"))?;
    let took = t.elapsed();
    let retrans = vmnet_sandbox::traffic::retransmits(&s).map_err(|e| format!("TCP_INFO: {e}"))?;
    s.set_read_timeout(Some(CONNECT_TIMEOUT))
        .map_err(|e| e.to_string())?;
    s.write_all(b"wake\n").map_err(|e| format!("echo: {e}"))?;
    let mut out = Vec::new();
    let served = s.read_to_end(&mut out).is_ok() && !out.is_empty();
    Ok(Connected {
        took,
        retrans,
        served,
    })
}

/// Runs the command.
///
/// # Errors
/// `INVALID_INPUT` when not root; `UNAVAILABLE` when a sandbox, an agent, the guest, a
/// connection or iperf3 fails.
pub async fn run(args: WakeBenchArgs) -> Result<(), Error> {
    if !nix::unistd::geteuid().is_root() {
        return Err(Error::invalid(
            "vmnet-lab bench wake must run as root (it creates network namespaces and loads BPF)",
        ));
    }
    for root in vmnet_sandbox::sandbox::sweep_stale_pin_roots() {
        eprintln!(
            "removed {}, the pin root of a bench or test that was killed",
            root.display()
        );
    }
    let mut sides = Vec::new();
    for mode in [Mode::Hold, Mode::NoHold] {
        sides.push(Side::start(mode).await?);
    }
    let attach = Duration::from_millis(args.attach_ms);
    let mut results: Vec<ModeResult> = sides.iter().map(|s| ModeResult::new(s.mode)).collect();
    let before: Vec<Option<Counters>> = futures_counters(&sides).await;
    for _ in 0..args.connections {
        for (side, res) in sides.iter().zip(&mut results) {
            let c = tokio::task::block_in_place(|| side.connect_sleeping(attach))?;
            res.connections.push(c);
        }
    }
    let after = futures_counters(&sides).await;
    for ((res, b), a) in results.iter_mut().zip(before).zip(after) {
        res.counters = a.map(|a| delta(&a, &b.unwrap_or_default()));
    }
    print!("{}", render_connect(&results, args.attach_ms));
    if args.rounds > 0 {
        let rows = tokio::task::block_in_place(|| awake(&mut sides, args.rounds, args.secs))?;
        print!("{}", render_iperf(&rows, args.secs));
    }
    drop(sides);
    Ok(())
}

async fn futures_counters(sides: &[Side]) -> Vec<Option<Counters>> {
    let mut out = Vec::new();
    for s in sides {
        out.push(s.counters().await);
    }
    out
}

/// The counters that moved from `b` to `a` (`held_now` and `held_bytes` as they are).
fn delta(a: &Counters, b: &Counters) -> Counters {
    Counters {
        held_now: a.held_now,
        held_bytes: a.held_bytes,
        held: a.held - b.held,
        delivered: a.delivered - b.delivered,
        dropped_overflow: a.dropped_overflow - b.dropped_overflow,
        dropped_expired: a.dropped_expired - b.dropped_expired,
        dropped_too_big: a.dropped_too_big - b.dropped_too_big,
        dropped_send: a.dropped_send - b.dropped_send,
        wakes: a.wakes - b.wakes,
    }
}

/// The awake cost: both relays attached, `rounds` iperf3 downloads per mode, alternately. One
/// row per round: MiB/s per mode, in the order of `sides`.
fn awake(sides: &mut [Side], rounds: u32, secs: u32) -> Result<Vec<Vec<f64>>, Error> {
    for s in sides.iter_mut() {
        s._iperf = Some(Server::start(&s.guest_ns, MESH, IPERF_PORT)?);
    }
    let mut rows = Vec::new();
    for round in 0..rounds {
        // Relays (their threads) made again each round, so where the host runs them varies
        // from round to round instead of favouring one mode for the whole run.
        let relays = sides
            .iter()
            .map(Side::attach)
            .collect::<Result<Vec<_>, _>>()?;
        let mut row = vec![0.0; sides.len()];
        // Each round starts with the other mode than the round before.
        let mut order: Vec<usize> = (0..sides.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for i in order {
            let s = &sides[i];
            row[i] = crate::activity::download(&s.sb.inet(), &MESH.to_string(), IPERF_PORT, secs)?;
        }
        rows.push(row);
        drop(relays);
    }
    Ok(rows)
}
