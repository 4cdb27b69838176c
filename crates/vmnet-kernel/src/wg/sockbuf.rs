//! The socket buffers of the WireGuard device's UDP sockets.
//!
//! `wireguard-go` 0.0.20220316 (Debian 12's) leaves its UDP sockets at the namespace's default
//! buffer (`net.core.rmem_default`, 212,992 bytes), so a burst of tunnel packets that arrives
//! while its reader is busy overflows the receive queue and the kernel drops it
//! (`UdpRcvbufErrors`/`Udp6RcvbufErrors`); every drop is a retransmission inside the tunnel.
//! The agent owns that process, so it sizes the process's UDP sockets itself: it takes a copy of
//! each socket descriptor with `pidfd_getfd(2)` (root, as the agent is) and sets
//! `SO_RCVBUFFORCE`/`SO_SNDBUFFORCE`, which only root may do and which ignore
//! `net.core.rmem_max`. The setting belongs to the socket, not to the namespace: nothing else in
//! the namespace changes.
//!
//! `wireguard-go` opens new sockets each time its interface comes up and each time its listen
//! port is set, so [`ensure`] is idempotent and cheap (a read of `/proc/<pid>/fd` and a few
//! `getsockopt`s): the agent calls it after every change it makes to the device and on its
//! one-second watch, and it writes only to sockets below the size wanted.
//!
//! # Limitations
//! A socket the device opens behind the agent's back (someone else sets its port or flaps its
//! link) keeps the default size until the agent's next watch tick (one second).

use std::os::fd::{AsFd, OwnedFd};

use rustix::net::{AddressFamily, SocketType, sockopt};
use rustix::process::{Pid, PidfdFlags, PidfdGetfdFlags, pidfd_getfd, pidfd_open};

use super::WgError;

/// The buffer size the agent gives the device's UDP sockets by default, bytes (what later
/// `wireguard-go` releases ask for themselves).
pub const DEFAULT_BYTES: u32 = 7 << 20;

/// One UDP socket of the device, as read back after [`ensure`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdpSocket {
    /// The descriptor number in the device's process.
    pub fd: i32,
    /// IPv6 (else IPv4).
    pub ipv6: bool,
    /// `SO_RCVBUF` as the kernel reports it (twice the size set, for its bookkeeping).
    pub rcvbuf: usize,
    /// `SO_SNDBUF`, likewise.
    pub sndbuf: usize,
    /// Whether this call wrote either buffer.
    pub written: bool,
}

/// Whether a buffer the kernel reports as `reported` bytes is smaller than `want` bytes asked
/// for: the kernel doubles the size it is given (half is kept for its bookkeeping) and reports
/// the doubled value.
#[must_use]
pub fn too_small(reported: usize, want: u32) -> bool {
    let want = usize::try_from(want).unwrap_or(usize::MAX);
    reported < want.saturating_mul(2)
}

fn io(what: String) -> impl FnOnce(rustix::io::Errno) -> WgError {
    move |e| WgError::Io {
        what,
        source: e.into(),
    }
}

/// The descriptor numbers of `pid` that are sockets (`/proc/<pid>/fd/N -> socket:[…]`).
fn socket_fds(pid: u32) -> Result<Vec<i32>, WgError> {
    let dir = format!("/proc/{pid}/fd");
    let entries = std::fs::read_dir(&dir).map_err(|e| WgError::Io {
        what: format!("read {dir}"),
        source: e,
    })?;
    let mut fds = Vec::new();
    for e in entries.flatten() {
        let Some(n) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        // A descriptor closed meanwhile has no link any more: skip it.
        if std::fs::read_link(e.path()).is_ok_and(|t| t.to_string_lossy().starts_with("socket:[")) {
            fds.push(n);
        }
    }
    fds.sort_unstable();
    Ok(fds)
}

/// A UDP socket's family, `None` for any other socket.
fn udp_family(sock: &OwnedFd) -> Option<bool> {
    if sockopt::socket_type(sock).ok()? != SocketType::DGRAM {
        return None;
    }
    match sockopt::socket_domain(sock).ok()? {
        AddressFamily::INET => Some(false),
        AddressFamily::INET6 => Some(true),
        _ => None,
    }
}

/// The UDP sockets of process `pid`, each a copy of its descriptor (`pidfd_getfd`).
fn udp_sockets(pid: u32) -> Result<Vec<(i32, bool, OwnedFd)>, WgError> {
    let raw = i32::try_from(pid)
        .ok()
        .and_then(Pid::from_raw)
        .ok_or_else(|| WgError::Device(format!("pid {pid}: not a process id")))?;
    // The pidfd first: if `pid` exits and its number is reused while the directory is read,
    // `pidfd_getfd` fails (ESRCH) instead of reaching the new process.
    let pidfd = pidfd_open(raw, PidfdFlags::empty()).map_err(io(format!("pidfd_open {pid}")))?;
    let mut out = Vec::new();
    for fd in socket_fds(pid)? {
        match pidfd_getfd(pidfd.as_fd(), fd, PidfdGetfdFlags::empty()) {
            Ok(sock) => {
                if let Some(v6) = udp_family(&sock) {
                    out.push((fd, v6, sock));
                }
            }
            // Closed between the listing and the copy.
            Err(rustix::io::Errno::BADF) => {}
            Err(e) => return Err(io(format!("pidfd_getfd {pid} fd {fd}"))(e)),
        }
    }
    Ok(out)
}

/// The UDP sockets of process `pid` with their buffers as they are (nothing written).
///
/// # Errors
/// As [`ensure`].
pub fn read(pid: u32) -> Result<Vec<UdpSocket>, WgError> {
    udp_sockets(pid)?
        .into_iter()
        .map(|(fd, ipv6, sock)| {
            let what = |o: &str| format!("wireguard-go (pid {pid}) fd {fd}: {o}");
            Ok(UdpSocket {
                fd,
                ipv6,
                rcvbuf: sockopt::socket_recv_buffer_size(&sock).map_err(io(what("SO_RCVBUF")))?,
                sndbuf: sockopt::socket_send_buffer_size(&sock).map_err(io(what("SO_SNDBUF")))?,
                written: false,
            })
        })
        .collect()
}

/// Gives every UDP socket of process `pid` (the device) receive and send buffers of at least
/// `bytes`, writing only those below it, and reads them back.
///
/// # Errors
/// `Io` when the process's descriptors cannot be read or copied (not root, the process gone) or
/// a buffer cannot be set; `Device` when a buffer reads back smaller than it was set.
pub fn ensure(pid: u32, bytes: u32) -> Result<Vec<UdpSocket>, WgError> {
    let want = usize::try_from(bytes).unwrap_or(usize::MAX);
    let mut sized = Vec::new();
    for (fd, ipv6, sock) in udp_sockets(pid)? {
        let what = |o: &str| format!("wireguard-go (pid {pid}) fd {fd}: {o}");
        let mut written = false;
        let rcv = sockopt::socket_recv_buffer_size(&sock).map_err(io(what("SO_RCVBUF")))?;
        if too_small(rcv, bytes) {
            sockopt::set_socket_recv_buffer_size_force(&sock, want)
                .map_err(io(what("SO_RCVBUFFORCE")))?;
            written = true;
        }
        let snd = sockopt::socket_send_buffer_size(&sock).map_err(io(what("SO_SNDBUF")))?;
        if too_small(snd, bytes) {
            sockopt::set_socket_send_buffer_size_force(&sock, want)
                .map_err(io(what("SO_SNDBUFFORCE")))?;
            written = true;
        }
        let s = UdpSocket {
            fd,
            ipv6,
            rcvbuf: sockopt::socket_recv_buffer_size(&sock).map_err(io(what("SO_RCVBUF")))?,
            sndbuf: sockopt::socket_send_buffer_size(&sock).map_err(io(what("SO_SNDBUF")))?,
            written,
        };
        if too_small(s.rcvbuf, bytes) || too_small(s.sndbuf, bytes) {
            return Err(WgError::Device(format!(
                "{}: buffers read back {} / {} bytes after setting {bytes}",
                what("socket buffers"),
                s.rcvbuf,
                s.sndbuf
            )));
        }
        sized.push(s);
    }
    Ok(sized)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_is_big_enough_at_twice_the_size_asked() {
        assert!(too_small(212_992, DEFAULT_BYTES));
        assert!(too_small(2 * 7_340_032 - 1, DEFAULT_BYTES));
        assert!(!too_small(2 * 7_340_032, DEFAULT_BYTES));
        assert!(!too_small(usize::MAX, u32::MAX));
        assert!(!too_small(0, 0));
    }

    /// Our own UDP sockets, sized through a pidfd of this process: only the UDP ones change,
    /// each once; a second call finds them big enough and writes nothing to them.
    #[test]
    #[ignore = "needs root: SO_RCVBUFFORCE needs CAP_NET_ADMIN (scripts/test.sh runs it)"]
    fn ensure_sizes_only_udp_sockets_and_only_once() {
        use std::os::fd::AsRawFd;
        let u4 = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let u6 = std::net::UdpSocket::bind("[::1]:0").ok();
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let before = sockopt::socket_recv_buffer_size(&tcp).unwrap();
        let bytes = 1 << 20;
        let mut fds = vec![u4.as_raw_fd()];
        fds.extend(u6.as_ref().map(AsRawFd::as_raw_fd));
        let mine = |all: Vec<UdpSocket>| -> Vec<UdpSocket> {
            all.into_iter().filter(|s| fds.contains(&s.fd)).collect()
        };
        let first = mine(ensure(std::process::id(), bytes).unwrap());
        assert_eq!(first.len(), fds.len(), "{first:?}");
        assert!(first.iter().all(|s| s.written), "{first:?}");
        assert_eq!(first.iter().filter(|s| s.ipv6).count(), fds.len() - 1);
        assert!(sockopt::socket_recv_buffer_size(&u4).unwrap() >= 2 << 20);
        assert!(sockopt::socket_send_buffer_size(&u4).unwrap() >= 2 << 20);
        assert_eq!(sockopt::socket_recv_buffer_size(&tcp).unwrap(), before);
        let again = mine(ensure(std::process::id(), bytes).unwrap());
        assert_eq!(again.len(), fds.len());
        assert!(again.iter().all(|s| !s.written), "{again:?}");
    }
}
