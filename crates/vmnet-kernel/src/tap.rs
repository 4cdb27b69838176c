//! The one place vmnet talks to `/dev/net/tun`: creating a persistent tap for a VMM, opening an
//! existing tap the way a VMM does, and creating a throwaway tap (a simulated guest's `eth0`).
//!
//! Every call works in the calling thread's network namespace (the tun driver creates and looks
//! up the device there), so callers that work on another namespace run these on a thread inside
//! it ([`crate::netns::run_in`]). All taps are `IFF_TAP | IFF_NO_PI`, single queue; whether a
//! VMM asks for `IFF_VNET_HDR` is the VMM's choice when it opens the tap ([`Framing`]).
//!
//! # Design
//! The ioctls (`TUNSETIFF`, `TUNSETOWNER`, `TUNSETGROUP`, `TUNSETPERSIST`) go through the `tun`
//! crate. Attaching to an existing tap and creating a new one are the same `TUNSETIFF` call, so
//! [`open`] checks that the tap exists first (a typo never silently creates a device) and
//! [`create_transient`] that it does not. [`create_persistent`] then reads the new tap back over
//! rtnetlink, which settles the kernel's link-watch work for it at once.
//!
//! [`Framing::VirtioNet`] opens the descriptor the way Firecracker and qemu do: `IFF_VNET_HDR`,
//! a 12-byte `virtio_net_hdr_v1` before every frame (`TUNSETVNETHDRSZ`) and `TUNSETOFFLOAD` with
//! checksum, TSO and (where the kernel has it, 6.2 and later) USO, so GSO frames of up to 64 KiB
//! pass whole. [`Framing::Plain`] clears the offloads (`TUNSETOFFLOAD` 0): a persistent tap
//! keeps the offloads of its last opener, and a plain reader must not be handed GSO frames.
//!
//! # Limitations
//! No multi-queue taps: the `tun` crate refuses more than one queue on Linux, and nothing in
//! vmnet makes one (the kernel refuses a single-queue opener on a multi-queue tap with
//! `EINVAL`, which [`open`] reports).

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd};

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

/// How a descriptor opened by a VMM carries frames.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Framing {
    /// Bare Ethernet frames of at most MTU + 14 bytes; the kernel segments and checksums before
    /// it hands a frame over (no offloads).
    #[default]
    Plain,
    /// A [`VNET_HDR_LEN`]-byte virtio-net header before every frame and the offloads of
    /// [`OFFLOADS`] (or [`OFFLOADS_NO_USO`] on kernels without USO): frames of up to 64 KiB,
    /// checksums left partial, as between a VMM and a virtio-net guest.
    VirtioNet,
}

/// The virtio-net header length with [`Framing::VirtioNet`]: `struct virtio_net_hdr_v1`
/// (what a virtio 1.0 device with `VIRTIO_NET_F_MRG_RXBUF` uses), bytes.
pub const VNET_HDR_LEN: usize = 12;

/// The offloads [`Framing::VirtioNet`] asks for: checksum, TCP segmentation (IPv4, IPv6, ECN) and
/// UDP segmentation (IPv4, IPv6).
pub const OFFLOADS: libc::c_uint = libc::TUN_F_CSUM
    | libc::TUN_F_TSO4
    | libc::TUN_F_TSO6
    | libc::TUN_F_TSO_ECN
    | libc::TUN_F_USO4
    | libc::TUN_F_USO6;

/// [`OFFLOADS`] without UDP segmentation, for kernels before 6.2 (they refuse USO with `EINVAL`).
pub const OFFLOADS_NO_USO: libc::c_uint =
    libc::TUN_F_CSUM | libc::TUN_F_TSO4 | libc::TUN_F_TSO6 | libc::TUN_F_TSO_ECN;

/// `open("/dev/net/tun")` and `TUNSETIFF` with `IFF_TAP | IFF_NO_PI` (and `IFF_VNET_HDR` when
/// `vnet_hdr`) for `name` (attaches when the tap exists, creates it otherwise).
fn tunsetiff(name: &str, vnet_hdr: bool) -> Result<tun::Device, TapIoError> {
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
            p.vnet_hdr(vnet_hdr);
        });
    tun::create(&cfg).map_err(fail(OP))
}

/// The descriptor of an attached tap as a plain file (read and write whole frames).
fn into_file(dev: tun::Device) -> File {
    // SAFETY: `into_raw_fd` hands over the tap descriptor (the device closes only its control
    // socket), so the file is its sole owner.
    unsafe { File::from_raw_fd(dev.into_raw_fd()) }
}

/// One `TUNSET*` ioctl that takes its argument by value.
fn tun_ioctl(
    file: &File,
    op: &'static str,
    req: libc::Ioctl,
    arg: libc::c_ulong,
) -> Result<(), TapIoError> {
    // SAFETY: `file` is an open tap descriptor; `req` is a TUNSET* ioctl that takes its
    // argument by value (no pointer is passed).
    if unsafe { libc::ioctl(file.as_raw_fd(), req, arg) } < 0 {
        return Err(TapIoError {
            op,
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Applies `framing` to a freshly attached descriptor: the header size and the offloads.
fn set_framing(file: &File, framing: Framing) -> Result<(), TapIoError> {
    match framing {
        Framing::Plain => tun_ioctl(file, "TUNSETOFFLOAD", libc::TUNSETOFFLOAD, 0),
        Framing::VirtioNet => {
            let len = libc::c_int::try_from(VNET_HDR_LEN).unwrap_or(libc::c_int::MAX);
            // SAFETY: `file` is an open tap descriptor; TUNSETVNETHDRSZ reads one c_int
            // through the pointer, which lives for the call.
            if unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETVNETHDRSZ, &raw const len) } < 0 {
                return Err(TapIoError {
                    op: "TUNSETVNETHDRSZ",
                    source: std::io::Error::last_os_error(),
                });
            }
            tun_ioctl(file, "TUNSETOFFLOAD", libc::TUNSETOFFLOAD, OFFLOADS.into()).or_else(|e| {
                if e.source.raw_os_error() == Some(libc::EINVAL) {
                    tun_ioctl(
                        file,
                        "TUNSETOFFLOAD",
                        libc::TUNSETOFFLOAD,
                        OFFLOADS_NO_USO.into(),
                    )
                } else {
                    Err(e)
                }
            })
        }
    }
}

/// [`tunsetiff`] and [`set_framing`].
fn attach(name: &str, framing: Framing) -> Result<File, TapIoError> {
    let file = into_file(tunsetiff(name, framing == Framing::VirtioNet)?);
    set_framing(&file, framing)?;
    Ok(file)
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
    let mut dev = tunsetiff(name, false)?;
    // The kernel reads the id as a `uid_t`/`gid_t`: pass the bits through unchanged.
    if let Some(uid) = owner.uid {
        dev.user(uid.cast_signed()).map_err(fail("TUNSETOWNER"))?;
    }
    if let Some(gid) = owner.gid {
        dev.group(gid.cast_signed()).map_err(fail("TUNSETGROUP"))?;
    }
    dev.persist().map_err(fail("TUNSETPERSIST"))?;
    // Closing the descriptor turns the carrier off while the tap is down: the kernel queues a
    // link-watch event it counts as not urgent, and handles those at most 100 per second. Taps
    // made faster than that pile up on the kernel's one global list, and every urgent link
    // event after them walks the whole pile with interrupts off, holding RTNL: the cost of a
    // create grew with the number of VMs made before it. Reading the link handles its event
    // now, while the tap is down and that is cheap (`ns_link_watch` tests it).
    drop(dev);
    sync_link_watch(name)
}

/// Asks for link `name` (calling thread's namespace) with `RTM_GETLINK`, for its side effect:
/// the kernel first handles the link's pending link-watch event (`linkwatch_sync_dev` in
/// `rtnl_getlink`; the ethtool and sysfs reads do that for running links only).
fn sync_link_watch(name: &str) -> Result<(), TapIoError> {
    use netlink_packet_core::{NLM_F_REQUEST, NetlinkMessage, NetlinkPayload};
    use netlink_packet_route::RouteNetlinkMessage;
    use netlink_packet_route::link::{LinkAttribute, LinkMessage};
    use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

    const OP: &str = "RTM_GETLINK";
    let os = |source| TapIoError { op: OP, source };
    let mut sock = Socket::new(NETLINK_ROUTE).map_err(os)?;
    sock.bind_auto().map_err(os)?;
    sock.connect(&SocketAddr::new(0, 0)).map_err(os)?;
    let mut msg = LinkMessage::default();
    msg.attributes.push(LinkAttribute::IfName(name.to_owned()));
    let mut req = NetlinkMessage::from(RouteNetlinkMessage::GetLink(msg));
    req.header.flags = NLM_F_REQUEST;
    req.finalize();
    let mut out = vec![0; req.buffer_len()];
    req.serialize(&mut out);
    sock.send(&out, 0).map_err(os)?;
    // The answer (the link, or an error) is one datagram; only an error matters.
    let mut buf = vec![0; 1 << 16];
    let n = sock.recv(&mut &mut buf[..], 0).map_err(os)?;
    let answer = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&buf[..n]).map_err(|e| {
        os(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            e.to_string(),
        ))
    })?;
    match answer.payload {
        NetlinkPayload::Error(e) if e.code.is_some() => Err(os(e.to_io())),
        _ => Ok(()),
    }
}

/// Attaches to the existing tap `name` in the calling thread's namespace, as a VMM does, with
/// [`Framing::Plain`].
///
/// # Errors
/// As [`open_with`].
pub fn open(name: &str) -> Result<File, TapIoError> {
    open_with(name, Framing::Plain)
}

/// Attaches to the existing tap `name` in the calling thread's namespace, as a VMM does, with
/// `framing`.
///
/// # Errors
/// `NotFound` when there is no such interface; the OS error when it cannot be attached (e.g.
/// `EBUSY` when another process holds its only queue) or its framing cannot be set.
pub fn open_with(name: &str, framing: Framing) -> Result<File, TapIoError> {
    if !exists(name) {
        return Err(io_fail(
            "look up",
            std::io::ErrorKind::NotFound,
            "no such interface",
        ));
    }
    attach(name, framing)
}

/// Creates the non-persistent tap `name` in the calling thread's namespace and returns its
/// descriptor ([`Framing::Plain`]); the device disappears when the descriptor closes.
///
/// # Errors
/// As [`create_transient_with`].
pub fn create_transient(name: &str) -> Result<File, TapIoError> {
    create_transient_with(name, Framing::Plain)
}

/// Creates the non-persistent tap `name` in the calling thread's namespace with `framing` and
/// returns its descriptor; the device disappears when the descriptor closes.
///
/// # Errors
/// `AlreadyExists` when a device of that name exists; the OS error when it cannot be created or
/// its framing cannot be set.
pub fn create_transient_with(name: &str, framing: Framing) -> Result<File, TapIoError> {
    if exists(name) {
        return Err(io_fail(
            "look up",
            std::io::ErrorKind::AlreadyExists,
            "interface exists",
        ));
    }
    attach(name, framing)
}
