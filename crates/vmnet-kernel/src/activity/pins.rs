//! The bpffs root the activity program's link and maps are pinned under.

use std::path::Path;

use aya::programs::links::FdLink;
use nix::mount::{MntFlags, umount2};

use super::ActivityError;

/// The pin of the program's link to the tracepoint.
const LINK: &str = "activity_link";

/// The pin a new link gets before it is renamed to [`LINK`] (bpffs allows no dot in a name).
const LINK_NEW: &str = "activity_link_new";

/// Pins of earlier versions (the per-tap filter's program and its device map).
const LEGACY: [&str; 2] = [vmnet_plan::ns::activity::LEGACY_PROGRAM, "activity_dev"];

/// What this module pins under the root, earlier versions' pins included.
const PINS: [&str; 6] = [
    super::VM_MAP,
    super::LAST_MAP,
    LINK,
    LINK_NEW,
    LEGACY[0],
    LEGACY[1],
];

fn root_err(root: &Path, what: impl Into<String>) -> ActivityError {
    ActivityError::Root {
        path: root.to_owned(),
        what: what.into(),
    }
}

/// Creates `root` and mounts a bpffs on it when it is not on one already.
pub(super) fn prepare_root(root: &Path) -> Result<(), ActivityError> {
    crate::bpffs::mount_bpffs(root).map_err(|e| root_err(root, format!("mount bpffs: {e}")))
}

fn unpin(root: &Path, name: &str) -> Result<(), ActivityError> {
    match std::fs::remove_file(root.join(name)) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(root_err(root, format!("unpin {name}: {e}"))),
    }
}

/// Removes the pins of earlier versions' per-tap filter. Filters still on taps keep their
/// program and map until they are deleted.
pub(super) fn remove_legacy(root: &Path) -> Result<(), ActivityError> {
    LEGACY.iter().try_for_each(|name| unpin(root, name))
}

/// Pins `link` at `<root>/activity_link`, replacing an earlier agent's pin in one step (a
/// rename): until then both programs record, after it the earlier link has no holder left and
/// the kernel detaches it.
pub(super) fn pin_link(root: &Path, link: FdLink) -> Result<(), ActivityError> {
    unpin(root, LINK_NEW)?;
    // Dropping the pinned link closes this process's descriptor; the pin holds the link.
    drop(
        link.pin(root.join(LINK_NEW))
            .map_err(|e| root_err(root, format!("pin the program's link: {e}")))?,
    );
    std::fs::rename(root.join(LINK_NEW), root.join(LINK))
        .map_err(|e| root_err(root, format!("replace the link pin: {e}")))
}

/// Removes the link's pin: `Ok(false)` when there was none.
pub(super) fn unpin_link(root: &Path) -> Result<bool, ActivityError> {
    let there = root.join(LINK).exists();
    unpin(root, LINK)?;
    Ok(there)
}

/// The id of the program the link pinned under `root` runs: `None` when there is no pin (or
/// it is not a link).
pub(super) fn linked_program(root: &Path) -> Option<u32> {
    let pinned = aya::programs::links::PinnedLink::from_pin(root.join(LINK)).ok()?;
    FdLink::from(pinned).info().ok().map(|i| i.program_id())
}

/// Removes every pin under `root` and, when a bpffs is mounted on `root` itself, unmounts it and
/// removes the directory (tests, and a host giving up activity recording). With its link's pin
/// gone, the program is detached once no agent holds it.
///
/// # Errors
/// [`ActivityError::Root`] naming what could not be removed.
pub fn remove_root(root: &Path) -> Result<(), ActivityError> {
    if !root.exists() {
        return Ok(());
    }
    if crate::bpffs::is_bpffs(root) {
        // Only our pins: a fresh bpffs also holds the kernel's own `maps.debug` and
        // `progs.debug` (bpf_preload), which cannot be unlinked and go with the unmount.
        for name in PINS {
            unpin(root, name)?;
        }
        let parent_bpffs = root.parent().is_some_and(crate::bpffs::is_bpffs);
        if !parent_bpffs {
            umount2(root, MntFlags::MNT_DETACH)
                .map_err(|e| root_err(root, format!("unmount: {e}")))?;
        }
    }
    match std::fs::remove_dir(root) {
        Ok(()) => Ok(()),
        // Pins of others stay, and so does the directory.
        Err(e) if e.raw_os_error() == Some(libc::ENOTEMPTY) => Ok(()),
        Err(e) => Err(root_err(root, format!("remove: {e}"))),
    }
}
