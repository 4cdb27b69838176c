//! Opening a tap the way a VMM does: `open("/dev/net/tun")` and `TUNSETIFF` with
//! `IFF_TAP | IFF_NO_PI`, from a thread inside the tap's namespace.
//!
//! Attaching to an existing persistent tap (made by the agent for the VMM) and creating a
//! non-persistent one (a simulated guest's `eth0`, gone when the last descriptor closes) are the
//! same call; [`open_existing_tap`] checks that the tap exists first, so a typo never silently
//! creates a new device.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;

use crate::{SandboxError, netns};

/// `struct ifreq` as `TUNSETIFF` reads it: the name, the flags, padding to 40 bytes.
#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    pad: [u8; 22],
}

/// Opens (or creates) the tap `name` in the calling thread's namespace with `IFF_TAP |
/// IFF_NO_PI` (plus `IFF_MULTI_QUEUE` when `multi_queue`).
fn tunsetiff(name: &str, multi_queue: bool) -> std::io::Result<File> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("bad interface name {name:?}"),
        ));
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open("/dev/net/tun")?;
    let mut req = IfReq {
        name: [0; libc::IFNAMSIZ],
        flags: 0,
        pad: [0; 22],
    };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    let mut flags = libc::IFF_TAP | libc::IFF_NO_PI;
    if multi_queue {
        flags |= libc::IFF_MULTI_QUEUE;
    }
    req.flags = libc::c_short::try_from(flags).unwrap_or_default();
    // SAFETY: `file` is an open /dev/net/tun descriptor and `req` is a properly laid out ifreq
    // that lives for the whole call; TUNSETIFF reads it and writes the final name back into it.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &raw mut req) };
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(file)
    }
}

/// Attaches to the existing tap `name` in namespace `ns`, as a VMM does. Tries a single-queue
/// attach first and a multi-queue one when the tap was made multi-queue.
///
/// # Errors
/// When the tap does not exist in `ns` or cannot be attached (e.g. another process holds its
/// only queue: `EBUSY`).
pub fn open_existing_tap(ns: &str, name: &str) -> Result<File, SandboxError> {
    let what = format!("netns {ns}: attach to tap {name}");
    netns::run_in(ns, || {
        if nix::net::if_::if_nametoindex(name).is_err() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no such interface",
            ));
        }
        match tunsetiff(name, false) {
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => tunsetiff(name, true),
            other => other,
        }
    })?
    .map_err(|e| SandboxError::io(what, e))
}

/// Creates a non-persistent tap `name` in namespace `ns` and returns its descriptor; the device
/// disappears when the descriptor closes.
///
/// # Errors
/// When a device with that name exists or the tap cannot be created.
pub fn create_tap(ns: &str, name: &str) -> Result<File, SandboxError> {
    let what = format!("netns {ns}: create tap {name}");
    netns::run_in(ns, || {
        if nix::net::if_::if_nametoindex(name).is_ok() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "interface exists",
            ));
        }
        tunsetiff(name, false)
    })?
    .map_err(|e| SandboxError::io(what, e))
}
