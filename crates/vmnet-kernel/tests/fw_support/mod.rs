//! Traffic helpers of the firewall tests: TCP and UDP echo from a chosen source address, raw
//! ICMP/ICMPv6 echo (with a hop-by-hop header, or fragmented), and a line echo server whose
//! connections stay open (for the tightening test).

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::{Duration, Instant};

use nix::sys::socket::{
    AddressFamily, MsgFlags, SockFlag, SockProtocol, SockType, SockaddrIn, SockaddrIn6,
    SockaddrStorage, bind, connect, recvfrom, sendto, setsockopt, socket, sockopt,
};
use nix::sys::time::TimeVal;
use vmnet_testkit::netns;

fn sockaddr(a: SocketAddr) -> SockaddrStorage {
    SockaddrStorage::from(a)
}

fn family(a: &IpAddr) -> AddressFamily {
    if a.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    }
}

/// Opens a TCP connection from `ns` (from `src` when given) to `dst` within `t`.
pub fn tcp_connect(
    ns: &str,
    src: Option<IpAddr>,
    dst: SocketAddr,
    t: Duration,
) -> Option<TcpStream> {
    netns::run_in(ns, move || -> nix::Result<TcpStream> {
        let fd: OwnedFd = socket(
            family(&dst.ip()),
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            None,
        )?;
        let tv = TimeVal::new(i64::try_from(t.as_secs()).unwrap_or(5), 0);
        setsockopt(&fd, sockopt::SendTimeout, &tv)?;
        setsockopt(&fd, sockopt::ReceiveTimeout, &tv)?;
        if let Some(s) = src {
            bind(fd.as_raw_fd(), &sockaddr(SocketAddr::new(s, 0)))?;
        }
        connect(fd.as_raw_fd(), &sockaddr(dst))?;
        Ok(TcpStream::from(fd))
    })
    .expect("netns")
    .ok()
}

/// Whether a line sent on `s` comes back within its timeouts.
pub fn line_echo(s: &mut TcpStream, line: &str) -> bool {
    if s.write_all(format!("{line}\n").as_bytes()).is_err() {
        return false;
    }
    let mut got = Vec::new();
    let mut byte = [0u8; 1];
    while !got.ends_with(b"\n") {
        match s.read(&mut byte) {
            Ok(1) => got.push(byte[0]),
            _ => return false,
        }
    }
    got == format!("{line}\n").as_bytes()
}

/// Whether a TCP connection from `ns` (from `src`) to the sandbox echo protocol at `dst` gets
/// its answer (any line back) within `t`.
pub fn tcp_ok(ns: &str, src: Option<IpAddr>, dst: SocketAddr, t: Duration) -> bool {
    let Some(mut s) = tcp_connect(ns, src, dst, t) else {
        return false;
    };
    let _ = s.write_all(b"fw\n");
    let mut buf = [0u8; 64];
    matches!(s.read(&mut buf), Ok(n) if n > 0)
}

/// Whether a UDP datagram from `ns` (from `src`) to `dst` is answered within `t` (three tries).
pub fn udp_ok(ns: &str, src: Option<IpAddr>, dst: SocketAddr, t: Duration) -> bool {
    netns::run_in(ns, move || -> std::io::Result<bool> {
        let any: IpAddr = if dst.is_ipv4() {
            Ipv4Addr::UNSPECIFIED.into()
        } else {
            Ipv6Addr::UNSPECIFIED.into()
        };
        let s = UdpSocket::bind(SocketAddr::new(src.unwrap_or(any), 0))?;
        s.connect(dst)?;
        s.set_read_timeout(Some(t / 3))?;
        let mut buf = [0u8; 2048];
        for _ in 0..3 {
            s.send(b"fw")?;
            match s.recv(&mut buf) {
                Ok(_) => return Ok(true),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                    std::thread::sleep(t / 3);
                }
                Err(_) => {}
            }
        }
        Ok(false)
    })
    .expect("netns")
    .unwrap_or(false)
}

/// How an echo request is sent.
#[derive(Debug, Clone, Copy, Default)]
pub struct Ping {
    /// Bind to this source address.
    pub src: Option<IpAddr>,
    /// Payload bytes after the 8-byte ICMP header.
    pub payload: usize,
    /// IPv6 only: carry a hop-by-hop options header (one PadN option).
    pub hop_by_hop: bool,
    /// Fragment at this MTU (IPv6: `IPV6_MTU`; IPv4 fragments at the link MTU, DF off).
    pub mtu: Option<u32>,
}

fn checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    for c in data.chunks(2) {
        sum += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !u16::try_from(sum).unwrap_or(0xffff)
}

/// Sends up to 3 echo requests from `ns` to `dst` as `how` says; whether a reply came within `t`.
pub fn ping_ok(ns: &str, dst: IpAddr, how: Ping, t: Duration) -> bool {
    netns::run_in(ns, move || ping_here(dst, how, t))
        .expect("netns")
        .expect("raw socket")
}

/// setsockopt(2) with a raw option value; panics when the kernel refuses it.
fn set_opt(fd: i32, level: i32, opt: i32, value: &[u8]) {
    let len = libc::socklen_t::try_from(value.len()).expect("short option");
    // SAFETY: `fd` is an open socket and `value` a readable buffer of `len` bytes for the call.
    let r = unsafe { libc::setsockopt(fd, level, opt, value.as_ptr().cast(), len) };
    assert_eq!(
        r,
        0,
        "setsockopt {level}/{opt}: {}",
        std::io::Error::last_os_error()
    );
}

fn ping_here(dst: IpAddr, how: Ping, t: Duration) -> nix::Result<bool> {
    let v4 = dst.is_ipv4();
    let proto = if v4 {
        SockProtocol::Icmp
    } else {
        SockProtocol::IcmpV6
    };
    let fd: OwnedFd = socket(family(&dst), SockType::Raw, SockFlag::SOCK_CLOEXEC, proto)?;
    setsockopt(&fd, sockopt::ReceiveTimeout, &TimeVal::new(0, 50_000))?;
    if let Some(s) = how.src {
        bind(fd.as_raw_fd(), &sockaddr(SocketAddr::new(s, 0)))?;
    }
    let raw = fd.as_raw_fd();
    if v4 {
        let dont: libc::c_int = libc::IP_PMTUDISC_DONT;
        set_opt(
            raw,
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            &dont.to_ne_bytes(),
        );
    } else {
        if how.hop_by_hop {
            // Next header (filled in by the kernel), length 0 (8 bytes), PadN of 4 bytes.
            set_opt(
                raw,
                libc::IPPROTO_IPV6,
                libc::IPV6_HOPOPTS,
                &[0, 0, 1, 4, 0, 0, 0, 0],
            );
        }
        if let Some(m) = how.mtu {
            let m = libc::c_int::try_from(m).unwrap_or(1280);
            set_opt(raw, libc::IPPROTO_IPV6, libc::IPV6_MTU, &m.to_ne_bytes());
        }
    }
    let id = u16::try_from(std::process::id() & 0xffff).unwrap_or(0) ^ 0x1f1f;
    let (req, rep) = if v4 { (8u8, 0u8) } else { (128u8, 129u8) };
    let mut buf = vec![0u8; 70000];
    for seq in 0u16..3 {
        let mut pkt = vec![req, 0, 0, 0];
        pkt.extend(id.to_be_bytes());
        pkt.extend(seq.to_be_bytes());
        pkt.extend(std::iter::repeat_n(0xa5u8, how.payload));
        if v4 {
            let c = checksum(&pkt);
            pkt[2..4].copy_from_slice(&c.to_be_bytes());
        }
        let _ = match dst {
            IpAddr::V4(a) => sendto(
                raw,
                &pkt,
                &SockaddrIn::from(std::net::SocketAddrV4::new(a, 0)),
                MsgFlags::empty(),
            ),
            IpAddr::V6(a) => sendto(
                raw,
                &pkt,
                &SockaddrIn6::from(std::net::SocketAddrV6::new(a, 0, 0, 0)),
                MsgFlags::empty(),
            ),
        };
        let deadline = Instant::now() + t / 3;
        while Instant::now() < deadline {
            let Ok((n, _)) = recvfrom::<SockaddrStorage>(raw, &mut buf) else {
                continue;
            };
            let icmp = if v4 {
                buf.get(usize::from(buf[0] & 0x0f) * 4..n)
            } else {
                buf.get(..n)
            };
            if let Some(icmp) = icmp
                && icmp.len() >= 8
                && icmp[0] == rep
                && icmp[4..6] == id.to_be_bytes()
                && icmp[6..8] == seq.to_be_bytes()
            {
                return Ok(true);
            }
        }
    }
    Ok(false)
}

/// A line echo server in a namespace: every accepted connection echoes each line until closed.
pub struct LineEcho;

impl LineEcho {
    /// Listens on `addrs` inside `ns`; serves until the process ends (the namespace's removal
    /// closes the sockets).
    pub fn start(ns: &str, addrs: &[SocketAddr]) {
        for a in addrs {
            let a = *a;
            let l = netns::run_in(ns, move || TcpListener::bind(a))
                .expect("netns")
                .expect("listen");
            std::thread::spawn(move || {
                for conn in l.incoming() {
                    let Ok(conn) = conn else { return };
                    std::thread::spawn(move || {
                        let mut w = conn.try_clone().expect("clone");
                        for line in BufReader::new(conn).lines() {
                            let Ok(line) = line else { return };
                            if w.write_all(format!("{line}\n").as_bytes()).is_err() {
                                return;
                            }
                        }
                    });
                }
            });
        }
    }
}
