//! `vmnet up --sandbox` / `vmnet down --sandbox`: the main job in throwaway namespaces.
//!
//! `up` builds, on any Linux machine and as root, everything a real host would have, without
//! touching the machine's own network:
//!
//! 1. a sandbox host namespace `<name>host` with an uplink veth to a fake internet namespace
//!    `<name>inet` (203.0.113.0/24, 2001:db8:0:1::/64) running a TCP/UDP echo service at
//!    198.51.100.10 and 2001:db8:100::10, port 7 ([`crate::sandbox`]);
//! 2. the agent (`vmnet serve --netns <name>host`, which enters the namespace on its main thread
//!    before its runtime starts, staying in the host's mount namespace) with its own socket,
//!    state directory and name prefix `<name>` (so every VM namespace it makes is `<name>n<uid>`);
//! 3. the host spec (default `examples/host.json`) applied through the agent's API, as
//!    `vmnet apply` does, waiting until every VM is applied;
//! 4. per VM a simulated guest `<name>g<uid>` whose `eth0` (guest MAC, 172.16.0.2/30, MTU 1380,
//!    the mesh /128) is joined to the VM's tap by a relay process that opens the tap as a VMM does;
//! 5. the checks of [`sandbox_checks`](self::checks), and two tables: the VMs and the checks.
//!
//! The exit status is non-zero when any check saw something other than what it expected. The
//! sandbox stays up either way (the agent, echo service and relays keep running in the
//! background, their pids recorded in `/run/vmnet-sandbox/<name>/sandbox.json`); `vmnet down
//! --sandbox` stops them by pid, deletes the sandbox's namespaces (`<name>` followed by `host`,
//! `inet`, `x-…` or a kind letter and four hex digits: never those of a sandbox whose name merely
//! starts with `<name>`) and the state directory. `up` prints the agent's socket and a
//! ready-to-copy `VMNET_SOCKET=… vmnet status`.
//!
//! `up` when the sandbox exists already, or when an existing sandbox's name is a prefix of
//! `<name>` or starts with it, is refused with `CONFLICT` (run `down` first); a failure while
//! building it removes what was built.

pub mod checks;

use std::net::Ipv6Addr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::guest::{GuestConfig, GuestRoute6};
use crate::{netns, sandbox};
use serde::Serialize;
use vmnet_agent::api::types::{VmState, VmView};
use vmnet_agent::client::{Client, segment};
use vmnet_agent::hostspec::HostSpec;
use vmnet_model::vm::Via;
use vmnet_model::{Error, ErrorCode};

use self::checks::{CheckResult, GUEST_GW_V6, GuestInfo};
use crate::state::{self, Paths, Proc, SandboxState};

/// The default sandbox name (and name prefix).
pub const DEFAULT_NAME: &str = "vmsbx";
/// Where sandbox state directories live.
pub const DEFAULT_ROOT: &str = "/run/vmnet-sandbox";

/// Arguments of `vmnet up`.
#[derive(Debug, clap::Args)]
pub struct UpArgs {
    /// Run in a sandbox: throwaway namespaces, a fake internet, simulated guests (required; no
    /// other mode exists).
    #[arg(long)]
    pub sandbox: bool,
    /// The host spec to apply (the default falls back to the built-in copy of
    /// `examples/host.json` when run outside the repository).
    #[arg(default_value = DEFAULT_HOST_SPEC)]
    pub host_spec: PathBuf,
    /// The sandbox name: the name prefix of every namespace and link in it (lowercase letters
    /// and digits, a letter first, at most 10 bytes).
    #[arg(long, default_value = DEFAULT_NAME)]
    pub name: String,
    /// Where the sandbox's state directory is made.
    #[arg(long, default_value = DEFAULT_ROOT)]
    pub root: PathBuf,
    /// How long to wait for the agent and for the VMs to be applied, seconds.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub timeout_secs: u64,
}

/// Arguments of `vmnet down`.
#[derive(Debug, clap::Args)]
pub struct DownArgs {
    /// Remove the sandbox made by `vmnet up --sandbox` (required).
    #[arg(long)]
    pub sandbox: bool,
    /// The sandbox name.
    #[arg(long, default_value = DEFAULT_NAME)]
    pub name: String,
    /// Where the sandbox's state directory is.
    #[arg(long, default_value = DEFAULT_ROOT)]
    pub root: PathBuf,
}

/// One VM row of the `up` table.
#[derive(Debug, Clone, Serialize)]
pub struct VmRow {
    /// VM id.
    pub vm: String,
    /// User id.
    pub user_id: u32,
    /// The agent's state for it.
    pub state: String,
    /// Its namespace.
    pub netns: String,
    /// `host/ns` veth names, or `-`.
    pub veth: String,
    /// The transit /30, or `-`.
    pub transit: String,
    /// The tap.
    pub tap: String,
    /// Guest address and MAC.
    pub guest: String,
    /// Mesh address, or `-`.
    pub mesh: String,
    /// Routes, `dst via x` joined by `, `.
    pub routes: String,
    /// The simulated guest's namespace.
    pub guest_ns: String,
}

/// What `up` prints with `--output json`.
#[derive(Debug, Clone, Serialize)]
pub struct UpReport {
    /// The sandbox name.
    pub sandbox: String,
    /// The sandbox agent's API socket.
    pub socket: PathBuf,
    /// A ready-to-copy command talking to the sandbox agent:
    /// `VMNET_SOCKET=<socket> vmnet status`.
    pub client_hint: String,
    /// The VMs.
    pub vms: Vec<VmRow>,
    /// The checks.
    pub checks: Vec<CheckResult>,
}

fn need_root_and_flag(sandbox: bool, cmd: &str) -> Result<(), Error> {
    if !sandbox {
        return Err(Error::invalid(format!(
            "vmnet {cmd}: only the sandbox mode exists; pass --sandbox"
        )));
    }
    if !nix::unistd::geteuid().is_root() {
        return Err(Error::invalid(format!(
            "vmnet {cmd} --sandbox must run as root (it creates network namespaces)"
        )));
    }
    Ok(())
}

fn check_name(name: &str) -> Result<(), Error> {
    vmnet_plan::ns::names::check_prefix(name)
        .map_err(|m| Error::invalid(format!("sandbox --name: {m}")))
}

/// The default host spec, compiled in for when `vmnet up --sandbox` runs outside the repository.
const EMBEDDED_HOST_SPEC: &str = include_str!("../../../../examples/host.json");
/// The default host spec path.
const DEFAULT_HOST_SPEC: &str = "examples/host.json";

/// Reads the host spec; the default path falls back to the compiled-in `examples/host.json` when
/// the file is not there (e.g. the binary runs from another directory).
fn read_spec(path: &Path) -> Result<String, Error> {
    match std::fs::read_to_string(path) {
        Ok(t) => Ok(t),
        Err(e)
            if e.kind() == std::io::ErrorKind::NotFound && path == Path::new(DEFAULT_HOST_SPEC) =>
        {
            Ok(EMBEDDED_HOST_SPEC.to_owned())
        }
        Err(e) => Err(Error::invalid(format!("host spec {}: {e}", path.display()))),
    }
}

/// Runs `vmnet up --sandbox`.
///
/// # Errors
/// `INVALID_INPUT` for a bad flag or host spec, `CONFLICT` when the sandbox exists, `INTERNAL`
/// when building it fails (after removing what was built) or when any check fails (the sandbox
/// then stays up for inspection).
pub async fn run(json: bool, args: UpArgs) -> Result<(), Error> {
    // Caught from the start, so an interrupt never leaves a half-built sandbox behind.
    let mut interrupts = state::Interrupts::install()?;
    need_root_and_flag(args.sandbox, "up")?;
    check_name(&args.name)?;
    let text = read_spec(&args.host_spec)?;
    if crate::pool_job::is_pool_spec(&text) {
        return crate::pool_job::up_pool(
            json,
            &args.host_spec,
            &args.name,
            &args.root,
            Duration::from_secs(args.timeout_secs),
            interrupts,
        )
        .await;
    }
    let spec = HostSpec::parse(&args.host_spec.display().to_string(), &text)?;
    let paths = state::claim(&args.root, &args.name)?;
    // Ctrl-C or SIGTERM while building: the partial sandbox is removed like a failed one.
    let built = tokio::select! {
        biased;
        why = interrupts.wait() => Err(state::interrupted_error(why, &args.name)),
        r = bring_up(&args, &paths, &spec) => r,
    };
    let report = match built {
        Ok(r) => r,
        Err(e) => {
            let _ = teardown(&paths, &args.name);
            // A step that ended early on the signal reports the interrupt, as the others do.
            return Err(state::Interrupts::reason()
                .map_or(e, |why| state::interrupted_error(why, &args.name)));
        }
    };
    state::done_building(&paths);
    match json {
        true => println!(
            "{}",
            serde_json::to_string_pretty(&report).map_err(|e| Error::internal(e.to_string()))?
        ),
        false => print_report(&report, &paths),
    }
    let failed = report.checks.iter().filter(|c| !c.ok).count();
    if failed > 0 {
        return Err(Error::internal(format!(
            "{failed} of {} sandbox checks failed; the sandbox stays up for inspection (`vmnet down --sandbox --name {}` removes it)",
            report.checks.len(),
            args.name
        )));
    }
    Ok(())
}

fn print_report(report: &UpReport, paths: &Paths) {
    let rows: Vec<Vec<String>> = report
        .vms
        .iter()
        .map(|v| {
            vec![
                v.vm.clone(),
                v.state.clone(),
                v.netns.clone(),
                v.veth.clone(),
                v.transit.clone(),
                v.guest.clone(),
                v.mesh.clone(),
                v.routes.clone(),
            ]
        })
        .collect();
    println!("sandbox {} (state {})", report.sandbox, paths.dir.display());
    println!(
        "agent socket {}: {}",
        report.socket.display(),
        report.client_hint
    );
    println!();
    print!(
        "{}",
        vmnet_agent::table::render(
            &[
                "VM",
                "STATE",
                "NETNS",
                "VETH (HOST/NS)",
                "TRANSIT",
                "GUEST",
                "MESH",
                "ROUTES"
            ],
            &rows
        )
    );
    println!();
    print!("{}", checks::render_checks(&report.checks));
    let ok = report.checks.iter().filter(|c| c.ok).count();
    println!();
    let name_flag = if report.sandbox == DEFAULT_NAME {
        String::new()
    } else {
        format!(" --name {}", report.sandbox)
    };
    println!(
        "{ok}/{} checks ok; the sandbox stays up (`vmnet down --sandbox{name_flag}` removes it)",
        report.checks.len()
    );
}

fn record(paths: &Paths, st: &mut SandboxState, role: &str, pid: u32) -> Result<(), Error> {
    st.procs.push(Proc {
        role: role.to_owned(),
        pid,
    });
    paths.save(st)
}

async fn bring_up(args: &UpArgs, paths: &Paths, spec: &HostSpec) -> Result<UpReport, Error> {
    let timeout = Duration::from_secs(args.timeout_secs);
    let sb_err = |e: crate::SandboxError| Error::internal(format!("sandbox {}: {e}", args.name));
    let sb = crate::Sandbox::with_prefix(&args.name).map_err(sb_err)?;
    let mut st = SandboxState {
        name: args.name.clone(),
        host_ns: sb.host(),
        inet_ns: sb.inet(),
        ..SandboxState::default()
    };
    // From here on `teardown` (via the state file and the prefix) removes everything.
    let _ = sb.keep();
    paths.save(&st)?;

    // The echo service in the fake internet.
    let ready = paths.ready("echo");
    let echo_args: Vec<String> = [
        "sandbox-helper",
        "echo",
        "--netns",
        &st.inet_ns,
        "--listen",
        &format!("{}:7", sandbox::ECHO_V4),
        "--listen",
        &format!("[{}]:7", sandbox::ECHO_V6),
        "--ready-file",
        &ready.display().to_string(),
    ]
    .map(str::to_owned)
    .to_vec();
    let mut child = state::spawn_background(&echo_args, &paths.log("echo"))?;
    record(paths, &mut st, "echo", child.id())?;
    state::wait_ready(
        &mut child,
        &ready,
        &paths.log("echo"),
        "echo service",
        timeout,
    )?;

    // The agent, inside the sandbox host.
    let agent_args: Vec<String> = vec![
        "--socket".into(),
        paths.socket().display().to_string(),
        "--state-dir".into(),
        paths.agent_state().display().to_string(),
        "serve".into(),
        "--netns".into(),
        st.host_ns.clone(),
        "--name-prefix".into(),
        args.name.clone(),
    ];
    std::fs::create_dir_all(paths.agent_state())
        .map_err(|e| Error::internal(format!("{}: {e}", paths.agent_state().display())))?;
    let mut agent = state::spawn_background(&agent_args, &paths.log("agent"))?;
    record(paths, &mut st, "agent", agent.id())?;
    let client = Client::new(paths.socket());
    wait_agent(&client, &mut agent, &paths.log("agent"), timeout).await?;

    let report = vmnet_agent::apply::apply_host_spec(&client, spec, false).await?;
    for item in &report.items {
        eprintln!("applied {} {}: {}", item.kind, item.id, item.result);
    }
    let mut views = Vec::new();
    for vm in &spec.vms {
        views.push(wait_applied(&client, &vm.id, timeout).await?);
    }

    // Simulated guests.
    let mut guests = Vec::new();
    let mut rows = Vec::new();
    for v in &views {
        let guest_ns = format!("{}g{:04x}", args.name, v.config.user_id);
        netns::create(&guest_ns).map_err(sb_err)?;
        st.guest_ns.push(guest_ns.clone());
        paths.save(&st)?;
        let role = format!("relay-{}", v.config.id);
        let ready = paths.ready(&role);
        let relay_args: Vec<String> = vec![
            "sandbox-helper".into(),
            "relay".into(),
            "--vm-netns".into(),
            v.status.netns.clone(),
            "--tap".into(),
            v.status.tap.clone(),
            "--guest-netns".into(),
            guest_ns.clone(),
            "--ready-file".into(),
            ready.display().to_string(),
        ];
        let mut child = state::spawn_background(&relay_args, &paths.log(&role))?;
        record(paths, &mut st, &role, child.id())?;
        state::wait_ready(&mut child, &ready, &paths.log(&role), &role, timeout)?;
        let cfg = guest_config(v)?;
        crate::guest::configure(&guest_ns, crate::guest::GUEST_IF, &cfg)
            .map_err(|e| Error::internal(format!("guest of vm {}: {e}", v.config.id)))?;
        guests.push(GuestInfo {
            vm: v.config.id.clone(),
            guest_ns: guest_ns.clone(),
            mesh: v.config.mesh_ipv6,
            routes: v.config.network.routes.clone(),
            kernel: Some(checks::KernelNames {
                host_ns: st.host_ns.clone(),
                vm_ns: v.status.netns.clone(),
                veth_host: v.status.veth_host.clone(),
                nft_table: args.name.clone(),
            }),
        });
        rows.push(vm_row(v, &guest_ns));
    }

    let results = tokio::task::spawn_blocking(move || checks::run_checks(&guests))
        .await
        .map_err(|e| Error::internal(format!("checks: {e}")))?
        .map_err(|e| Error::internal(format!("checks: {e}")))?;
    let socket = std::path::absolute(paths.socket()).unwrap_or_else(|_| paths.socket());
    Ok(UpReport {
        sandbox: args.name.clone(),
        client_hint: format!(
            "VMNET_SOCKET={} {} status",
            socket.display(),
            std::env::current_exe().map_or_else(|_| "vmnet".into(), |p| p.display().to_string())
        ),
        socket,
        vms: rows,
        checks: results,
    })
}

/// How the simulated guest of `v` configures itself: the status's MAC, address, gateway and MTU;
/// its mesh /128; IPv6 routes via `fe80::1` for the mesh range and each IPv6 route destination.
fn guest_config(v: &VmView) -> Result<GuestConfig, Error> {
    let bad = |what: &str, val: &str| {
        Error::internal(format!(
            "vm {}: status {what} {val:?} is not an address",
            v.config.id
        ))
    };
    let ipv4 = v
        .status
        .guest_ipv4
        .parse()
        .map_err(|_| bad("guest_ipv4", &v.status.guest_ipv4))?;
    let gw = v
        .status
        .gateway_ipv4
        .parse()
        .map_err(|_| bad("gateway_ipv4", &v.status.gateway_ipv4))?;
    let mut routes_v6 = vec![GuestRoute6 {
        destination: "fdaa::/16".into(),
        via: Some(GUEST_GW_V6),
    }];
    for r in &v.config.network.routes {
        if let ipnet::IpNet::V6(d) = r.destination {
            routes_v6.push(GuestRoute6 {
                destination: d.to_string(),
                via: Some(GUEST_GW_V6),
            });
        }
    }
    Ok(GuestConfig {
        mac: v.status.guest_mac.clone(),
        ipv4,
        gateway_v4: Some(gw),
        mtu: v.status.mtu,
        mesh_ipv6: v.config.mesh_ipv6,
        routes_v6,
    })
}

fn vm_row(v: &VmView, guest_ns: &str) -> VmRow {
    let dash = |o: &Option<String>| o.clone().unwrap_or_else(|| "-".into());
    let veth = match (&v.status.veth_host, &v.status.veth_ns) {
        (Some(h), Some(n)) => format!("{h}/{n}"),
        _ => "-".into(),
    };
    let routes: Vec<String> = v
        .config
        .network
        .routes
        .iter()
        .map(|r| match r.via {
            Via::Host => format!("{} via host", r.destination),
            Via::Mesh(m) => format!("{} via {m}", r.destination),
        })
        .collect();
    VmRow {
        vm: v.config.id.clone(),
        user_id: v.config.user_id,
        state: v.status.state.as_str().into(),
        netns: v.status.netns.clone(),
        veth,
        transit: dash(&v.status.transit),
        tap: v.status.tap.clone(),
        guest: format!("{} {}", v.status.guest_ipv4, v.status.guest_mac),
        mesh: v
            .config
            .mesh_ipv6
            .map_or_else(|| "-".into(), |m: Ipv6Addr| m.to_string()),
        routes: if routes.is_empty() {
            "none".into()
        } else {
            routes.join(", ")
        },
        guest_ns: guest_ns.to_owned(),
    }
}

async fn wait_agent(
    client: &Client,
    agent: &mut std::process::Child,
    log: &Path,
    timeout: Duration,
) -> Result<(), Error> {
    let start = Instant::now();
    loop {
        match client.get::<serde_json::Value>("/v1/status").await {
            Ok(_) => return Ok(()),
            Err(e) => {
                if let Ok(Some(status)) = agent.try_wait() {
                    return Err(Error::internal(format!(
                        "the agent exited ({status}): {}",
                        state::log_tail(log)
                    )));
                }
                if start.elapsed() > timeout {
                    return Err(Error::internal(format!(
                        "the agent did not answer within {timeout:?}: {e}; {}",
                        state::log_tail(log)
                    )));
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn wait_applied(client: &Client, id: &str, timeout: Duration) -> Result<VmView, Error> {
    let start = Instant::now();
    let path = format!("/v1/vms/{}", segment(id));
    loop {
        let v: VmView = client.get(&path).await?;
        match v.status.state {
            VmState::Applied => return Ok(v),
            VmState::Failed => {
                return Err(Error::internal(format!(
                    "vm {id}: apply failed: {}",
                    v.status
                        .last_error
                        .as_deref()
                        .unwrap_or("no error recorded")
                )));
            }
            VmState::Pending if start.elapsed() > timeout => {
                return Err(Error::new(
                    ErrorCode::Unavailable,
                    format!("vm {id}: not applied within {timeout:?}"),
                ));
            }
            VmState::Pending => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// What `down` removed.
#[derive(Debug, Default, Serialize)]
struct DownReport {
    stopped: Vec<String>,
    namespaces: Vec<String>,
}

/// Stops the recorded processes (relays, agent, echo: newest first), deletes the sandbox's
/// namespaces ([`sandbox::owned`]: its exact prefix and a documented suffix, never a sandbox
/// whose name merely starts with this one) and removes the state directory.
fn teardown(paths: &Paths, name: &str) -> Result<DownReport, Error> {
    let mut report = DownReport::default();
    // With the trailing slash, so a sandbox whose name starts with this one's never matches.
    let marker = format!("{}/", paths.dir.display());
    if let Some(st) = paths.load()? {
        for p in st.procs.iter().rev() {
            if state::stop(p.pid, &marker) {
                report.stopped.push(format!("{} (pid {})", p.role, p.pid));
            }
        }
    }
    report.namespaces = sandbox::owned(name);
    sandbox::cleanup(name).map_err(|e| Error::internal(format!("sandbox {name}: {e}")))?;
    match std::fs::remove_dir_all(&paths.dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(Error::internal(format!(
                "remove {}: {e}",
                paths.dir.display()
            )));
        }
    }
    Ok(report)
}

/// Runs `vmnet down --sandbox`.
///
/// # Errors
/// `INVALID_INPUT` for a bad flag, `NOT_FOUND` when no such sandbox exists, `INTERNAL` when
/// something could not be removed.
pub async fn down(json: bool, args: DownArgs) -> Result<(), Error> {
    need_root_and_flag(args.sandbox, "down")?;
    if let Some(pid) = state::builder(&args.root.join(&args.name)) {
        return Err(Error::conflict(format!(
            "sandbox {} is still being made by `vmnet up` (pid {pid}): interrupt that run (Ctrl-C) instead, it removes what it built",
            args.name
        )));
    }
    check_name(&args.name)?;
    let paths = Paths::new(&args.root, &args.name);
    if !paths.dir.exists() && sandbox::owned(&args.name).is_empty() {
        return Err(Error::not_found(format!(
            "no sandbox {} is up (no {} and no namespaces {}…)",
            args.name,
            paths.dir.display(),
            args.name
        )));
    }
    let report = tokio::task::spawn_blocking(move || teardown(&paths, &args.name))
        .await
        .map_err(|e| Error::internal(format!("down: {e}")))??;
    match json {
        true => println!(
            "{}",
            serde_json::to_string_pretty(&report).map_err(|e| Error::internal(e.to_string()))?
        ),
        false => {
            for p in &report.stopped {
                println!("stopped {p}");
            }
            println!(
                "deleted {} namespaces: {}",
                report.namespaces.len(),
                report.namespaces.join(" ")
            );
        }
    }
    Ok(())
}
