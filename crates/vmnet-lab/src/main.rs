//! `vmnet-lab`: the lab around the product, never installed on a host. It holds the sandbox
//! (`up --sandbox`, `down --sandbox`, `guest attach --sandbox`: throwaway namespaces, a fake internet, simulated or real
//! guests and the checks), the benchmarks (`bench`) and the sandbox's background processes
//! (the hidden `sandbox-helper`). Every agent it starts is the product's `vmnet serve`, from
//! the `vmnet` binary beside this one or the one `--vmnet`/`VMNET_BIN` names
//! ([`vmnet_sandbox::exe`]).
//!
//! Errors print and exit as `vmnet`'s do ([`vmnet_cli`]).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use vmnet_agent::api::error::from_ipam;
use vmnet_bench::BenchError;
use vmnet_cli::{Output, finish, report, usage_error};
use vmnet_model::Error;

#[derive(Debug, Parser)]
#[command(
    name = "vmnet-lab",
    version,
    about = "The vmnet lab: sandbox hosts with the main job's checks, and the benchmarks"
)]
struct Cli {
    /// Output format.
    #[arg(long, global = true, value_enum, default_value_t = Output::Table)]
    output: Output,
    /// The `vmnet` binary every agent runs from. Default: `vmnet` beside this executable.
    #[arg(long, global = true, env = "VMNET_BIN")]
    vmnet: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create a sandbox host and run the main job inside it.
    Up(vmnet_sandbox::args::UpArgs),
    /// Remove a sandbox made by `vmnet-lab up --sandbox`.
    Down(vmnet_sandbox::args::DownArgs),
    /// Simulated guests for VMs put on a sandbox's agent after `up`.
    #[command(subcommand)]
    Guest(vmnet_sandbox::attach::GuestCmd),
    /// Install the vmnet package (`scripts/package.sh`) on a fresh Debian 12 VM under qemu, as an
    /// operator does, and check it there under systemd: start, a VM put, Prometheus, kill -9,
    /// the watchdog, a reinstall with a guest's traffic flowing, events and the journal.
    PackageVm(vmnet_sandbox::kvm::package_vm::PackageVmArgs),
    /// Benchmarks that print a table.
    #[command(subcommand)]
    Bench(vmnet_bench::BenchCmd),
    /// Background processes of the sandbox (frame relay, echo service, uplink keeper); internal.
    #[command(subcommand, hide = true, name = "sandbox-helper")]
    SandboxHelper(vmnet_sandbox::helper::HelperCmd),
}

fn main() -> ExitCode {
    vmnet_cli::restore_sigpipe();
    vmnet_cli::raise_nofile_limit();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(&e).into(),
    };
    // The sandbox (its helpers and `up`, which keeps agents and helpers running) and the
    // benchmarks outlive the peers they talk to; `down` stays a short client command.
    if !matches!(cli.command, Command::Down(_)) {
        vmnet_cli::ignore_sigpipe();
    }
    if let Some(p) = cli.vmnet {
        vmnet_sandbox::exe::set_vmnet(p);
    }
    let json = cli.output == Output::Json;
    let command = match cli.command {
        // No runtime: a helper runs its own threads until it is signalled.
        Command::SandboxHelper(c) => return finish(vmnet_sandbox::helper::run(c)).into(),
        c => c,
    };
    // Before the runtime's threads exist: the benchmarks run the agent's driver in this
    // process, so they get the agent's allocator set-up (few malloc arenas).
    if matches!(command, Command::Bench(_)) {
        let _ = vmnet_agent::malloc::limit_arenas();
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => return report(&Error::internal(format!("cannot start the runtime: {e}"))).into(),
    };
    finish(runtime.block_on(async move {
        match command {
            Command::Up(a) => vmnet_sandbox::up::run(json, a).await,
            Command::Down(a) => vmnet_sandbox::up::down(json, a).await,
            Command::Guest(vmnet_sandbox::attach::GuestCmd::Attach(a)) => {
                vmnet_sandbox::attach::run(json, a).await
            }
            Command::PackageVm(a) => vmnet_sandbox::kvm::package_vm::run(json, &a),
            Command::Bench(c) => vmnet_bench::run(json, c).await.map_err(from_bench),
            Command::SandboxHelper(_) => unreachable!("run above, without a runtime"),
        }
    }))
    .into()
}

/// A benchmark's failure as the wire error: IPAM failures through the one IPAM mapping
/// ([`from_ipam`]), validation failures as `INVALID_INPUT`, coded ones as they are.
fn from_bench(e: BenchError) -> Error {
    match e {
        BenchError::Ipam(e) => from_ipam(e),
        BenchError::Invalid(e) => e.into(),
        BenchError::Coded(e) => e,
    }
}
