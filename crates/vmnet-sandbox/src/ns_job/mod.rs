//! `vmnet-lab up --sandbox` / `vmnet-lab down --sandbox`: the main job in throwaway namespaces.
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
//! 5. the checks of [`sandbox_checks`](self::checks), for a VM with an enabled firewall the
//!    [`firewall`] checks (allowed and refused traffic from the fake internet, a mesh peer and
//!    the guest), and, for a VM with a public limit in force, the [`limits`] checks (a short
//!    iperf3 download against the limit), the [`metadata`] checks (each guest's own document
//!    with a token, without one as its version says, and never another VM's whatever headers
//!    it forges), the [`activity`] checks (TCP from the fake internet moves a VM's packet
//!    activity, pings and UDP do not), the [`repair`] check (IPv6 turned off by hand on a host
//!    veth end cuts the VM off until the agent's next reconcile pass turns it on again), and two
//!    tables: the VMs and the checks.
//!
//! With `--guests kvm`, step 4 boots a real Linux guest per VM instead and the checks are those of
//! [`kvm`], run from inside the guests.
//!
//! The exit status is non-zero when any check saw something other than what it expected. The
//! sandbox stays up either way (the agent, echo service and relays keep running in the
//! background, their pids recorded in `/run/vmnet-sandbox/<name>/sandbox.json`); `vmnet-lab down
//! --sandbox` stops them by pid, deletes the sandbox's namespaces (`<name>` followed by `host`,
//! `inet`, `x-…` or a kind letter and four hex digits: never those of a sandbox whose name merely
//! starts with `<name>`) and the state directory. `up` prints the agent's socket and a
//! ready-to-copy `VMNET_SOCKET=… vmnet status`, and the agent's pid, log and command line
//! (`--agent-arg` adds flags to it, [`crate::agent_args`]). An uplink keeper
//! ([`crate::uplink`]) per side of the uplink puts the sandbox's own routes back after the
//! uplink is flapped; `vmnet-lab guest attach` ([`crate::attach`]) gives a VM put after `up`
//! a simulated guest.
//!
//! `up` when the sandbox exists already, or when an existing sandbox's name is a prefix of
//! `<name>` or starts with it, is refused with `CONFLICT` (run `down` first); a failure while
//! building it removes what was built.
//!
//! [`crate::up`] hands a pool spec (`"mode": "pool"`) to [`crate::pool_job`] and a fleet spec
//! (`"mode": "fleet"`) to [`crate::fleet_job`], everything else to [`up`] here.

pub mod activity;
pub mod checks;
pub mod firewall;
pub mod fwchange;
pub mod hostile;
pub mod kvm;
pub mod kvm_change;
pub mod kvm_wake;
pub mod limits;
pub mod metadata;
pub mod probes;
pub mod public;
pub mod repair;
pub(crate) mod steps;
pub mod wake;

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::sandbox;
use serde::Serialize;
use vmnet_agent::hostspec::HostSpec;
use vmnet_model::Error;
use vmnet_model::error::chain;
use vmnet_model::vm::metadata::MetadataVersion;

use self::checks::CheckResult;
pub use self::steps::VmRow;
use crate::agent::AgentOptions;
use crate::args::{DEFAULT_NAME, UpArgs};
use crate::state::{self, Paths, SandboxState};
use crate::teardown::teardown;

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
    /// The sandbox agent's pid (recorded in `sandbox.json`, stopped by `down`).
    pub agent_pid: u32,
    /// The sandbox agent's log file.
    pub agent_log: PathBuf,
    /// The sandbox agent's whole command line, the `vmnet` binary first (with the flags of
    /// `--agent-arg` last).
    pub agent_command: Vec<String>,
    /// The VMs.
    pub vms: Vec<VmRow>,
    /// The checks.
    pub checks: Vec<CheckResult>,
}

/// Runs `vmnet-lab up --sandbox` for a namespace-mode host spec `text` (see the module docs).
///
/// # Errors
/// `INVALID_INPUT` for a bad host spec, `CONFLICT` when the sandbox exists, `INTERNAL` when
/// building it fails (after removing what was built) or when any check fails (the sandbox then
/// stays up for inspection).
pub async fn up(
    json: bool,
    args: &UpArgs,
    text: &str,
    mut interrupts: state::Interrupts,
) -> Result<(), Error> {
    let spec = HostSpec::parse(&args.host_spec.display().to_string(), text)?;
    let paths = state::claim(&args.root, &args.name)?;
    // Ctrl-C or SIGTERM while building: the partial sandbox is removed like a failed one.
    let built = tokio::select! {
        biased;
        why = interrupts.wait() => Err(state::interrupted_error(why, &args.name)),
        r = bring_up(args, &paths, &spec) => r,
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
            "{failed} of {} sandbox checks failed; the sandbox stays up for inspection (`vmnet-lab down --sandbox --name {}` removes it)",
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
    println!(
        "agent pid {}, log {}",
        report.agent_pid,
        report.agent_log.display()
    );
    println!(
        "agent command: {}",
        crate::agent_args::shell_line(&report.agent_command)
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
        "{ok}/{} checks ok; the sandbox stays up (`vmnet-lab down --sandbox{name_flag}` removes it)",
        report.checks.len()
    );
}

async fn bring_up(args: &UpArgs, paths: &Paths, spec: &HostSpec) -> Result<UpReport, Error> {
    let timeout = Duration::from_secs(args.timeout_secs);
    let sb_err =
        |e: crate::SandboxError| Error::internal(format!("sandbox {}: {}", args.name, chain(&e)));
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
    // The sandbox's own routes on both ends of the uplink, put back after a flap.
    steps::keep_uplinks(
        paths,
        &mut st,
        &host_ns,
        &[sandbox::HOST_UPLINK_IF],
        timeout,
    )?;
    steps::keep_uplinks(paths, &mut st, &inet, &[sandbox::INET_UPLINK_IF], timeout)?;
    let agent = AgentOptions::new(&host_ns, &args.name, &paths.dir)
        .socket(paths.socket())
        .state_dir(paths.agent_state())
        .default_database()
        .log(paths.log("agent"))
        // The VMs' public addresses lie on the uplink's subnets: the host answers ARP/NDP.
        .args([
            "--uplink",
            sandbox::HOST_UPLINK_IF,
            "--public-neighbors",
            "proxy",
        ])
        // Packet activity, its maps pinned in the sandbox's state (removed by `down`).
        .arg("--activity-root")
        .arg(paths.activity_root())
        // Wake on packet with a short hold, so the main job sees held frames expire.
        .arg(format!("--wake-hold-secs={}", wake::HOLD_SECS))
        // qemu drops what reached its tap while it restores a guest: deliver to real guests
        // when they first send (a restored guest announces itself).
        .arg(if args.guests == crate::kvm::GuestKind::Kvm {
            "--wake-deliver=first-frame"
        } else {
            "--wake-deliver=attach"
        });
    let (client, started) =
        steps::start_agent(paths, &mut st, "agent", agent, (&args.agent_args, timeout)).await?;

    let applied = vmnet_agent::apply::apply_host_spec(&client, spec, false).await?;
    for item in &applied.items {
        eprintln!("applied {} {}: {}", item.kind, item.id, item.result);
    }
    let host = (
        args.name.as_str(),
        host_ns.as_str(),
        sandbox::HOST_UPLINK_V4,
    );
    if args.guests == crate::kvm::GuestKind::Kvm {
        let mut views = Vec::new();
        for vm in &spec.vms {
            views.push(steps::wait_applied(&client, &vm.id, timeout).await?);
        }
        let (rows, checks) = kvm::run(paths, &mut st, &client, &views, host, &inet).await?;
        return Ok(report(args, paths, started, rows, checks));
    }
    let mut guests = Vec::new();
    let mut rows = Vec::new();
    for vm in &spec.vms {
        let v = steps::wait_applied(&client, &vm.id, timeout).await?;
        let (mut guest, row) = steps::attach_guest(paths, &mut st, host, &v, timeout)?;
        guest.public = public::public_check(
            &v.config,
            &inet,
            sandbox::INET_UPLINK_V4,
            sandbox::INET_UPLINK_V6,
        );
        guests.push(guest);
        rows.push(row);
    }

    let guest_ns: Vec<(String, String)> = guests
        .iter()
        .map(|g| (g.vm.clone(), g.guest_ns.clone()))
        .collect();
    let (fw_inet, fw_vms, fw_ns) = (inet.clone(), spec.vms.clone(), guest_ns.clone());
    let md_vms: Vec<_> = spec
        .vms
        .iter()
        .cloned()
        .zip(guest_ns.iter().map(|(_, ns)| ns.clone()))
        .collect();
    let mut results = tokio::task::spawn_blocking(move || {
        checks::run_checks(&guests).map(|mut r| {
            r.extend(firewall::run(&fw_inet, &fw_vms, &fw_ns));
            r.extend(metadata::run(&md_vms, MetadataVersion::default()));
            r
        })
    })
    .await
    .map_err(|e| Error::internal(format!("checks: {e}")))?
    .map_err(|e| Error::internal(format!("checks: {}", chain(&e))))?;
    results.extend(hostile::run(&client, &inet, &spec.vms, &guest_ns).await);
    results.push(metadata::worker(&client).await);
    results.extend(fwchange::run(&client, &inet, &spec.vms, &guest_ns).await);
    results.extend(limits::run(&client, &inet, &spec.vms, &guest_ns).await);
    results.extend(activity::run(&client, &inet, &spec.vms, &guest_ns).await);
    results.extend(wake::run(&client, &inet, &args.name, &spec.vms).await);
    results.extend(repair::run(&client, &inet, &host_ns, &spec.vms, &rows).await);
    Ok(report(args, paths, started, rows, results))
}

fn report(
    args: &UpArgs,
    paths: &Paths,
    agent: steps::StartedAgent,
    vms: Vec<VmRow>,
    checks: Vec<CheckResult>,
) -> UpReport {
    let socket = std::path::absolute(paths.socket()).unwrap_or_else(|_| paths.socket());
    UpReport {
        sandbox: args.name.clone(),
        client_hint: client_hint(&socket),
        agent_pid: agent.pid,
        agent_log: agent.log,
        agent_command: agent.command,
        socket,
        vms,
        checks,
    }
}

/// `VMNET_SOCKET=<socket> <the vmnet binary> status`.
pub(crate) fn client_hint(socket: &Path) -> String {
    format!(
        "VMNET_SOCKET={} {} status",
        socket.display(),
        crate::exe::vmnet().map_or_else(|_| "vmnet".into(), |p| p.display().to_string())
    )
}
