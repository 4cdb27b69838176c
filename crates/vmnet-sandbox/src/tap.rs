//! Taps opened the way a VMM opens them, inside a named namespace: a thin wrapper that runs
//! [`vmnet_kernel::tap`] on a thread inside the namespace.
//!
//! [`open_existing_tap`] attaches to a persistent tap the agent made for the VMM and fails when
//! there is none (a typo never silently creates a device); [`create_tap`] makes a
//! non-persistent one (a simulated guest's `eth0`, gone when the last descriptor closes).

use std::fs::File;

use vmnet_kernel::tap;

use crate::{SandboxError, netns};

/// Attaches to the existing tap `name` in namespace `ns`, as a VMM does
/// ([`tap::open`]).
///
/// # Errors
/// When the tap does not exist in `ns` or cannot be attached (e.g. another process holds its
/// only queue: `EBUSY`).
pub fn open_existing_tap(ns: &str, name: &str) -> Result<File, SandboxError> {
    netns::run_in(ns, || tap::open(name))?
        .map_err(|e| SandboxError::io(format!("netns {ns}: attach to tap {name}"), e.source))
}

/// Creates a non-persistent tap `name` in namespace `ns` and returns its descriptor; the device
/// disappears when the descriptor closes ([`tap::create_transient`]).
///
/// # Errors
/// When a device with that name exists or the tap cannot be created.
pub fn create_tap(ns: &str, name: &str) -> Result<File, SandboxError> {
    netns::run_in(ns, || tap::create_transient(name))?
        .map_err(|e| SandboxError::io(format!("netns {ns}: create tap {name}"), e.source))
}
