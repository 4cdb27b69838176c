//! The `vmnet` command line, what a host runs, as two binaries built from this crate:
//!
//! - `vmnet`, the client an orchestrator calls once per VM: it runs the client commands (`vm`,
//!   `mesh`, `status`, `events`, `apply`) itself and hands every other command (`serve`, the IPAM
//!   commands) to `vmnetd` beside it by `exec`, so the same process id carries on. It links
//!   only the client's code, which keeps its start-up close to a bare process's.
//! - `vmnetd`, the whole command line: the agent (`serve`), the IPAM commands and the client
//!   commands.
//!
//! The sandbox and the benchmarks are the separate `vmnet-lab` binary; neither binary here
//! carries lab code. Errors print once, as `error: CODE: message` on stderr, and the process
//! exits with the code's documented exit status ([`vmnet_model::ErrorCode::exit_code`]), as
//! [`vmnet_cli`] does it.

pub mod cli;
pub mod client;
pub mod full;
mod global;
pub mod thin;

pub use global::Global;
pub use vmnet_cli::Output;

/// The file name of the binary that runs the agent and the IPAM commands, beside `vmnet`.
pub const AGENT_BINARY: &str = "vmnetd";
