//! `vmnet-pool-helper`: the root helper for pool-mode nftables. Started by the agent with its
//! socket as descriptor 3 (see `vmnet_agent::pool::helper`); serves until the agent closes it.
//! The target namespace, if any, comes from `VMNET_HELPER_NETNS`.

use std::process::ExitCode;

fn main() -> ExitCode {
    let netns = std::env::var("VMNET_HELPER_NETNS")
        .ok()
        .filter(|s| !s.is_empty());
    match vmnet_agent::pool::helper::main_from_fd(netns.as_deref()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vmnet-pool-helper: {e}");
            ExitCode::FAILURE
        }
    }
}
