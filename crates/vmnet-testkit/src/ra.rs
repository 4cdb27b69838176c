//! A router sending IPv6 router advertisements (RFC 4861) on one link of a namespace, as the
//! fake internet's router does for a host that configures its uplink by SLAAC.
//!
//! # Design
//! A thread inside the namespace sends one advertisement every `interval` to all nodes
//! (`ff02::1`) on the link, from the link's own link-local address, with hop limit 255 (a host
//! drops an advertisement with any other), the given router lifetime and one prefix option
//! (on-link, autonomous) so the host forms an address. The kernel fills in the ICMPv6 checksum
//! of a raw ICMPv6 socket. The link is switched to router behaviour first (its per-link IPv6
//! `forwarding`), so the neighbour advertisements it answers with carry the router flag: a host
//! that sees a router answer as a plain host drops the default route through it (RFC 4861,
//! 7.2.5). Stops when dropped.
//!
//! # Limitations
//! No source link-layer address option (the host resolves the router by neighbour discovery),
//! no router solicitation handling: hosts wait for the next periodic advertisement.

use std::net::{Ipv6Addr, SocketAddrV6};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use nix::sys::socket::{
    AddressFamily, MsgFlags, SockFlag, SockProtocol, SockType, SockaddrIn6, sendto, setsockopt,
    socket, sockopt,
};

use crate::{SandboxError, netns};

/// What the router advertises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Advert {
    /// The router lifetime, seconds (0: not a default router).
    pub router_lifetime: u16,
    /// The on-link, autonomous /64 prefix.
    pub prefix: Ipv6Addr,
    /// The prefix's valid and preferred lifetime, seconds.
    pub prefix_lifetime: u32,
    /// Time between advertisements.
    pub interval: Duration,
}

/// A running advertiser; stops when dropped.
#[derive(Debug)]
pub struct RouterAdvertiser {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    last_errno: Arc<AtomicI32>,
    thread: Option<JoinHandle<Result<Result<(), SandboxError>, SandboxError>>>,
}

/// The advertisement's ICMPv6 message (checksum left 0 for the kernel).
fn message(a: &Advert) -> Vec<u8> {
    let mut m = vec![134, 0, 0, 0, 64, 0];
    m.extend(a.router_lifetime.to_be_bytes());
    m.extend([0u8; 8]); // reachable time, retransmission timer: unspecified
    m.extend([3, 4, 64, 0xc0]); // prefix information, 32 bytes, /64, on-link + autonomous
    m.extend(a.prefix_lifetime.to_be_bytes());
    m.extend(a.prefix_lifetime.to_be_bytes());
    m.extend([0u8; 4]);
    m.extend(a.prefix.octets());
    m
}

impl RouterAdvertiser {
    /// Starts advertising `advert` on link `ifname` of namespace `ns`.
    ///
    /// # Errors
    /// When the link or the socket cannot be set up (reported before this returns).
    pub fn start(ns: &str, ifname: &str, advert: Advert) -> Result<Self, SandboxError> {
        netns::sysctl(ns, &format!("net/ipv6/conf/{ifname}/forwarding"), "1")?;
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let last_errno = Arc::new(AtomicI32::new(0));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (st, se, link) = (Arc::clone(&stop), Arc::clone(&sent), ifname.to_owned());
        let le = Arc::clone(&last_errno);
        let thread = netns::spawn_in(ns, "router-adverts", move || {
            let setup = || -> Result<(OwnedFd, SockaddrIn6), SandboxError> {
                let index = nix::net::if_::if_nametoindex(link.as_str())
                    .map_err(|e| SandboxError::errno(format!("link {link}"), e))?;
                let fd = socket(
                    AddressFamily::Inet6,
                    SockType::Raw,
                    SockFlag::SOCK_CLOEXEC,
                    SockProtocol::IcmpV6,
                )
                .map_err(|e| SandboxError::errno("raw ICMPv6 socket", e))?;
                setsockopt(&fd, sockopt::Ipv6MulticastHops, &255)
                    .map_err(|e| SandboxError::errno("IPV6_MULTICAST_HOPS", e))?;
                let all_nodes = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);
                Ok((
                    fd,
                    SockaddrIn6::from(SocketAddrV6::new(all_nodes, 0, 0, index)),
                ))
            };
            let (fd, to) = match setup() {
                Ok(v) => {
                    let _ = ready_tx.send(Ok(()));
                    v
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e.to_string()));
                    return Err(e);
                }
            };
            let msg = message(&advert);
            while !st.load(Ordering::Relaxed) {
                match sendto(fd.as_raw_fd(), &msg, &to, MsgFlags::empty()) {
                    Ok(_) => {
                        se.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => le.store(e as i32, Ordering::Relaxed),
                }
                let mut slept = Duration::ZERO;
                while slept < advert.interval && !st.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(50));
                    slept += Duration::from_millis(50);
                }
            }
            Ok(())
        })?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(Self {
                stop,
                sent,
                last_errno,
                thread: Some(thread),
            }),
            Ok(Err(m)) => Err(SandboxError::Unexpected(format!(
                "router advertiser in {ns}: {m}"
            ))),
            Err(_) => Err(SandboxError::Unexpected(format!(
                "router advertiser in {ns}: thread ended"
            ))),
        }
    }

    /// Advertisements sent so far.
    #[must_use]
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// The error of the last send that failed, if any did.
    #[must_use]
    pub fn last_error(&self) -> Option<nix::errno::Errno> {
        match self.last_errno.load(Ordering::Relaxed) {
            0 => None,
            e => Some(nix::errno::Errno::from_raw(e)),
        }
    }
}

impl Drop for RouterAdvertiser {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_advertisement_is_laid_out_as_rfc_4861_says() {
        let m = message(&Advert {
            router_lifetime: 4,
            prefix: "2001:db8:0:1::".parse().unwrap(),
            prefix_lifetime: 600,
            interval: Duration::from_secs(1),
        });
        assert_eq!(m.len(), 16 + 32);
        assert_eq!(&m[..8], &[134, 0, 0, 0, 64, 0, 0, 4]);
        assert_eq!(&m[16..20], &[3, 4, 64, 0xc0]);
        assert_eq!(&m[20..24], &600u32.to_be_bytes());
        assert_eq!(&m[32..34], &[0x20, 0x01]);
    }
}
