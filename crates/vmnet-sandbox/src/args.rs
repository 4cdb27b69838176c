//! The arguments of `vmnet-lab up --sandbox` and `vmnet-lab down --sandbox`, and their defaults.

use std::path::PathBuf;

/// The default sandbox name (and name prefix).
pub const DEFAULT_NAME: &str = "vmsbx";
/// Where sandbox state directories live.
pub const DEFAULT_ROOT: &str = "/run/vmnet-sandbox";

/// Arguments of `vmnet-lab up`.
#[derive(Debug, clap::Args)]
pub struct UpArgs {
    /// Run in a sandbox: throwaway namespaces, a fake internet, and guests on the VMs' taps
    /// (simulated, or real with `--guests kvm`) (required; no other mode exists).
    #[arg(long)]
    pub sandbox: bool,
    /// The host spec to apply (the default falls back to the built-in copy of
    /// `examples/host.json` when run outside the repository); a file with `"mode": "pool"`
    /// runs the pool sandbox, one with `"mode": "fleet"` the multi-host sandbox.
    #[arg(default_value = DEFAULT_HOST_SPEC)]
    pub host_spec: PathBuf,
    /// The sandbox name: the name prefix of every namespace and link in it (lowercase letters
    /// and digits, a letter first, at most 10 bytes; 9 for a fleet).
    #[arg(long, default_value = DEFAULT_NAME)]
    pub name: String,
    /// Where the sandbox's state directory is made.
    #[arg(long, default_value = DEFAULT_ROOT)]
    pub root: PathBuf,
    /// How long to wait for the agent and for the VMs to be applied, seconds.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub timeout_secs: u64,
    /// The guests on the VMs' taps: `sim` (namespaces joined by a frame relay) or `kvm` (real
    /// Linux guests under qemu, booted from `scripts/guest-image.sh`'s image; pool-mode and
    /// namespace-mode specs, not fleet specs).
    #[arg(long, value_enum, default_value_t = crate::kvm::GuestKind::Sim)]
    pub guests: crate::kvm::GuestKind,
    /// One more flag of every agent `up` starts, appended to its `vmnet serve` command line
    /// (repeatable; a value goes after `=`, e.g. `--agent-arg=--firewall-audit-secs=5`). The
    /// flags `up` sets itself (socket, state directory, database, namespace, name prefix,
    /// uplink, …) are refused.
    #[arg(
        long = "agent-arg",
        value_name = "FLAG[=VALUE]",
        allow_hyphen_values = true
    )]
    pub agent_args: Vec<String>,
}

/// Arguments of `vmnet-lab down`.
#[derive(Debug, clap::Args)]
pub struct DownArgs {
    /// Remove the sandbox made by `vmnet-lab up --sandbox` (required).
    #[arg(long)]
    pub sandbox: bool,
    /// The sandbox name.
    #[arg(long, default_value = DEFAULT_NAME)]
    pub name: String,
    /// Where the sandbox's state directory is.
    #[arg(long, default_value = DEFAULT_ROOT)]
    pub root: PathBuf,
}

/// The default host spec, compiled in for when `vmnet-lab up --sandbox` runs outside the repository.
pub(crate) const EMBEDDED_HOST_SPEC: &str = include_str!("../../../examples/host.json");
/// The default host spec path.
pub(crate) const DEFAULT_HOST_SPEC: &str = "examples/host.json";
