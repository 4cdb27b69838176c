//! Taps opened the way a VMM opens them, inside a named namespace: a thin wrapper that runs
//! [`vmnet_kernel::tap`] on a thread inside the namespace.
//!
//! [`open_existing_tap`] attaches to a persistent tap the agent made for the VMM and fails when
//! there is none (a typo never silently creates a device); [`create_tap`] makes a
//! non-persistent one (a simulated guest's `eth0`, gone when the last descriptor closes). Both
//! take the descriptor's [`Framing`] (plain frames, or virtio-net headers with offloads).

use std::fs::File;

use vmnet_kernel::tap;
pub use vmnet_kernel::tap::Framing;

use crate::{SandboxError, netns};

/// Attaches to the existing tap `name` in namespace `ns`, as a VMM does, with plain frames
/// ([`tap::open`]).
///
/// # Errors
/// As [`open_existing_tap_with`].
pub fn open_existing_tap(ns: &str, name: &str) -> Result<File, SandboxError> {
    open_existing_tap_with(ns, name, Framing::Plain)
}

/// Attaches to the existing tap `name` in namespace `ns`, as a VMM does, with `framing`
/// ([`tap::open_with`]).
///
/// # Errors
/// When the tap does not exist in `ns` or cannot be attached (e.g. another process holds its
/// only queue: `EBUSY`).
pub fn open_existing_tap_with(
    ns: &str,
    name: &str,
    framing: Framing,
) -> Result<File, SandboxError> {
    netns::run_in(ns, || tap::open_with(name, framing))?
        .map_err(|e| SandboxError::io(format!("netns {ns}: attach to tap {name}"), e.source))
}

/// Creates a non-persistent tap `name` in namespace `ns` with `framing` and returns its
/// descriptor; the device disappears when the descriptor closes ([`tap::create_transient_with`]).
///
/// # Errors
/// When a device with that name exists or the tap cannot be created.
pub fn create_tap(ns: &str, name: &str, framing: Framing) -> Result<File, SandboxError> {
    netns::run_in(ns, || tap::create_transient_with(name, framing))?
        .map_err(|e| SandboxError::io(format!("netns {ns}: create tap {name}"), e.source))
}
