//! The `vmnet` binary's command line: the client commands run here; every other command is
//! handed, with its arguments untouched, to `vmnetd` beside this executable by `exec` (the
//! process id, its command line, its environment and its open files carry on), so
//! `vmnet serve` is the agent and `vmnet pool set …` the IPAM command, as `vmnetd` runs them.

use std::ffi::OsString;
use std::os::unix::process::CommandExt as _;

use clap::{Parser, Subcommand};
use vmnet_cli::{Status, report, usage_error};
use vmnet_model::Error;

use crate::client::{self, ClientCmd};
use crate::{AGENT_BINARY, Global, cli};

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

/// The commands: the client commands (`ClientCmd`'s, listed here again so that each is
/// deferred too) and the ones handed to `vmnetd`. Each command's arguments and subcommands are
/// added when that command is parsed (`defer`), not before: `vmnet vm put FILE` builds only
/// its own branch of the tree instead of every command's arguments with the global options
/// copied into each. The help is the same as `vmnetd`'s (`the_client_commands_are_vmnetds`).
#[derive(Debug, Subcommand)]
#[command(defer = true)]
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
    /// VM network configs held by the agent (namespace mode).
    #[command(subcommand)]
    Vm(cli::vm::VmCmd),
    /// The mesh's WireGuard interface (`vmnet serve --mesh`).
    #[command(subcommand)]
    Mesh(cli::mesh::MeshCmd),
    /// The agent's status.
    Status,
    /// What the agent does, one line per event: VMs applied, deleted or failed, drift
    /// repaired, firewall repairs, mesh peers, provider poll failures, spoof drops.
    Events(cli::events::EventsArgs),
    /// Apply a host spec (pools, instances and VMs in one file) declaratively.
    Apply(cli::vm::ApplyArgs),
    /// Print help for a command.
    #[command(disable_help_flag = true)]
    Help(Handed),
}

/// Runs the command line given to this process.
#[must_use]
pub fn main() -> Status {
    vmnet_cli::restore_sigpipe();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(&e),
    };
    let c = match cli.command {
        Command::Vm(c) => ClientCmd::Vm(c),
        Command::Mesh(c) => ClientCmd::Mesh(c),
        Command::Status => ClientCmd::Status,
        Command::Events(a) => ClientCmd::Events(a),
        Command::Apply(a) => ClientCmd::Apply(a),
        Command::Pool(_)
        | Command::Host(_)
        | Command::Instance(_)
        | Command::Lease(_)
        | Command::Serve(_)
        | Command::Config(_)
        | Command::Completions(_)
        | Command::Man(_)
        | Command::Help(_) => return hand_over(),
    };
    client::main(&cli.global, c)
}

/// Replaces this process with `vmnetd` beside it, given this process's own arguments.
fn hand_over() -> Status {
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

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    /// The help (`--help` and `-h`) of `cmd` and of every command under it, by command line.
    fn helps(cmd: &mut clap::Command, line: &str, out: &mut Vec<(String, String)>) {
        out.push((format!("{line} --help"), cmd.render_long_help().to_string()));
        out.push((format!("{line} -h"), cmd.render_help().to_string()));
        let names: Vec<String> = cmd
            .get_subcommands()
            .map(|s| s.get_name().to_owned())
            .collect();
        for name in names {
            if let Some(sub) = cmd.find_subcommand_mut(&name) {
                helps(sub, &format!("{line} {name}"), out);
            }
        }
    }

    #[test]
    fn the_client_commands_are_vmnetds() {
        let mut thin = super::Cli::command();
        thin.build();
        // `vmnet` has no `help` subcommands (`vmnet help …` is `vmnetd`'s).
        let mut full = crate::full::Cli::command().disable_help_subcommand(true);
        full.build();
        for name in ["vm", "mesh", "status", "events", "apply"] {
            let (mut ours, mut theirs) = (Vec::new(), Vec::new());
            helps(thin.find_subcommand_mut(name).unwrap(), name, &mut ours);
            helps(full.find_subcommand_mut(name).unwrap(), name, &mut theirs);
            assert!(ours.len() >= 2, "{name}");
            for (a, b) in ours.iter().zip(&theirs) {
                assert_eq!(a, b);
            }
            assert_eq!(ours.len(), theirs.len(), "{name}");
        }
    }
}
