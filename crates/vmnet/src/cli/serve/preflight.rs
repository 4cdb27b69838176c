//! The checks of `vmnet serve`'s flags that need nothing started: run by `serve` before it
//! binds its socket or touches the kernel, and by `vmnet config check` on a configuration file.

use vmnet_agent::server::Access;
use vmnet_agent::worker::WorkerUser;
use vmnet_model::Error;
use vmnet_model::pool::ProviderRules;
use vmnet_plan::ns::NsSettings;

use super::ServeArgs;
use crate::Global;

/// What the flags resolve to once checked.
#[derive(Debug)]
pub struct Checked {
    /// The namespace-mode settings.
    pub settings: NsSettings,
    /// Who may use the API socket.
    pub access: Access,
    /// The rules for provider pools.
    pub rules: ProviderRules,
}

/// Checks every flag as `serve` does before it starts anything: the namespace-mode settings,
/// the socket group and the worker's user (looked up in the user database), the provider rules,
/// and the mesh's address and registry rules. The `--uplink` interface is checked by `serve`
/// once it is in `--netns` ([`check_uplink`]).
///
/// # Errors
/// `INVALID_INPUT` naming the flag and the value.
pub fn preflight(_g: &Global, args: &ServeArgs) -> Result<Checked, Error> {
    let settings = args.settings()?;
    let access = args.trust.access()?;
    let rules = args.trust.provider_rules()?;
    // The worker runs for the metadata service and for provider polls.
    if !args.no_metadata || args.poll_providers {
        WorkerUser::lookup(&args.trust.worker_user).map_err(Error::invalid)?;
    }
    if let Some(a) = args.mesh_address
        && !vmnet_agent::mesh::body::mesh_range().contains(&a)
    {
        return Err(Error::invalid(format!(
            "--mesh-address {a}: not in {}",
            vmnet_agent::mesh::body::mesh_range()
        )));
    }
    if args.mesh_registry.is_some() && (args.mesh_bpf_root.is_none() || args.mesh_address.is_none())
    {
        return Err(Error::invalid(
            "--mesh-registry needs --mesh-bpf-root and --mesh-address (registrations feed the data plane)",
        ));
    }
    Ok(Checked {
        settings,
        access,
        rules,
    })
}

/// Checks that the `--uplink` interface exists in the namespace the agent runs in (after
/// `--netns`), before the agent touches anything: a mistyped name would otherwise surface only
/// when the first VM's public address is proxied on it.
///
/// # Errors
/// `INVALID_INPUT` naming the flag and the interface (also for the loopback device).
pub fn check_uplink(uplink: Option<&str>) -> Result<(), Error> {
    /// The loopback device's ifindex, the same in every network namespace.
    const LOOPBACK_IFINDEX: u32 = 1;
    let Some(u) = uplink else { return Ok(()) };
    let index = nix::net::if_::if_nametoindex(u).map_err(|e| {
        Error::invalid(format!(
            "--uplink {u}: no interface of that name in the agent's network namespace ({e})"
        ))
    })?;
    if index == LOOPBACK_IFINDEX {
        return Err(Error::invalid(format!(
            "--uplink {u}: the loopback device is not an uplink (no neighbour answers there reach anyone)"
        )));
    }
    Ok(())
}
