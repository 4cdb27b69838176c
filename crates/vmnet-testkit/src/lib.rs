//! Test-only helpers: sandbox namespaces, cleanup guards, traffic checks, PostgreSQL cluster.
//!
//! Everything here works inside throwaway network namespaces and never changes the network
//! configuration of the namespace the test process runs in.
//!
//! - [`sandbox::Sandbox`]: a sandbox host namespace and a fake internet namespace joined by an
//!   uplink veth (documentation addresses), plus extra namespaces, all deleted on `Drop`.
//! - [`echo::EchoService`]: TCP and UDP echo threads inside a namespace that report the peer
//!   address they saw and the MSS of the TCP SYN.
//! - [`relay::Relay`] and [`guest`]: a simulated guest joined to a VM's tap by a frame relay
//!   that opens the tap the way a VMM does.
//! - [`traffic`]: TCP/UDP echo clients, ICMP ping and command runs inside a namespace, each with
//!   a timeout.
//! - [`ra::RouterAdvertiser`]: a router sending IPv6 router advertisements (SLAAC) on a link.
//! - [`nft::Target`]: hand edits of an nft table (rule deleted, added, changed; chain deleted;
//!   policy flipped; table deleted) for drift tests.
//!
//! # Design
//! Namespaces are named (`/run/netns/<name>`) and made with `ip netns add`, so `ip -n` works on
//! them. Code that must run inside one runs on a dedicated thread that called `setns(2)`; the
//! calling thread never changes namespace. This crate does not depend on `vmnet-kernel`, so the
//! kernel crate's tests can use it.
//!
//! # Limitations
//! Needs root (`CAP_NET_ADMIN`, `CAP_SYS_ADMIN` for `setns`). Call [`require_root`] first in
//! every privileged test so it fails with a clear message instead of a confusing one.

pub mod echo;
pub mod guest;
pub mod netns;
pub mod nft;
pub mod postgres;
pub mod ra;
pub mod relay;
pub mod sandbox;
pub mod tap;
pub mod traffic;

mod error;

pub use error::TestkitError;
pub use sandbox::Sandbox;

/// Panics with a clear message unless the process runs as root. Privileged tests call this
/// first, so they fail (never silently pass) when they cannot run.
///
/// # Panics
/// When the effective user id is not 0.
pub fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test needs root (it creates network namespaces): run it as root, e.g. sudo -E cargo test"
    );
}
