//! A VM's entry in the program's map: its key (the inode number of the VM's netns) and value.

use super::ActivityError;

/// One VM as the program knows it (the value of [`super::VM_MAP`], keyed by the inode number of the
/// VM's netns): `struct vm` of `bpf/activity.bpf.c`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmEntry {
    /// The VM's user id.
    pub uid: u32,
    /// The ifindex of the VM's veth end (in the VM netns).
    pub veth: u32,
    /// The ifindex of the VM's tap (in the VM netns).
    pub tap: u32,
}

// SAFETY: three `u32`s, `repr(C)`, no padding: every bit pattern is a valid value.
unsafe impl aya::Pod for VmEntry {}

/// A registration to write: the inode number of the VM's netns and its entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registration {
    /// The inode number of the VM's netns ([`netns_inode`]).
    pub netns: u32,
    /// What it maps to.
    pub entry: VmEntry,
}

/// The inode number of the named netns `name` (what the program reads from a device's
/// namespace): one `stat` of its bind mount.
///
/// # Errors
/// [`ActivityError::NetnsInode`] when the namespace is not there.
pub fn netns_inode(name: &str) -> Result<u32, ActivityError> {
    use std::os::unix::fs::MetadataExt as _;
    let err = |source| ActivityError::NetnsInode {
        netns: name.to_owned(),
        source,
    };
    let ino = std::fs::metadata(crate::netns::path(name))
        .map_err(err)?
        .ino();
    u32::try_from(ino).map_err(|_| {
        err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("inode number {ino} does not fit in 32 bits"),
        ))
    })
}
