//! What the BPF drivers (the tap guard, the mesh data plane, packet activity) share: the bpffs
//! their programs and maps are pinned on, and map updates that tolerate a missing key.

use std::path::Path;

use nix::mount::{MsFlags, mount};

/// Whether `dir` is a mounted bpffs.
#[must_use]
pub fn is_bpffs(dir: &Path) -> bool {
    nix::sys::statfs::statfs(dir)
        .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::BPF_FS_MAGIC)
}

/// Mounts a bpffs instance (mode 0700, nosuid, nodev, noexec) at `dir`, created when missing,
/// unless one is there already.
///
/// # Errors
/// The `mkdir` or `mount` error.
pub fn mount_bpffs(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    if is_bpffs(dir) {
        return Ok(());
    }
    mount(
        Some("bpf"),
        dir,
        Some("bpf"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some("mode=0700"),
    )
    .map_err(std::io::Error::from)
}

/// `r`, with "no such key" (the element was already gone) counted as success.
pub(crate) fn ignore_missing(
    r: Result<(), aya::maps::MapError>,
) -> Result<(), aya::maps::MapError> {
    match r {
        Err(aya::maps::MapError::KeyNotFound) => Ok(()),
        Err(aya::maps::MapError::SyscallError(e))
            if e.io_error.raw_os_error() == Some(libc::ENOENT) =>
        {
            Ok(())
        }
        other => other,
    }
}
