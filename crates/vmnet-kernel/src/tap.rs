//! The one place vmnet talks to `/dev/net/tun`: creating a persistent tap for a VMM, opening an
//! existing tap the way a VMM does, and creating a throwaway tap (a simulated guest's `eth0`).
//!
//! Every call works in the calling thread's network namespace (the tun driver creates and looks
//! up the device there), so callers that work on another namespace run these on a thread inside
//! it ([`crate::netns::run_in`]). All taps are `IFF_TAP | IFF_NO_PI`, single queue; whether a
//! VMM asks for `IFF_VNET_HDR` is the VMM's choice when it opens the tap.
//!
//! # Design
//! The ioctls (`TUNSETIFF`, `TUNSETOWNER`, `TUNSETGROUP`, `TUNSETPERSIST`) go through the `tun`
//! crate. Attaching to an existing tap and creating a new one are the same `TUNSETIFF` call, so
//! [`open`] checks that the tap exists first (a typo never silently creates a device) and
//! [`create_transient`] that it does not.
//!
//! # Limitations
//! No multi-queue taps: the `tun` crate refuses more than one queue on Linux, and nothing in
//! vmnet makes one (the kernel refuses a single-queue opener on a multi-queue tap with
//! `EINVAL`, which [`open`] reports).

use std::fs::File;
use std::os::fd::{FromRawFd, IntoRawFd};

/// Who may open the tap besides root (the VMM's user and group).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TapOwner {
    /// TUNSETOWNER.
    pub uid: Option<u32>,
    /// TUNSETGROUP.
    pub gid: Option<u32>,
}

/// A failed step on a tap; the caller names the tap.
#[derive(Debug, thiserror::Error)]
#[error("{op}")]
pub struct TapIoError {
    /// The ioctl or step, e.g. `TUNSETIFF`.
    pub op: &'static str,
    /// The OS error.
    #[source]
    pub source: std::io::Error,
}

fn fail(op: &'static str) -> impl FnOnce(tun::Error) -> TapIoError {
    move |e| TapIoError {
        op,
        source: match e {
            tun::Error::Io(io) => io,
            other => std::io::Error::new(std::io::ErrorKind::InvalidInput, other),
        },
    }
}

fn io_fail(op: &'static str, kind: std::io::ErrorKind, msg: &str) -> TapIoError {
    TapIoError {
        op,
        source: std::io::Error::new(kind, msg.to_owned()),
    }
}

/// `open("/dev/net/tun")` and `TUNSETIFF` with `IFF_TAP | IFF_NO_PI` for `name` (attaches when
/// the tap exists, creates it otherwise).
fn tunsetiff(name: &str) -> Result<tun::Device, TapIoError> {
    const OP: &str = "open /dev/net/tun, TUNSETIFF";
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        return Err(io_fail(
            OP,
            std::io::ErrorKind::InvalidInput,
            "bad interface name",
        ));
    }
    let mut cfg = tun::Configuration::default();
    cfg.tun_name(name)
        .layer(tun::Layer::L2)
        .platform_config(|p| {
            // Only TUNSETIFF: no address, MTU or up (the caller does those over netlink).
            p.ensure_root_privileges(false);
        });
    tun::create(&cfg).map_err(fail(OP))
}

/// The descriptor of an attached tap as a plain file (read and write whole frames).
fn into_file(dev: tun::Device) -> File {
    // SAFETY: `into_raw_fd` hands over the tap descriptor (the device closes only its control
    // socket), so the file is its sole owner.
    unsafe { File::from_raw_fd(dev.into_raw_fd()) }
}

fn exists(name: &str) -> bool {
    nix::net::if_::if_nametoindex(name).is_ok()
}

/// Makes the tap `name` exist and persist in the calling thread's namespace, owned by `owner`,
/// then closes it. An existing tap of that name is attached and updated instead (idempotent).
/// Owner and group are set before the tap is made persistent, so a failure leaves no new tap.
///
/// # Errors
/// The failed step and its OS error (e.g. `EBUSY` when a VMM holds a tap of another kind).
pub fn create_persistent(name: &str, owner: TapOwner) -> Result<(), TapIoError> {
    let mut dev = tunsetiff(name)?;
    // The kernel reads the id as a `uid_t`/`gid_t`: pass the bits through unchanged.
    if let Some(uid) = owner.uid {
        dev.user(uid.cast_signed()).map_err(fail("TUNSETOWNER"))?;
    }
    if let Some(gid) = owner.gid {
        dev.group(gid.cast_signed()).map_err(fail("TUNSETGROUP"))?;
    }
    dev.persist().map_err(fail("TUNSETPERSIST"))
}

/// Attaches to the existing tap `name` in the calling thread's namespace, as a VMM does.
///
/// # Errors
/// `NotFound` when there is no such interface; the OS error when it cannot be attached (e.g.
/// `EBUSY` when another process holds its only queue).
pub fn open(name: &str) -> Result<File, TapIoError> {
    if !exists(name) {
        return Err(io_fail(
            "look up",
            std::io::ErrorKind::NotFound,
            "no such interface",
        ));
    }
    tunsetiff(name).map(into_file)
}

/// Creates the non-persistent tap `name` in the calling thread's namespace and returns its
/// descriptor; the device disappears when the descriptor closes.
///
/// # Errors
/// `AlreadyExists` when a device of that name exists; the OS error when it cannot be created.
pub fn create_transient(name: &str) -> Result<File, TapIoError> {
    if exists(name) {
        return Err(io_fail(
            "look up",
            std::io::ErrorKind::AlreadyExists,
            "interface exists",
        ));
    }
    tunsetiff(name).map(into_file)
}
