//! A VM's tap as wake on packet reaches it: opened in the VM's namespace while the VM holds
//! frames, closed when they are delivered.
//!
//! # Design
//! - Two sockets, made by a thread inside the namespace ([`crate::netns::run_in`]): a
//!   `NETLINK_ROUTE` socket in the link group (the tap's carrier coming on is the VMM
//!   attaching) and an `AF_PACKET` raw socket, which hands a frame to the tap's transmit path,
//!   from where the tun driver queues it for the VMM to read: the way the kernel itself delivers
//!   to a guest. A frame sent this way does not enter through the VM's veth end, so the
//!   activity program never holds it again.
//! - The carrier is read from `RTM_NEWLINK` messages about the tap (`IFF_LOWER_UP`):
//!   notifications, and the answer to the one request [`TapPort::ask`] sends right after the
//!   socket joined the group, so an attach just before the port opened is not missed.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use netlink_packet_core::{NLM_F_REQUEST, NetlinkMessage, NetlinkPayload};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_packet_route::link::{LinkFlags, LinkMessage};
use netlink_sys::Socket;
use netlink_sys::protocols::NETLINK_ROUTE;

use crate::netns;

/// `RTNLGRP_LINK`.
const LINK_GROUP: u32 = 1;

/// A sleeping VM's tap (see the module docs).
pub struct TapPort {
    netns: String,
    tap: String,
    index: u32,
    route: Socket,
    packet: OwnedFd,
}

impl std::fmt::Debug for TapPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TapPort")
            .field("netns", &self.netns)
            .field("tap", &self.tap)
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

fn other(netns: &str, what: &str, e: impl std::fmt::Display) -> io::Error {
    io::Error::other(format!("{netns}: {what}: {e}"))
}

impl TapPort {
    /// Opens the port of tap `tap` in namespace `netns` and asks for the tap's state.
    ///
    /// # Errors
    /// The namespace or the tap does not exist, or a socket cannot be made.
    pub fn open(netns: &str, tap: &str) -> io::Result<Self> {
        let name = std::ffi::CString::new(tap).map_err(|e| other(netns, tap, e))?;
        let made = netns::run_in(netns, || -> io::Result<(u32, Socket, OwnedFd)> {
            // SAFETY: a NUL-terminated name.
            let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
            if index == 0 {
                return Err(io::Error::last_os_error());
            }
            let mut route = Socket::new(NETLINK_ROUTE)?;
            route.bind_auto()?;
            route.set_non_blocking(true)?;
            route.add_membership(LINK_GROUP)?;
            // SAFETY: plain socket(2); the descriptor is owned at once.
            let fd = unsafe {
                libc::socket(
                    libc::AF_PACKET,
                    libc::SOCK_RAW | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                    0,
                )
            };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: `fd` was just made and is owned by nobody else.
            let packet = unsafe { OwnedFd::from_raw_fd(fd) };
            Ok((index, route, packet))
        })
        .map_err(|e| other(netns, "enter", e))?
        .map_err(|e| other(netns, tap, e))?;
        let (index, route, packet) = made;
        let port = Self {
            netns: netns.to_owned(),
            tap: tap.to_owned(),
            index,
            route,
            packet,
        };
        port.ask()?;
        Ok(port)
    }

    /// The tap's name.
    #[must_use]
    pub fn tap(&self) -> &str {
        &self.tap
    }

    /// The netlink socket's descriptor, for polling.
    #[must_use]
    pub fn notifications(&self) -> BorrowedFd<'_> {
        self.route.as_fd()
    }

    /// Asks the kernel for the tap's state; the answer arrives as a message [`Self::carrier`]
    /// reads.
    ///
    /// # Errors
    /// The request cannot be sent.
    pub fn ask(&self) -> io::Result<()> {
        let mut m = LinkMessage::default();
        m.header.index = self.index;
        let mut req = NetlinkMessage::from(RouteNetlinkMessage::GetLink(m));
        req.header.flags = NLM_F_REQUEST;
        req.finalize();
        let mut buf = vec![0; req.buffer_len()];
        req.serialize(&mut buf);
        self.route.send(&buf, 0)?;
        Ok(())
    }

    /// Reads what the netlink socket holds: `Some(up)` when a message about the tap said
    /// whether it has a carrier (the last one read wins), `None` when none did.
    ///
    /// # Errors
    /// The socket failed; `ENOBUFS` (messages lost) is not an error but asks again.
    pub fn carrier(&self) -> io::Result<Option<bool>> {
        let mut seen = None;
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let mut b: &mut [u8] = &mut buf[..];
            match self.route.recv(&mut b, libc::MSG_DONTWAIT) {
                Ok(n) => {
                    let mut off = 0;
                    while off < n {
                        let Ok(m) =
                            NetlinkMessage::<RouteNetlinkMessage>::deserialize(&buf[off..n])
                        else {
                            break;
                        };
                        let len = m.header.length as usize;
                        if let NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(l)) =
                            &m.payload
                            && l.header.index == self.index
                        {
                            seen = Some(l.header.flags.contains(LinkFlags::LowerUp));
                        }
                        if len == 0 {
                            break;
                        }
                        off += len.next_multiple_of(4);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(seen),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => self.ask()?,
                Err(e) => return Err(other(&self.netns, &self.tap, e)),
            }
        }
    }

    /// The packet socket's descriptor, for polling once [`Self::listen`] was called.
    #[must_use]
    pub fn frames(&self) -> BorrowedFd<'_> {
        self.packet.as_fd()
    }

    /// Binds the packet socket to every frame on the tap, so that [`Self::guest_sent`] sees
    /// what the VMM sends.
    ///
    /// # Errors
    /// The bind fails.
    pub fn listen(&self) -> io::Result<()> {
        // SAFETY: zeroed sockaddr_ll, then filled.
        let mut at: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        at.sll_family = u16::try_from(libc::AF_PACKET).unwrap_or_default();
        at.sll_protocol = u16::try_from(libc::ETH_P_ALL).unwrap_or_default().to_be();
        at.sll_ifindex = i32::try_from(self.index).unwrap_or(0);
        // SAFETY: a valid address of the stated length.
        let rc = unsafe {
            libc::bind(
                self.packet.as_raw_fd(),
                std::ptr::from_ref(&at).cast(),
                u32::try_from(std::mem::size_of::<libc::sockaddr_ll>()).unwrap_or(0),
            )
        };
        if rc != 0 {
            return Err(other(&self.netns, &self.tap, io::Error::last_os_error()));
        }
        Ok(())
    }

    /// Reads what the packet socket holds: whether any of it came from the VMM (the guest sent
    /// it), as opposed to frames sent to the guest.
    ///
    /// # Errors
    /// The socket failed.
    pub fn guest_sent(&self) -> io::Result<bool> {
        let mut buf = [0u8; 2048];
        let mut from_guest = false;
        loop {
            // SAFETY: zeroed sockaddr_ll, filled by recvfrom.
            let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            let mut len = u32::try_from(std::mem::size_of::<libc::sockaddr_ll>()).unwrap_or(0);
            // SAFETY: valid buffer and address of the stated lengths.
            let n = unsafe {
                libc::recvfrom(
                    self.packet.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT | libc::MSG_TRUNC,
                    std::ptr::from_mut(&mut from).cast(),
                    &raw mut len,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                return match e.kind() {
                    io::ErrorKind::WouldBlock => Ok(from_guest),
                    io::ErrorKind::Interrupted => continue,
                    _ => Err(other(&self.netns, &self.tap, e)),
                };
            }
            if from.sll_pkttype != libc::PACKET_OUTGOING {
                from_guest = true;
            }
        }
    }

    /// Hands `frame` (Ethernet header first) to the tap's transmit path.
    ///
    /// # Errors
    /// The kernel refused it (too long for the tap, the tap gone, its queue full).
    pub fn send(&self, frame: &[u8]) -> io::Result<()> {
        if frame.len() < 14 {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        // SAFETY: zeroed sockaddr_ll, then filled.
        let mut to: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        to.sll_family = u16::try_from(libc::AF_PACKET).unwrap_or_default();
        to.sll_protocol = u16::from_ne_bytes([frame[12], frame[13]]);
        to.sll_ifindex = i32::try_from(self.index).unwrap_or(0);
        to.sll_halen = 6;
        to.sll_addr[..6].copy_from_slice(&frame[..6]);
        // SAFETY: a valid buffer and address of the stated lengths.
        let n = unsafe {
            libc::sendto(
                self.packet.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                0,
                std::ptr::from_ref(&to).cast(),
                u32::try_from(std::mem::size_of::<libc::sockaddr_ll>()).unwrap_or(0),
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}
