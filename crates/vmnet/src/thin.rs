//! The `vmnet` binary's command line: the client commands run here; every other command is
//! handed, with its arguments untouched, to `vmnetd` beside this executable by `exec` (the
//! process id, its command line, its environment and its open files carry on), so
//! `vmnet serve` is the agent and `vmnet pool set …` the IPAM command, as `vmnetd` runs them.

use std::ffi::OsString;
use std::os::unix::process::CommandExt as _;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use vmnet_cli::{report, usage_error};
use vmnet_model::Error;

use crate::client::{self, ClientCmd};
use crate::{AGENT_BINARY, Global};

#[derive(Debug, Parser)]
#[command(
    name = "vmnet",
    version,
    about = "Host networking for virtual machines",
    disable_help_subcommand = true
)]
struct Cli {
    #[command(flatten)]
    global: Global,
    #[command(subcommand)]
    command: Command,
}

/// Everything after the command's name, handed to `vmnetd` (its `--help` included).
#[derive(Debug, clap::Args)]
struct Handed {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, num_args = 0.., hide = true)]
    args: Vec<OsString>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Pool ranges (IPAM).
    #[command(disable_help_flag = true)]
    Pool(Handed),
    /// Hosts and their capacity.
    #[command(disable_help_flag = true)]
    Host(Handed),
    /// Instances: placement with a lease.
    #[command(disable_help_flag = true)]
    Instance(Handed),
    /// Leases of a pool.
    #[command(disable_help_flag = true)]
    Lease(Handed),
    /// Run the agent: HTTP API on a unix socket and the reconcile loop.
    #[command(disable_help_flag = true)]
    Serve(Handed),
    /// The agent's configuration file (/etc/vmnet/vmnet.toml).
    #[command(disable_help_flag = true)]
    Config(Handed),
    /// Print a shell completion script (bash, zsh, fish) on stdout.
    #[command(disable_help_flag = true)]
    Completions(Handed),
    /// Write the manual pages (vmnet.1 and one per subcommand) into a directory.
    #[command(disable_help_flag = true)]
    Man(Handed),
    #[command(flatten)]
    Client(ClientCmd),
    /// Print help for a command.
    #[command(disable_help_flag = true)]
    Help(Handed),
}

/// Runs the command line given to this process.
#[must_use]
pub fn main() -> ExitCode {
    vmnet_cli::restore_sigpipe();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(&e),
    };
    match cli.command {
        Command::Client(c) => client::main(&cli.global, c),
        _ => hand_over(),
    }
}

/// Replaces this process with `vmnetd` beside it, given this process's own arguments.
fn hand_over() -> ExitCode {
    let agent = match std::env::current_exe() {
        Ok(exe) => exe.with_file_name(AGENT_BINARY),
        Err(e) => {
            return report(&Error::internal(format!(
                "cannot find this executable: {e}"
            )));
        }
    };
    // The command line stays the one that was typed (`ps` and `/proc/PID/cmdline` show
    // `vmnet serve …`); only the executable changes.
    let mut args = std::env::args_os();
    let mut cmd = std::process::Command::new(&agent);
    if let Some(arg0) = args.next() {
        cmd.arg0(arg0);
    }
    let e = cmd.args(args).exec();
    report(&Error::unavailable(format!(
        "cannot run {}: {e} (vmnet runs the agent and the IPAM commands from {AGENT_BINARY} \
         beside it)",
        agent.display()
    )))
}
