//! The client commands, the part of the command line that only talks to a running agent over
//! its socket. Both binaries run them; `vmnet` runs nothing else itself.

use std::process::ExitCode;

use clap::Subcommand;
use vmnet_cli::{finish, report};
use vmnet_model::Error;

use crate::Global;
use crate::cli;

/// The client commands, flattened into both binaries' command lists.
#[derive(Debug, Subcommand)]
pub enum ClientCmd {
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
}

/// Runs one client command.
///
/// # Errors
/// The agent's error, or `UNAVAILABLE` when it cannot be reached.
pub async fn run(g: &Global, c: ClientCmd) -> Result<(), Error> {
    match c {
        ClientCmd::Vm(c) => cli::vm::vm(g, c).await,
        ClientCmd::Mesh(c) => cli::mesh::mesh(g, c).await,
        ClientCmd::Status => cli::vm::status(g).await,
        ClientCmd::Events(a) => cli::events::events(g, a).await,
        ClientCmd::Apply(a) => cli::vm::apply(g, a).await,
    }
}

/// Runs one client command on this thread alone (one short exchange with the agent: no worker
/// threads to start, wake and join, and no signal driver: the client handles no signal) and
/// turns its result into the exit status.
#[must_use]
pub fn main(g: &Global, c: ClientCmd) -> ExitCode {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build();
    match runtime {
        Ok(rt) => finish(rt.block_on(run(g, c))),
        Err(e) => report(&Error::internal(format!("cannot start the runtime: {e}"))),
    }
}
