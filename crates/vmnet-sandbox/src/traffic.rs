//! Traffic checks from inside a namespace, each bounded by a timeout and never hanging: a TCP
//! and a UDP client for [`crate::echo`], ICMP/ICMPv6 echo (ping), and running a command.
//!
//! Each check runs on a thread that entered the namespace; the sockets are Rust sockets, so no
//! `ping` binary is needed.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, OwnedFd};
use std::process::Output;
use std::str::FromStr;
use std::time::{Duration, Instant};

use nix::sys::socket::{
    AddressFamily, MsgFlags, SockFlag, SockProtocol, SockType, SockaddrIn, SockaddrIn6,
    SockaddrStorage, recvfrom, sendto, setsockopt, socket, sockopt,
};
use nix::sys::time::TimeVal;

use crate::{SandboxError, netns};

/// What the echo service answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EchoReply {
    /// The client address the server saw (after any NAT on the path).
    pub peer: SocketAddr,
    /// The MSS option of the client's SYN as it arrived (TCP only; `None` for UDP or when the
    /// SYN had none).
    pub syn_mss: Option<u16>,
    /// The bytes echoed back.
    pub data: Vec<u8>,
}

/// Parses an answer of the echo protocol (see [`crate::echo`]).
///
/// # Errors
/// [`SandboxError::Unexpected`] when the header line is malformed.
pub fn parse_reply(reply: &[u8]) -> Result<EchoReply, SandboxError> {
    let bad = || {
        SandboxError::Unexpected(format!(
            "malformed echo reply {:?}",
            String::from_utf8_lossy(reply)
        ))
    };
    let nl = reply.iter().position(|&b| b == b'\n').ok_or_else(bad)?;
    let header = std::str::from_utf8(&reply[..nl]).map_err(|_| bad())?;
    let mut peer = None;
    let mut syn_mss = None;
    for field in header.split(' ') {
        match field.split_once('=') {
            Some(("peer", v)) => peer = Some(SocketAddr::from_str(v).map_err(|_| bad())?),
            Some(("syn_mss", "none")) => {}
            Some(("syn_mss", v)) => syn_mss = Some(v.parse().map_err(|_| bad())?),
            _ => return Err(bad()),
        }
    }
    Ok(EchoReply {
        peer: peer.ok_or_else(bad)?,
        syn_mss,
        data: reply[nl + 1..].to_vec(),
    })
}

/// Connects from namespace `ns` to the echo service at `target` over TCP, sends a line and
/// returns the answer.
///
/// # Errors
/// [`SandboxError::Io`] when the connection is refused or times out (unreachable), or on a
/// malformed answer.
pub fn tcp_echo(
    ns: &str,
    target: SocketAddr,
    timeout: Duration,
) -> Result<EchoReply, SandboxError> {
    let what = format!("netns {ns}: tcp echo to {target}");
    let raw = netns::run_in(ns, || -> std::io::Result<Vec<u8>> {
        let mut s = TcpStream::connect_timeout(&target, timeout)?;
        s.set_read_timeout(Some(timeout))?;
        s.set_write_timeout(Some(timeout))?;
        s.write_all(b"vmnet-testkit\n")?;
        let mut out = Vec::new();
        s.read_to_end(&mut out)?;
        Ok(out)
    })?
    .map_err(|e| SandboxError::io(what.clone(), e))?;
    let reply = parse_reply(&raw)?;
    if reply.data != b"vmnet-testkit\n" {
        return Err(SandboxError::Unexpected(format!(
            "{what}: echoed {:?}",
            String::from_utf8_lossy(&reply.data)
        )));
    }
    Ok(reply)
}

/// Sends one UDP datagram from namespace `ns` to the echo service at `target` and waits up to
/// `timeout` for the answer, retrying twice (the first datagram can be lost to neighbour
/// resolution).
///
/// # Errors
/// [`SandboxError::Timeout`] when no answer came, or a socket error.
pub fn udp_echo(
    ns: &str,
    target: SocketAddr,
    timeout: Duration,
) -> Result<EchoReply, SandboxError> {
    let what = format!("netns {ns}: udp echo to {target}");
    let raw = netns::run_in(ns, || -> std::io::Result<Option<Vec<u8>>> {
        let bind: SocketAddr = if target.is_ipv4() {
            "0.0.0.0:0".parse()
        } else {
            "[::]:0".parse()
        }
        .map_err(|_| std::io::Error::other("bind address"))?;
        let s = UdpSocket::bind(bind)?;
        s.connect(target)?;
        let per_try = timeout / 3;
        s.set_read_timeout(Some(per_try.max(Duration::from_millis(10))))?;
        let mut buf = vec![0u8; 65536];
        for _ in 0..3 {
            s.send(b"vmnet-testkit")?;
            match s.recv(&mut buf) {
                Ok(n) => return Ok(Some(buf[..n].to_vec())),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                // ICMP unreachable shows up as ECONNREFUSED etc.: no answer.
                Err(_) => std::thread::sleep(per_try),
            }
        }
        Ok(None)
    })?
    .map_err(|e| SandboxError::io(what.clone(), e))?;
    let raw = raw.ok_or(SandboxError::Timeout {
        what: what.clone(),
        timeout,
    })?;
    let reply = parse_reply(&raw)?;
    if reply.data != b"vmnet-testkit" {
        return Err(SandboxError::Unexpected(format!(
            "{what}: echoed {:?}",
            String::from_utf8_lossy(&reply.data)
        )));
    }
    Ok(reply)
}

/// Like [`tcp_echo`] but `Ok(None)` when the target is unreachable or silent, for checks that
/// expect no reach.
///
/// # Errors
/// Only when the namespace cannot be entered or the answer is malformed.
pub fn try_tcp_echo(
    ns: &str,
    target: SocketAddr,
    timeout: Duration,
) -> Result<Option<EchoReply>, SandboxError> {
    match tcp_echo(ns, target, timeout) {
        Ok(r) => Ok(Some(r)),
        Err(SandboxError::Io { .. } | SandboxError::Timeout { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Like [`udp_echo`] but `Ok(None)` when no answer came.
///
/// # Errors
/// Only when the namespace cannot be entered or the answer is malformed.
pub fn try_udp_echo(
    ns: &str,
    target: SocketAddr,
    timeout: Duration,
) -> Result<Option<EchoReply>, SandboxError> {
    match udp_echo(ns, target, timeout) {
        Ok(r) => Ok(Some(r)),
        Err(SandboxError::Io { .. } | SandboxError::Timeout { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

/// The outcome of [`ping`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PingResult {
    /// Echo requests sent.
    pub sent: u32,
    /// Matching echo replies received.
    pub received: u32,
}

fn checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    for chunk in data.chunks(2) {
        let word = u16::from_be_bytes([chunk[0], *chunk.get(1).unwrap_or(&0)]);
        sum += u32::from(word);
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !u16::try_from(sum).unwrap_or(0xffff)
}

/// Sends `count` ICMP (or ICMPv6) echo requests from namespace `ns` to `target`, 100 ms apart,
/// waiting up to `wait` for each reply, and counts the replies from `target`.
///
/// # Errors
/// When the namespace cannot be entered or the raw socket cannot be opened.
pub fn ping(
    ns: &str,
    target: IpAddr,
    count: u32,
    wait: Duration,
) -> Result<PingResult, SandboxError> {
    let what = format!("netns {ns}: ping {target}");
    netns::run_in(ns, || ping_here(target, count, wait))?.map_err(|e| SandboxError::errno(what, e))
}

fn ping_here(target: IpAddr, count: u32, wait: Duration) -> nix::Result<PingResult> {
    let (family, proto) = match target {
        IpAddr::V4(_) => (AddressFamily::Inet, SockProtocol::Icmp),
        IpAddr::V6(_) => (AddressFamily::Inet6, SockProtocol::IcmpV6),
    };
    let fd: OwnedFd = socket(family, SockType::Raw, SockFlag::SOCK_CLOEXEC, proto)?;
    setsockopt(&fd, sockopt::ReceiveTimeout, &TimeVal::new(0, 20_000))?;
    let id = u16::try_from(std::process::id() & 0xffff).unwrap_or(0) ^ 0x5a5a;
    let mut received = 0;
    let mut buf = [0u8; 2048];
    for seq in 0..count {
        let seq16 = u16::try_from(seq & 0xffff).unwrap_or(0);
        let (req_type, reply_type) = if target.is_ipv4() {
            (8u8, 0u8)
        } else {
            (128u8, 129u8)
        };
        let mut pkt = vec![req_type, 0, 0, 0];
        pkt.extend(id.to_be_bytes());
        pkt.extend(seq16.to_be_bytes());
        pkt.extend(b"vmnet-testkit-ping");
        if target.is_ipv4() {
            let c = checksum(&pkt);
            pkt[2..4].copy_from_slice(&c.to_be_bytes());
        }
        match target {
            IpAddr::V4(a) => sendto(
                fd.as_raw_fd(),
                &pkt,
                &SockaddrIn::from(std::net::SocketAddrV4::new(a, 0)),
                MsgFlags::empty(),
            ),
            IpAddr::V6(a) => sendto(
                fd.as_raw_fd(),
                &pkt,
                &SockaddrIn6::from(std::net::SocketAddrV6::new(a, 0, 0, 0)),
                MsgFlags::empty(),
            ),
        }
        .ok();
        let deadline = Instant::now() + wait;
        while Instant::now() < deadline {
            let Ok((n, from)) = recvfrom::<SockaddrStorage>(fd.as_raw_fd(), &mut buf) else {
                continue;
            };
            let from_ip: Option<IpAddr> = from.and_then(|f| {
                f.as_sockaddr_in()
                    .map(|s| IpAddr::V4(s.ip()))
                    .or_else(|| f.as_sockaddr_in6().map(|s| IpAddr::V6(s.ip())))
            });
            if from_ip != Some(target) {
                continue;
            }
            // IPv4 raw sockets deliver the IP header; ICMPv6 raw sockets do not.
            let icmp = if target.is_ipv4() {
                buf.get(usize::from(buf[0] & 0x0f) * 4..n)
            } else {
                buf.get(..n)
            };
            let Some(icmp) = icmp else { continue };
            if icmp.len() >= 8
                && icmp[0] == reply_type
                && icmp[4..6] == id.to_be_bytes()
                && icmp[6..8] == seq16.to_be_bytes()
            {
                received += 1;
                break;
            }
        }
        if seq + 1 < count {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    Ok(PingResult {
        sent: count,
        received,
    })
}

/// Runs `program args…` inside namespace `ns` (via `ip netns exec`) with a time limit and
/// returns its output whatever its exit status.
///
/// # Errors
/// When it cannot start, or [`SandboxError::Timeout`] when it was killed at the limit.
pub fn run(
    ns: &str,
    program: &str,
    args: &[&str],
    timeout: Duration,
) -> Result<Output, SandboxError> {
    netns::exec(ns, program, args, timeout)
}

/// The segments the kernel retransmitted on connection `s` so far (`TCP_INFO`'s
/// `tcpi_total_retrans`): a client's SYN retransmissions, read right after `connect()`.
///
/// # Errors
/// When `getsockopt` fails.
pub fn retransmits(s: &TcpStream) -> std::io::Result<u32> {
    use std::os::fd::AsRawFd;
    // SAFETY: a zeroed tcp_info of the size passed, filled by getsockopt.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = u32::try_from(std::mem::size_of::<libc::tcp_info>()).unwrap_or(0);
    // SAFETY: valid pointers to `info` and `len`, which holds its size.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            std::ptr::from_mut(&mut info).cast(),
            &raw mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(info.tcpi_total_retrans)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_tcp_reply() {
        let r = parse_reply(b"peer=203.0.113.2:40000 syn_mss=1340\nhello\n").expect("parses");
        assert_eq!(r.peer, "203.0.113.2:40000".parse().expect("addr"));
        assert_eq!(r.syn_mss, Some(1340));
        assert_eq!(r.data, b"hello\n");
    }

    #[test]
    fn parses_udp_reply_v6() {
        let r = parse_reply(b"peer=[fdaa:1::56]:5000\nx").expect("parses");
        assert_eq!(r.peer, "[fdaa:1::56]:5000".parse().expect("addr"));
        assert_eq!(r.syn_mss, None);
        assert_eq!(r.data, b"x");
    }

    #[test]
    fn rejects_malformed() {
        assert!(parse_reply(b"nonsense").is_err());
        assert!(parse_reply(b"peer=nope\n").is_err());
        assert!(parse_reply(b"what=1\n").is_err());
    }

    #[test]
    fn icmp_checksum() {
        // Echo request, id 1, seq 1, no payload: checksum 0xf7fd.
        assert_eq!(checksum(&[8, 0, 0, 0, 0, 1, 0, 1]), 0xf7fd);
    }
}
