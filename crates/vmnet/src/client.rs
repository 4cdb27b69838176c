//! The client commands, the part of the command line that only talks to a running agent over
//! its socket. Both binaries run them; `vmnet` runs nothing else itself.

use clap::Subcommand;
use vmnet_cli::{Status, finish};
use vmnet_model::Error;

use crate::Global;
use crate::cli;

/// The client commands, flattened into `vmnetd`'s command list (`vmnet` lists the same
/// commands in its own, see `thin`).
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

/// Runs one client command and turns its result into the exit status.
///
/// A command that makes one call (`vm`, `mesh`, `status`) runs on this thread with blocking
/// reads and writes, without an async runtime: an orchestrator runs `vmnet vm put` once per VM,
/// and the runtime's set-up and its wake-ups would be most of the client's own work. `events`
/// (a stream) and `apply` (many calls) run on a runtime on this thread alone (no worker threads
/// to start, wake and join, and no signal driver: the client handles no signal).
#[must_use]
pub fn main(g: &Global, c: ClientCmd) -> Status {
    finish(match c {
        ClientCmd::Vm(c) => cli::vm::vm(g, c),
        ClientCmd::Mesh(c) => cli::mesh::mesh(g, c),
        ClientCmd::Status => cli::vm::status(g),
        ClientCmd::Events(a) => on_runtime(cli::events::events(g, a)),
        ClientCmd::Apply(a) => on_runtime(cli::vm::apply(g, a)),
    })
}

/// Runs `command` to its end on a runtime on this thread.
fn on_runtime(command: impl Future<Output = Result<(), Error>>) -> Result<(), Error> {
    tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .map_err(|e| Error::internal(format!("cannot start the runtime: {e}")))?
        .block_on(command)
}
