//! `vmnet-lab sandbox-helper …` (hidden): the sandbox's background processes.
//!
//! - `relay`: attaches to a VM's tap as a VMM does and joins it to a simulated guest's `eth0`
//!   ([`crate::relay::Relay`]);
//! - `echo`: the fake internet's TCP/UDP echo service ([`crate::echo::EchoService`]);
//! - `uplink`: puts the sandbox's own routes on its uplinks back after a flap ([`crate::uplink`]).
//!
//! Each writes its `--ready-file` once it is set up and then runs until it is signalled.

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::echo::EchoService;
use crate::relay::Relay;
use clap::Subcommand;
use vmnet_model::Error;
use vmnet_model::error::chain;

/// `vmnet-lab sandbox-helper …`
#[derive(Debug, Subcommand)]
pub enum HelperCmd {
    /// Relay frames between a VM's tap and a simulated guest's eth0.
    Relay {
        /// The VM's namespace.
        #[arg(long)]
        vm_netns: String,
        /// The VM's persistent tap (attached to, never created).
        #[arg(long)]
        tap: String,
        /// The guest's namespace (gets a tap named --guest-if).
        #[arg(long)]
        guest_netns: String,
        /// The guest's interface name.
        #[arg(long, default_value = "eth0")]
        guest_if: String,
        /// Written once both taps are open.
        #[arg(long)]
        ready_file: PathBuf,
    },
    /// TCP and UDP echo (reporting the peer address and SYN MSS) inside a namespace.
    Echo {
        /// The namespace.
        #[arg(long)]
        netns: String,
        /// Addresses to listen on (TCP and UDP each); repeatable.
        #[arg(long, required = true)]
        listen: Vec<SocketAddr>,
        /// Written once every socket listens.
        #[arg(long)]
        ready_file: PathBuf,
    },
    /// Put the routes of uplinks back after they are flapped.
    Uplink {
        /// The namespace.
        #[arg(long)]
        netns: String,
        /// A link whose routes are kept; repeatable.
        #[arg(long, required = true)]
        link: Vec<String>,
        /// Written once it listens to link events.
        #[arg(long)]
        ready_file: PathBuf,
    },
}

fn ready(path: &PathBuf) -> Result<(), Error> {
    std::fs::write(path, format!("{}\n", std::process::id()))
        .map_err(|e| Error::internal(format!("ready file {}: {e}", path.display())))
}

/// Runs a helper until it is signalled.
///
/// # Errors
/// `INTERNAL` when it cannot be set up.
pub fn run(c: HelperCmd) -> Result<(), Error> {
    match c {
        HelperCmd::Relay {
            vm_netns,
            tap,
            guest_netns,
            guest_if,
            ready_file,
        } => {
            let relay = Relay::start(&vm_netns, &tap, &guest_netns, &guest_if).map_err(|e| {
                Error::internal(format!(
                    "relay {vm_netns}/{tap} -> {guest_netns}/{guest_if}: {}",
                    chain(&e)
                ))
            })?;
            ready(&ready_file)?;
            relay.wait();
        }
        HelperCmd::Echo {
            netns,
            listen,
            ready_file,
        } => {
            let svc = EchoService::start(&netns, &listen)
                .map_err(|e| Error::internal(format!("echo in {netns}: {}", chain(&e))))?;
            ready(&ready_file)?;
            svc.wait();
        }
        HelperCmd::Uplink {
            netns,
            link,
            ready_file,
        } => crate::uplink::run(&netns, &link, || ready(&ready_file))?,
    }
    Ok(())
}
