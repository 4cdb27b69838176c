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
//!
//! A pool spec (`"mode": "pool"`) goes to [`crate::pool_job`], a fleet spec (`"mode": "fleet"`)
//! to [`crate::fleet_job`]; `down` removes a fleet too (its state file says so, or its private
//! network namespace exists).

pub mod checks;
pub(crate) mod steps;

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::sandbox;
use serde::Serialize;
use vmnet_agent::hostspec::HostSpec;
use vmnet_model::Error;

use self::checks::CheckResult;
pub use self::steps::VmRow;
use crate::state::{self, Paths, SandboxState};

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
    /// `examples/host.json` when run outside the repository); a file with `"mode": "pool"`
    /// runs the pool sandbox, one with `"mode": "fleet"` the multi-host sandbox.
    #[arg(default_value = DEFAULT_HOST_SPEC)]
    pub host_spec: PathBuf,
    /// The sandbox name: the name prefix of every namespace and link in it (lowercase letters
    /// and digits, a letter first, at most 10 bytes; 9 for a fleet).
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
    if crate::fleet_job::is_fleet_spec(&text) {
        return crate::fleet_job::up(json, &args, &text, interrupts).await;
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
    let rows: Vec<Vec<String>> = report.vms.iter().map(VmRow::cells).collect();
    println!("sandbox {} (state {})", report.sandbox, paths.dir.display());
    println!(
        "agent socket {}: {}",
        report.socket.display(),
        report.client_hint
    );
    println!();
    print!("{}", vmnet_agent::table::render(&steps::VM_HEADER, &rows));
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

    let inet = st.inet_ns.clone();
    steps::start_echo(paths, &mut st, &inet, timeout)?;
    let host_ns = st.host_ns.clone();
    let run = steps::AgentRun {
        role: "agent",
        host_ns: &host_ns,
        prefix: &args.name,
        socket: paths.socket(),
        state_dir: paths.agent_state(),
        database_url: None,
    };
    let client = steps::start_agent(paths, &mut st, &run, timeout).await?;

    let report = vmnet_agent::apply::apply_host_spec(&client, spec, false).await?;
    for item in &report.items {
        eprintln!("applied {} {}: {}", item.kind, item.id, item.result);
    }
    let mut guests = Vec::new();
    let mut rows = Vec::new();
    for vm in &spec.vms {
        let v = steps::wait_applied(&client, &vm.id, timeout).await?;
        let host = (
            args.name.as_str(),
            host_ns.as_str(),
            sandbox::HOST_UPLINK_V4,
        );
        let (guest, row) = steps::attach_guest(paths, &mut st, host, &v, timeout)?;
        guests.push(guest);
        rows.push(row);
    }

    let results = tokio::task::spawn_blocking(move || checks::run_checks(&guests))
        .await
        .map_err(|e| Error::internal(format!("checks: {e}")))?
        .map_err(|e| Error::internal(format!("checks: {e}")))?;
    let socket = std::path::absolute(paths.socket()).unwrap_or_else(|_| paths.socket());
    Ok(UpReport {
        sandbox: args.name.clone(),
        client_hint: client_hint(&socket),
        socket,
        vms: rows,
        checks: results,
    })
}

/// `VMNET_SOCKET=<socket> <this executable> status`.
pub(crate) fn client_hint(socket: &Path) -> String {
    format!(
        "VMNET_SOCKET={} {} status",
        socket.display(),
        std::env::current_exe().map_or_else(|_| "vmnet".into(), |p| p.display().to_string())
    )
}

/// What `down` removed.
#[derive(Debug, Default, Serialize)]
pub(crate) struct DownReport {
    /// The processes stopped, `role (pid N)`.
    pub stopped: Vec<String>,
    /// The namespaces deleted.
    pub namespaces: Vec<String>,
}

/// Stops the recorded processes (relays, agents, echo: newest first), a fleet's PostgreSQL
/// cluster, deletes the sandbox's namespaces ([`sandbox::owned`], for a fleet
/// [`crate::fleet::owned`]: exact prefixes and a documented suffix, never a sandbox whose name
/// merely starts with this one) and removes the state directory.
pub(crate) fn teardown(paths: &Paths, name: &str) -> Result<DownReport, Error> {
    let mut report = DownReport::default();
    // With the trailing slash, so a sandbox whose name starts with this one's never matches.
    let marker = format!("{}/", paths.dir.display());
    let st = paths.load()?;
    for p in st.iter().flat_map(|st| st.procs.iter().rev()) {
        if state::stop(p.pid, &marker) {
            report.stopped.push(format!("{} (pid {})", p.role, p.pid));
        }
    }
    let fleet_state = st.and_then(|st| st.fleet);
    let is_fleet = fleet_state.is_some() || crate::fleet::exists(name);
    let pg = crate::fleet_job::remove_postgres(name, fleet_state.as_ref())?;
    report.stopped.extend(pg);
    let sb_err = |e: crate::SandboxError| Error::internal(format!("sandbox {name}: {e}"));
    if is_fleet {
        report.namespaces = crate::fleet::owned(name);
        crate::fleet::cleanup(name).map_err(sb_err)?;
    } else {
        report.namespaces = sandbox::owned(name);
        sandbox::cleanup(name).map_err(sb_err)?;
    }
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
    if !paths.dir.exists()
        && sandbox::owned(&args.name).is_empty()
        && !crate::fleet_job::pg_dir(&args.name).exists()
    {
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
