//! The whole command line, as the `vmnetd` binary runs it: the agent (`serve`), the IPAM
//! commands and the client commands. `vmnet` hands every command but the client ones to it.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use vmnet_agent::api::error::from_ipam;
use vmnet_cli::{finish, report, usage_error};
use vmnet_model::Error;

use crate::Global;
use crate::cli;
use crate::client::{self, ClientCmd};

/// The whole command line.
#[derive(Debug, Parser)]
#[command(
    name = "vmnet",
    bin_name = "vmnet",
    version,
    about = "Host networking for virtual machines"
)]
pub(crate) struct Cli {
    #[command(flatten)]
    pub(crate) global: Global,
    #[command(subcommand)]
    pub(crate) command: Command,
}

/// Its commands.
#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Pool ranges (IPAM).
    #[command(subcommand)]
    Pool(cli::ipam::PoolCmd),
    /// Hosts and their capacity.
    #[command(subcommand)]
    Host(cli::ipam::HostCmd),
    /// Instances: placement with a lease.
    #[command(subcommand)]
    Instance(cli::ipam::InstanceCmd),
    /// Leases of a pool.
    #[command(subcommand)]
    Lease(cli::ipam::LeaseCmd),
    /// Run the agent: HTTP API on a unix socket and the reconcile loop.
    Serve(Box<cli::serve::ServeArgs>),
    #[command(flatten)]
    Client(ClientCmd),
    /// The agent's configuration file (/etc/vmnet/vmnet.toml).
    #[command(subcommand)]
    Config(cli::config::ConfigCmd),
    /// Print a shell completion script (bash, zsh, fish) on stdout.
    Completions(cli::shell::CompletionsArgs),
    /// Write the manual pages (vmnet.1 and one per subcommand) into a directory.
    Man(cli::shell::ManArgs),
}

/// Runs the command line given to this process.
#[must_use]
pub fn main() -> ExitCode {
    vmnet_cli::restore_sigpipe();
    vmnet_cli::raise_nofile_limit();
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let cli = match cli::config::parse_cli(&argv) {
        Ok(cli) => cli,
        Err(cli::config::ParseFailure::Usage(e)) => return usage_error(&e).into(),
        Err(cli::config::ParseFailure::Config(e)) => return report(&e).into(),
    };
    // A client command runs without the runtime below (see `client::main`).
    let cli = match cli.command {
        Command::Client(c) => return client::main(&cli.global, c).into(),
        command => Cli {
            global: cli.global,
            command,
        },
    };
    // The agent outlives its clients and helpers: a peer that hangs up is an error for that
    // peer, never the end of the agent.
    if matches!(cli.command, Command::Serve(_)) {
        vmnet_cli::ignore_sigpipe();
    }
    // `serve --netns NAME` moves the process into NAME on the main thread, before any other
    // thread (the runtime's) exists, so the whole agent lives there without forking.
    if let Command::Serve(a) = &cli.command
        && let Err(e) = cli::serve::enter_netns(a)
    {
        return report(&e).into();
    }
    // Before the runtime's threads exist: few malloc arenas keep the agent's RSS small.
    if matches!(cli.command, Command::Serve(_)) {
        let _ = vmnet_agent::malloc::limit_arenas();
    }
    // The agent runs on a worker pool; every other command is one short exchange with the
    // agent or the store, and runs on this thread alone: no worker threads to start, wake and
    // join for an orchestrator that calls `vmnet` once per VM.
    let runtime = if matches!(cli.command, Command::Serve(_)) {
        tokio::runtime::Runtime::new()
    } else {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    };
    let runtime = match runtime {
        Ok(rt) => rt,
        Err(e) => return report(&Error::internal(format!("cannot start the runtime: {e}"))).into(),
    };
    let serving = matches!(cli.command, Command::Serve(_));
    let result = runtime.block_on(run(cli));
    // Every task and blocking thread of the runtime ends here; only then has the agent stopped.
    drop(runtime);
    if serving && result.is_ok() {
        tracing::info!("vmnet agent stopped");
    }
    finish(result).into()
}

async fn run(cli: Cli) -> Result<(), Error> {
    let g = &cli.global;
    match cli.command {
        // Each attempt is one transaction; one that failed on a deadlock or serialization
        // conflict with a concurrent writer (the agent) runs again.
        Command::Pool(c) => vmnet_ipam::retry(|| cli::ipam::pool(g, c.clone()))
            .await
            .map_err(from_ipam),
        Command::Host(c) => vmnet_ipam::retry(|| cli::ipam::host(g, c.clone()))
            .await
            .map_err(from_ipam),
        Command::Instance(c) => vmnet_ipam::retry(|| cli::ipam::instance(g, c.clone()))
            .await
            .map_err(from_ipam),
        Command::Lease(c) => vmnet_ipam::retry(|| cli::ipam::lease(g, c.clone()))
            .await
            .map_err(from_ipam),
        Command::Serve(a) => cli::serve::run(g, *a).await,
        Command::Client(_) => unreachable!("run above, without a runtime"),
        Command::Config(c) => cli::config::check(g, &c),
        Command::Completions(a) => cli::shell::completions(&a),
        Command::Man(a) => cli::shell::man(&a),
    }
}
