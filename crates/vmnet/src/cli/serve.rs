//! `vmnet serve`: run the agent (HTTP API on a unix socket for root and `--socket-group`, the
//! reconcile loop) over the store, applying namespace mode through the netlink driver.
//!
//! With `--netns NAME` the whole process moves into that named network namespace on the main
//! thread *before* the tokio runtime starts ([`enter_netns`], called from `main`), so every
//! thread of the agent lives there; the agent never forks.
//!
//! With `--host-id H` the agent also runs pool mode for the instances the store places on host
//! `H` ([`vmnet_agent::pool::node`]): it starts the root helper for nftables (a child process
//! spoken to over a socketpair: `vmnet-pool-helper` next to this executable, or this executable
//! itself as `vmnet serve --pool-helper-serve`), loads the three bcd tables before touching any
//! tap, and from then on every reconcile pass and every instance change through the API
//! realises each placed instance's NIC (tap on `--bridge`, set elements) and writes its NoCloud
//! seed under `<state dir>/pool/seeds/<instance>/` (with a `cidata` image when `genisoimage` is
//! installed); instances that leave the host lose theirs.

mod handover;
mod helper;
mod lock;
mod ops;
mod preflight;
mod wake;
use helper::start_pool;
pub use preflight::{check_uplink, preflight};
use wake::start_wake;

use std::net::Ipv6Addr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use ipnet::Ipv4Net;
use vmnet_agent::agent::{Agent, DEFAULT_FIREWALL_AUDIT_SECS, DEFAULT_RECONCILE_INTERVAL_SECS};
use vmnet_agent::api::error::{from_ipam, from_ns, from_server};
use vmnet_agent::mesh::runtime::{Mesh, MeshSettings};
use vmnet_agent::pool::audit::AUDIT_PERIOD;
use vmnet_agent::pool::helper::HelperClient;
use vmnet_agent::pool::node::{PoolConfig, PoolNode};
use vmnet_agent::pool::seeds;
use vmnet_agent::pool::taps::KernelTaps;
use vmnet_agent::provider::poller::{Poller, PollerSettings};
use vmnet_agent::server;
use vmnet_ipam::Db;
use vmnet_kernel::ns::NetlinkNsDriver;
use vmnet_kernel::tap::TapOwner;
use vmnet_model::nic::IfName;
use vmnet_model::vm::metadata::MetadataVersion;
use vmnet_model::{Error, ValidationError};
use vmnet_plan::ns::NsSettings;

use crate::Global;

/// Arguments of this command.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Who may use the API, where credentials come from and go, the worker, deadlines.
    #[command(flatten)]
    pub trust: super::trust::TrustArgs,
    /// The configuration file: a TOML file whose keys are these flags without `--` (see
    /// configuration.md). A missing default file is no error; a missing named one is. Command
    /// line and environment override it.
    #[arg(long, env = crate::cli::config::CONFIG_ENV, value_name = "PATH",
          default_value = crate::cli::config::DEFAULT_PATH)]
    pub config: PathBuf,
    /// The log format on stderr: `text` (under systemd, with its stderr on the journal: each
    /// line goes to the journal with its fields as journal fields, without a timestamp) or
    /// `json` (one object per line, for log shippers).
    #[arg(long, value_enum, default_value_t = super::logs::LogFormat::Text)]
    pub log_format: super::logs::LogFormat,
    /// The prefix of every kernel object name (netns, links, nft tables): 1-10 bytes, a lowercase
    /// letter then lowercase letters or digits.
    #[arg(long, default_value = "vmn")]
    pub name_prefix: String,
    /// The transit range: VM user id N gets the /30 at offset 4·N (a /14 covers every user id).
    #[arg(long, default_value = "10.200.0.0/14")]
    pub transit_cidr: Ipv4Net,
    /// Owner of each VM's tap, the VMM's user: `UID` or `UID:GID`. Default: root only.
    #[arg(long, value_parser = parse_owner)]
    pub tap_owner: Option<(u32, Option<u32>)>,
    /// The uplink interface, where `--public-neighbors proxy` answers ARP/NDP for the VMs'
    /// public addresses.
    #[arg(long, value_name = "IFACE")]
    pub uplink: Option<String>,
    /// How the upstream reaches the VMs' public addresses: `routed` (the provider routes them to
    /// this host) or `proxy` (they are on the uplink's subnet; the host answers ARP/NDP for each
    /// on `--uplink`).
    #[arg(long, default_value = "routed", value_parser = parse_public_neighbors)]
    pub public_neighbors: vmnet_plan::ns::PublicNeighbors,
    /// Record packet activity (`GET /v1/activity`): load the activity BPF program with its maps
    /// pinned under this bpffs directory (e.g. `/sys/fs/bpf/vmnet`; a bpffs is mounted there if
    /// it is not on one). A restarted agent given the same directory keeps the recorded times.
    #[arg(long, value_name = "PATH")]
    pub activity_root: Option<PathBuf>,
    /// Wake on packet (with `--activity-root`): how long frames for a VM whose tap has no VMM
    /// are held for it, in seconds, to be delivered when its VMM attaches; 0 holds nothing.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(0..=300))]
    pub wake_hold_secs: u64,
    /// Wake on packet: the most frames held per VM (the oldest are dropped beyond it).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub wake_hold_frames: u64,
    /// Wake on packet: the most bytes held per VM (the oldest frames are dropped beyond it).
    #[arg(long, default_value_t = 262_144, value_parser = clap::value_parser!(u64).range(9216..=16_777_216))]
    pub wake_hold_bytes: u64,
    /// Wake on packet: the least time between two `vm_wake` events (and hook calls) of one VM,
    /// in milliseconds.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    pub wake_interval_ms: u64,
    /// Wake on packet: when held frames are delivered: `attach` (when the VMM opens the tap) or
    /// `first-frame` (when the guest first sends after that: for qemu restoring a saved state).
    #[arg(long, default_value = "attach", value_parser = ["attach", "first-frame"])]
    pub wake_deliver: String,
    /// Wake on packet: also post each `vm_wake` event (JSON, `POST /v1/wake` over HTTP/1.1) to
    /// this unix socket, at most one per VM per wake interval, waiting at most 1 s for its answer.
    #[arg(long, value_name = "PATH")]
    pub wake_hook_socket: Option<PathBuf>,
    /// Do not load the guest guard (the BPF program on each VM's tap that drops what a guest
    /// may not send: spoofed sources, another VM's mesh address, forged ARP, router
    /// advertisements). Only for kernels that cannot load it (it needs BTF and
    /// CAP_PERFMON): without the guard a guest can send with any source.
    #[arg(long)]
    pub no_guest_guard: bool,
    /// Seconds between periodic reconcile passes (an API change applies its VM itself and does not trigger one).
    #[arg(long, default_value_t = DEFAULT_RECONCILE_INTERVAL_SECS, value_parser = clap::value_parser!(u64).range(1..=86400))]
    pub reconcile_interval_secs: u64,
    /// Seconds between firewall audits: each VM's filter table compared with its plan by
    /// content and replaced when changed (a full reconcile pass compares it too).
    #[arg(long, default_value_t = DEFAULT_FIREWALL_AUDIT_SECS, value_parser = clap::value_parser!(u64).range(1..=86400))]
    pub firewall_audit_secs: u64,
    /// Run inside this named network namespace (`/run/netns/NAME`): the namespace is the
    /// agent's host namespace. Entered on the main thread before any other thread starts.
    #[arg(long)]
    pub netns: Option<String>,
    /// Pool mode: this host's id in the store. The agent realises the NICs (taps on --bridge,
    /// bcd nftables elements) and NoCloud seeds of every instance placed on this host, and
    /// removes them when the instance leaves. Without it, pool mode is off.
    #[arg(long, value_name = "HOST_ID")]
    pub host_id: Option<String>,
    /// Pool mode: the bridge instance taps join. It must exist unless --create-bridge is given,
    /// and must not start with "bc".
    #[arg(long, default_value = vmnet_model::nic::DEFAULT_BRIDGE, requires = "host_id")]
    pub bridge: String,
    /// Pool mode: create --bridge (up, no address) when it does not exist. For sandboxes; a real
    /// host's bridge exists already.
    #[arg(long, requires = "host_id")]
    pub create_bridge: bool,

    /// Pool mode: do not load the tap guard (the BPF filters on each tap that keep guests
    /// filtered while the nft tables are missing). Only for kernels without BPF: without the
    /// guard a flushed ruleset leaves guests unfiltered until the next audit (up to 5 s).
    #[arg(long, requires = "host_id")]
    pub no_tap_guard: bool,
    /// Pool mode: the root helper executable. Default: `vmnet-pool-helper` next to this
    /// executable, or this executable itself (`vmnet serve --pool-helper-serve`).
    #[arg(long, value_name = "PATH", requires = "host_id")]
    pub pool_helper: Option<PathBuf>,
    /// Run the mesh's WireGuard interface: `wireguard-go` started and supervised by the agent,
    /// the peers of `POST /v1/sync` applied to it with one /128 route each. The host key pair
    /// is made on first start in --state-dir (`wireguard.key`, mode 0600).
    #[arg(long)]
    pub mesh: bool,
    /// Mesh: the WireGuard interface name (unique on the machine).
    #[arg(long, default_value = "wg0", requires = "mesh")]
    pub wg_interface: String,
    /// Mesh: the listen port.
    #[arg(long, default_value_t = vmnet_agent::mesh::runtime::DEFAULT_PORT, requires = "mesh")]
    pub wg_port: u16,
    /// Mesh: this host's mesh address (in fdaa::/16, given by the control plane, never
    /// calculated); put on the interface as a /128.
    #[arg(long, requires = "mesh")]
    pub mesh_address: Option<Ipv6Addr>,
    /// Mesh: the private network's MTU. The interface MTU is this minus 80 with IPv6 endpoints
    /// (60 with IPv4 only). Default: the MTU of the link that routes to the peers' endpoints.
    #[arg(long, requires = "mesh", value_parser = clap::value_parser!(u32).range(1360..=65535))]
    pub private_mtu: Option<u32>,
    /// Mesh: the `wireguard-go` executable.
    #[arg(long, default_value = "wireguard-go", requires = "mesh")]
    pub wireguard_go: PathBuf,
    /// Mesh: the receive and send buffer size, in bytes, the agent gives `wireguard-go`'s UDP
    /// sockets (`SO_RCVBUFFORCE`/`SO_SNDBUFFORCE` on each socket of that process, nothing else
    /// in the namespace); 0 leaves them as `wireguard-go` sets them.
    #[arg(long, value_name = "BYTES", requires = "mesh",
          default_value_t = vmnet_kernel::wg::sockbuf::DEFAULT_BYTES,
          value_parser = clap::value_parser!(u32).range(0..=1 << 30))]
    pub wg_socket_buffer_bytes: u32,
    /// Mesh: run the BPF data plane (encapsulation on wg0, tenant checks, the whitelist) with
    /// its maps pinned in this directory, which must be on a mounted bpffs (e.g.
    /// `/sys/fs/bpf/vmnet`). Without it the mesh carries host traffic only.
    #[arg(long, value_name = "DIR", requires = "mesh")]
    pub mesh_bpf_root: Option<PathBuf>,
    /// Mesh: the store of the fleet's VM registrations, `postgres://…` shared by the fleet's
    /// agents (each writes only its own rows; changes arrive by `LISTEN`/`NOTIFY`). Default:
    /// this agent's own database (with SQLite, every VM is local). Registrations need
    /// `--mesh-bpf-root` and `--mesh-address`.
    #[arg(long, value_name = "URL", requires = "mesh")]
    pub mesh_registry: Option<String>,
    /// Poll every provider pool in the store (Hetzner Cloud, Proxmox VE) at its interval and
    /// replace its machines' addresses; the pools' states show in `vmnet status`. Run it on one
    /// agent per store.
    #[arg(long)]
    pub poll_providers: bool,
    /// The metadata service's version for VMs whose config names none (`metadata.version`):
    /// `v2` (every GET needs a session token from `PUT /latest/api/token`) or `v1` (GETs
    /// without a token are answered too).
    #[arg(long, default_value = "v2", value_parser = parse_metadata_version)]
    pub metadata_version: MetadataVersion,
    /// Do not serve the metadata service (169.254.169.254 inside each VM's netns).
    #[arg(long)]
    pub no_metadata: bool,
    /// Serve `GET /metrics` (Prometheus text format), `GET /healthz` and `GET /readyz` on this
    /// TCP address too (e.g. `127.0.0.1:9851`), for a Prometheus server and health probes;
    /// nothing else is served there. Default: on the API socket only.
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Internal: serve as the pool root helper on descriptor 3 (started by the agent).
    #[arg(long, hide = true)]
    pub pool_helper_serve: bool,
}

fn parse_owner(s: &str) -> Result<(u32, Option<u32>), String> {
    let (u, g) = match s.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (s, None),
    };
    let uid = u
        .parse::<u32>()
        .map_err(|_| format!("{s:?}: expected UID or UID:GID (numbers)"))?;
    let gid = g
        .map(|g| {
            g.parse::<u32>()
                .map_err(|_| format!("{s:?}: GID must be a number"))
        })
        .transpose()?;
    Ok((uid, gid))
}

/// Moves the calling (main) thread into `--netns`, if given. Call before the runtime starts.
///
/// With the internal `--pool-helper-serve` this process is the pool root helper instead: it
/// serves the agent on descriptor 3 on this (single) thread, in the namespace it inherited from
/// the agent, and exits when the agent closes the socket; it never returns then. With the
/// internal `--worker-serve` it is the unprivileged worker ([`super::trust::worker_entry`]).
///
/// # Errors
/// `INVALID_INPUT` when the namespace does not exist or cannot be entered.
pub fn enter_netns(args: &ServeArgs) -> Result<(), Error> {
    super::trust::worker_entry(&args.trust, args.log_format);
    if args.pool_helper_serve {
        let code = match vmnet_agent::pool::helper::main_from_fd(None) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("vmnet pool helper: {e}");
                1
            }
        };
        std::process::exit(code);
    }
    match &args.netns {
        Some(name) => vmnet_kernel::netns::enter_current_thread(name)
            .map_err(|e| Error::invalid(format!("--netns: {}", chain(&e)))),
        None => Ok(()),
    }
}

fn parse_metadata_version(s: &str) -> Result<MetadataVersion, String> {
    s.parse()
}

fn parse_public_neighbors(s: &str) -> Result<vmnet_plan::ns::PublicNeighbors, String> {
    s.parse()
}

impl ServeArgs {
    /// The namespace-mode settings these flags describe.
    ///
    /// # Errors
    /// `INVALID_INPUT` naming the flag.
    pub fn settings(&self) -> Result<NsSettings, Error> {
        let s = NsSettings {
            name_prefix: self.name_prefix.clone(),
            transit_ipv4: self.transit_cidr,
            tap_owner_uid: self.tap_owner.map(|(u, _)| u),
            tap_owner_gid: self.tap_owner.and_then(|(_, g)| g),
            uplink: self.uplink.clone(),
            public_neighbors: self.public_neighbors,
            activity: self.activity_root.is_some(),
            guard: !self.no_guest_guard,
            ..NsSettings::default()
        };
        s.validate()?;
        Ok(s)
    }
}

/// Runs the command until SIGTERM or SIGINT; returns once the server, the loops and the store
/// are closed (`main` logs "vmnet agent stopped" after the runtime's threads ended).
pub async fn run(g: &Global, args: ServeArgs) -> Result<(), Error> {
    super::logs::init(args.log_format);
    let preflight::Checked {
        settings,
        access,
        rules,
    } = preflight(g, &args)?;
    preflight::check_uplink(settings.uplink.as_deref())?;
    // The locks and the socket first: a second agent on the same state directory, prefix (in
    // this namespace) or socket is refused before it touches anything (the trial saw a refused
    // agent replace the pinned activity program first). Held until this function returns.
    let _locks = (
        lock::state_dir(&g.state_dir)?,
        lock::prefix(
            std::path::Path::new(lock::PREFIX_LOCK_DIR),
            &settings.name_prefix,
            args.netns.as_deref(),
        )?,
    );
    let unix = server::bind_unix(&g.socket, access)
        .await
        .map_err(from_server)?;
    let db = Db::connect(&g.database_url()).await.map_err(from_ipam)?;
    super::trust::protect_store(&g.database_url());
    let mut driver = NetlinkNsDriver::new(settings.clone(), None).map_err(|e| from_ns(&e))?;
    let recorder = match &args.activity_root {
        Some(root) => {
            let rec = vmnet_kernel::activity::ActivityRecorder::open(root).map_err(|e| {
                Error::unavailable(format!("--activity-root {}: {}", root.display(), chain(&e)))
            })?;
            tracing::info!(root = %root.display(), program = rec.program_id(), "packet activity on");
            let rec = Arc::new(rec);
            driver = driver.with_activity(Arc::clone(&rec));
            Some(rec)
        }
        None => None,
    };
    if args.no_guest_guard {
        tracing::warn!(
            "guest guard off (--no-guest-guard): guests can send with any source address"
        );
    } else {
        let guard = vmnet_kernel::guard::GuestGuard::load().map_err(|e| {
            Error::unavailable(format!(
                "guest guard: {} (--no-guest-guard runs without it)",
                chain(&e)
            ))
        })?;
        tracing::info!(program = guard.program_id(), "guest guard on");
        driver = driver.with_guard(Arc::new(guard));
    }
    let events = match driver.watch_kernel() {
        Ok(e) => Some(e),
        Err(e) => {
            tracing::warn!(
                "kernel change notifications off: {}; drift waits for the next pass",
                chain(&e)
            );
            None
        }
    };
    handover::take(&driver, &g.state_dir);
    let driver = Arc::new(driver);
    let agent = Agent::new(
        db,
        Arc::clone(&driver) as _,
        settings,
        Duration::from_secs(args.reconcile_interval_secs),
    )?;
    let wake = match recorder {
        Some(rec) => {
            let wake = start_wake(&args, &agent, &rec)?;
            agent.set_activity(rec)?;
            wake
        }
        None => None,
    };
    agent.set_firewall_audit_period(Duration::from_secs(args.firewall_audit_secs));
    agent.set_kernel_deadline(super::trust::kernel_deadline(&args.trust));
    agent.set_provider_rules(rules.clone());
    let poller_settings = PollerSettings::default();
    let worker = if args.no_metadata && !args.poll_providers {
        None
    } else {
        let w = super::trust::start_worker(
            &args.trust,
            args.log_format,
            &agent,
            poller_settings.http.clone(),
        )
        .await?;
        let st = w.status();
        tracing::info!(pid = ?st.pid, user = %st.user, uid = st.uid, "worker on (metadata service, provider polls)");
        Some(w)
    };
    if !args.no_metadata
        && let Some(w) = &worker
    {
        agent.set_metadata(vmnet_agent::metadata::MetadataService::new(
            args.metadata_version,
            Arc::clone(w),
        ))?;
    }
    tracing::info!(
        socket = %g.socket.display(),
        socket_group = ?access.group,
        netns = ?args.netns,
        prefix = %agent.settings().name_prefix,
        "vmnet agent listening"
    );
    if let Some(host_id) = &args.host_id {
        let node = start_pool(g, &args, host_id, &agent).await?;
        tracing::info!(host = %host_id, bridge = %node.config().bridge, "pool mode on");
        agent.set_pool(node)?;
    }
    let watch = if args.mesh {
        Some(start_mesh(g, &args, &agent).await?)
    } else {
        None
    };
    let poller = if args.poll_providers
        && let Some(w) = &worker
    {
        let fetcher: Arc<dyn vmnet_agent::provider::fetch::Fetcher> = Arc::clone(w) as _;
        let p = Poller::new(agent.db().clone(), poller_settings, fetcher, rules);
        agent.set_providers(Arc::clone(&p))?;
        tracing::info!("provider poller on");
        Some(tokio::spawn(p.run()))
    } else {
        None
    };
    let metrics = ops::bind_metrics(args.metrics_listen).await?;
    let reconciler = tokio::spawn(Arc::clone(&agent).run_loop());
    let watcher = events.map(|e| agent.start_watching(e));
    let wake =
        wake.map(|(w, reader)| tokio::spawn(vmnet_agent::wake::run(Arc::clone(&agent), w, reader)));
    let summaries = tokio::spawn(Arc::clone(&agent).run_spoof_summaries(
        std::time::Duration::from_secs(vmnet_agent::events::spoof::SPOOF_SUMMARY_SECS),
    ));
    let ops = ops::start(&agent, metrics);
    let router = vmnet_agent::api::router(Arc::clone(&agent));
    // Stopping ends the event streams, so their requests do not hold the shutdown up.
    let bus = agent.events().clone();
    let shutdown = async move {
        ops::shutdown().await;
        bus.close();
    };
    let result = server::serve(router, unix, shutdown).await;
    summaries.abort();
    if let Some(w) = wake {
        w.abort();
    }
    ops.stop();
    if let Some(w) = watcher {
        agent.stop_loop(w).await;
    }
    agent.stop_loop(reconciler).await;
    handover::save(&driver, &g.state_dir);
    // wireguard-go keeps running: a restarted agent adopts it without interrupting tunnels.
    for w in watch.into_iter().flatten() {
        w.abort();
    }
    if let Some(p) = poller {
        p.abort();
    }
    // The store last: its connections close (SQLite checkpoints and removes its WAL), so
    // nothing of the agent is still writing when `main` logs that it stopped.
    agent.db().close().await;
    result.map_err(from_server)
}

/// Starts the mesh: the device configured from the record, then the watch task that restarts
/// it when it dies and, with registrations, the task listening for the fleet's changes.
async fn start_mesh(
    g: &Global,
    args: &ServeArgs,
    agent: &Arc<Agent>,
) -> Result<Vec<tokio::task::JoinHandle<()>>, Error> {
    let mesh = Mesh::new(MeshSettings {
        ifname: args.wg_interface.clone(),
        listen_port: args.wg_port,
        mesh_address: args.mesh_address,
        private_mtu: args.private_mtu,
        state_dir: g.state_dir.clone(),
        wireguard_go: args.wireguard_go.clone(),
        socket_buffer_bytes: Some(args.wg_socket_buffer_bytes).filter(|b| *b > 0),
        bpf_root: args.mesh_bpf_root.clone(),
    })?;
    let repaired = mesh.converge(agent.db()).await?;
    tracing::info!(interface = %args.wg_interface, public_key = %mesh.public_key(), ?repaired, "mesh on");
    let mut tasks = Vec::new();
    if let Some((l, _)) = mesh.located() {
        let registry = match &args.mesh_registry {
            Some(url) => match connect_registry(url).await {
                Ok(db) => Some(db),
                // Unreachable: start all the same (forwarding goes on with what the kernel
                // kept) and keep connecting; the listener starts once connected.
                Err(e) if e.retryable => {
                    tracing::warn!(
                        "--mesh-registry: {}; starting without it and connecting again every {:?}",
                        e.message,
                        vmnet_agent::mesh::registry::LISTEN_RETRY
                    );
                    l.await_registry();
                    None
                }
                Err(e) => return Err(Error::invalid(format!("--mesh-registry: {}", e.message))),
            },
            None => Some(agent.db().clone()),
        };
        if let Some(db) = registry {
            l.set_registry(db);
            tasks.push(tokio::spawn(Arc::clone(&mesh).listen()));
        } else if let Some(url) = args.mesh_registry.clone() {
            let mesh = Arc::clone(&mesh);
            tasks.push(tokio::spawn(async move {
                let db = keep_connecting(&url).await;
                if let Some((l, _)) = mesh.located() {
                    l.set_registry(db);
                    tracing::info!("--mesh-registry: connected");
                }
                mesh.listen().await;
            }));
        }
    } else if args.mesh_registry.is_some() {
        return Err(Error::invalid(
            "--mesh-registry needs --mesh-bpf-root and --mesh-address (registrations feed the data plane)",
        ));
    }
    agent.set_mesh(Arc::clone(&mesh))?;
    tasks.push(tokio::spawn(mesh.watch(agent.db().clone())));
    Ok(tasks)
}

/// How long a registration request waits for the shared store before it fails: an apply that
/// registers a VM during a store outage waits at most this long (and later ones not at all,
/// see `Locations`), instead of sqlx's default 30 s.
const REGISTRY_ACQUIRE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// Why the registration store could not be opened, and whether trying again can help (the
/// server unreachable or not ready) or not (a malformed URL or an unknown scheme).
struct RegistryError {
    message: String,
    retryable: bool,
}

async fn connect_registry(url: &str) -> Result<Db, RegistryError> {
    Db::connect_timeout(url, None, REGISTRY_ACQUIRE_TIMEOUT)
        .await
        .map_err(|e| RegistryError {
            retryable: matches!(
                e,
                vmnet_ipam::IpamError::Connect(_) | vmnet_ipam::IpamError::Migrate(_)
            ),
            message: vmnet_model::error::chain(&e),
        })
}

/// Connects to the registration store, trying again every `LISTEN_RETRY` until it answers
/// (a warning each minute while it does not).
async fn keep_connecting(url: &str) -> Db {
    let started = std::time::Instant::now();
    let mut warned = started;
    loop {
        tokio::time::sleep(vmnet_agent::mesh::registry::LISTEN_RETRY).await;
        match connect_registry(url).await {
            Ok(db) => return db,
            Err(e) if warned.elapsed() >= std::time::Duration::from_secs(60) => {
                warned = std::time::Instant::now();
                tracing::warn!(
                    "--mesh-registry: still unreachable after {:?}: {}",
                    started.elapsed(),
                    e.message
                );
            }
            Err(_) => {}
        }
    }
}

/// An error with its causes, `: `-joined.
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cur = c.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tap_owner_forms() {
        assert_eq!(parse_owner("1000").unwrap(), (1000, None));
        assert_eq!(parse_owner("1000:100").unwrap(), (1000, Some(100)));
        assert!(parse_owner("kvm").is_err());
    }
}
