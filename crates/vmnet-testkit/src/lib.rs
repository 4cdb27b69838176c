//! Test-only fixtures. A dev-dependency of every crate's tests, never a dependency of a shipped
//! binary (`cargo tree -p vmnet -e normal` shows no `vmnet-testkit`).
//!
//! The namespaces, guests, echo services and traffic checks are the sandbox's own
//! ([`vmnet_sandbox`]); this crate re-exports them under the paths the tests use and adds what
//! only tests need: [`require_root`], [`ra::RouterAdvertiser`] (a router sending IPv6 router
//! advertisements for SLAAC on a link), [`nft::Target`] (hand edits of an nft table for drift
//! tests) and [`bpf::mesh_object`] (another build of the mesh programs).

pub use vmnet_sandbox::{
    Fleet, Sandbox, SandboxError, agent, echo, fleet, guest, hostile, mesh_lab, mmds, netns,
    postgres, probe, relay, sandbox, sim_guest, tap, traffic, udpstat,
};

pub mod bpf;
pub mod nft;
pub mod ra;

/// Panics with a clear message unless the process runs as root. Privileged tests call this
/// first, so they fail (never silently pass) when they cannot run.
///
/// # Panics
/// When the effective user id is not 0.
pub fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test needs root (it creates network namespaces): run it as root with `cargo test -- --include-ignored`, as scripts/test.sh does"
    );
}
