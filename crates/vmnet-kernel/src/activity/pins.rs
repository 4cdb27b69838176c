//! The bpffs root the activity program and maps are pinned under.

use std::path::Path;

use aya::programs::SchedClassifier;
use nix::mount::{MntFlags, umount2};

use super::ActivityError;

/// What this module pins under the root.
const PINS: [&str; 3] = [
    super::DEV_MAP,
    super::LAST_MAP,
    vmnet_plan::ns::activity::PROGRAM,
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

/// Pins the loaded program at `<root>/<name>`, replacing an earlier agent's pin.
pub(super) fn pin_program(root: &Path, prog: &mut SchedClassifier) -> Result<(), ActivityError> {
    let path = root.join(vmnet_plan::ns::activity::PROGRAM);
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(root_err(root, format!("unpin the old program: {e}"))),
    }
    prog.pin(&path)
        .map_err(|e| root_err(root, format!("pin the program: {e}")))
}

/// Removes every pin under `root` and, when a bpffs is mounted on `root` itself, unmounts it and
/// removes the directory (tests, and a host giving up activity recording). Filters still
/// attached keep their program and maps alive until their devices go.
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
            let path = root.join(name);
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(root_err(root, format!("unpin {}: {e}", path.display()))),
            }
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
