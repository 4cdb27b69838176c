//! Raw Ethernet probes for sandboxes and tests: build frames (including spoofed ones), send
//! them out of an interface inside a namespace, and capture what arrives at another.
//!
//! # Design
//! `AF_PACKET` sockets opened on a thread inside the namespace ([`crate::netns::run_in`]); the
//! socket keeps its namespace, so the capture reads it from an ordinary thread. Every probe frame
//! carries a unique marker so a receiver can tell exactly which frame arrived.
//!
//! # Limitations
//! Checksums of UDP and ICMPv6 are left zero/unchecked (the bridge does not verify them and the
//! receivers are raw captures); the IPv4 header checksum is computed.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vmnet_model::nic::MacAddr;

/// The broadcast MAC.
pub const BROADCAST: MacAddr = MacAddr([0xff; 6]);
/// The all-nodes IPv6 multicast MAC (`33:33:00:00:00:01`).
pub const ALL_NODES_MAC: MacAddr = MacAddr([0x33, 0x33, 0, 0, 0, 1]);

fn eth(dst: MacAddr, src: MacAddr, ethertype: u16, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(14 + payload.len());
    f.extend(dst.octets());
    f.extend(src.octets());
    f.extend(ethertype.to_be_bytes());
    f.extend(payload);
    f
}

fn ipv4_checksum(h: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    for c in h.chunks(2) {
        sum += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !u16::try_from(sum).unwrap_or(0xffff)
}

fn udp(sport: u16, dport: u16, payload: &[u8]) -> Vec<u8> {
    let len = u16::try_from(8 + payload.len()).unwrap_or(u16::MAX);
    let mut u = Vec::new();
    u.extend(sport.to_be_bytes());
    u.extend(dport.to_be_bytes());
    u.extend(len.to_be_bytes());
    u.extend([0, 0]);
    u.extend(payload);
    u
}

/// An Ethernet frame carrying IPv4/UDP from `src_ip:sport` to `dst_ip:dport` with `payload`.
#[must_use]
pub fn udp4_frame(
    dst: MacAddr,
    src: MacAddr,
    src_ip: Ipv4Addr,
    dst_ip: Ipv4Addr,
    ports: (u16, u16),
    payload: &[u8],
) -> Vec<u8> {
    eth(
        dst,
        src,
        0x0800,
        &ipv4(src_ip, dst_ip, 17, &udp(ports.0, ports.1, payload)),
    )
}

/// An Ethernet frame carrying ICMP of `icmp_type` (5 = redirect, 8 = echo request, 9 = router
/// advertisement) from `src_ip` to `dst_ip`, `payload` after the 8-byte ICMP header.
#[must_use]
pub fn icmp4_frame(
    dst: MacAddr,
    src: MacAddr,
    src_ip: Ipv4Addr,
    dst_ip: Ipv4Addr,
    icmp_type: u8,
    payload: &[u8],
) -> Vec<u8> {
    let mut body = vec![icmp_type, 0, 0, 0, 0, 0, 0, 0];
    body.extend(payload);
    eth(dst, src, 0x0800, &ipv4(src_ip, dst_ip, 1, &body))
}

fn ipv4(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, body: &[u8]) -> Vec<u8> {
    let total = u16::try_from(20 + body.len()).unwrap_or(u16::MAX);
    let mut ip = vec![0x45, 0];
    ip.extend(total.to_be_bytes());
    ip.extend([0, 0, 0x40, 0, 64, proto, 0, 0]);
    ip.extend(src.octets());
    ip.extend(dst.octets());
    let c = ipv4_checksum(&ip);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    ip.extend(body);
    ip
}

fn ipv6(src: Ipv6Addr, dst: Ipv6Addr, next: u8, hop: u8, body: &[u8]) -> Vec<u8> {
    let len = u16::try_from(body.len()).unwrap_or(u16::MAX);
    let mut p = vec![0x60, 0, 0, 0];
    p.extend(len.to_be_bytes());
    p.push(next);
    p.push(hop);
    p.extend(src.octets());
    p.extend(dst.octets());
    p.extend(body);
    p
}

/// An Ethernet frame carrying IPv6/UDP.
#[must_use]
pub fn udp6_frame(
    dst: MacAddr,
    src: MacAddr,
    src_ip: Ipv6Addr,
    dst_ip: Ipv6Addr,
    ports: (u16, u16),
    payload: &[u8],
) -> Vec<u8> {
    eth(
        dst,
        src,
        0x86dd,
        &ipv6(src_ip, dst_ip, 17, 64, &udp(ports.0, ports.1, payload)),
    )
}

/// An Ethernet frame carrying ICMPv6 of `icmp_type` (134 = router advertisement, 137 =
/// redirect, 128 = echo request) from `src_ip` to `dst_ip`, hop limit 255.
#[must_use]
pub fn icmp6_frame(
    dst: MacAddr,
    src: MacAddr,
    src_ip: Ipv6Addr,
    dst_ip: Ipv6Addr,
    icmp_type: u8,
    payload: &[u8],
) -> Vec<u8> {
    let mut body = vec![icmp_type, 0, 0, 0, 0, 0, 0, 0];
    body.extend(payload);
    eth(dst, src, 0x86dd, &ipv6(src_ip, dst_ip, 58, 255, &body))
}

/// The ICMPv6 checksum of `msg` (its checksum field zero) from `src` to `dst`.
fn icmp6_checksum(src: Ipv6Addr, dst: Ipv6Addr, msg: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    let mut add = |bytes: &[u8]| {
        for c in bytes.chunks(2) {
            sum += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
        }
    };
    add(&src.octets());
    add(&dst.octets());
    add(&u32::try_from(msg.len()).unwrap_or(u32::MAX).to_be_bytes());
    add(&[0, 0, 0, 58]);
    add(msg);
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !u16::try_from(sum).unwrap_or(0xffff)
}

/// An Ethernet frame carrying the ICMPv6 message `msg` (type first, checksum bytes 2..4 filled
/// in here) from `src_ip` to `dst_ip`, hop limit 255: a message the receiver verifies and could
/// act on.
#[must_use]
pub fn icmp6_message(
    dst: MacAddr,
    src: MacAddr,
    src_ip: Ipv6Addr,
    dst_ip: Ipv6Addr,
    msg: &[u8],
) -> Vec<u8> {
    let mut m = msg.to_vec();
    if m.len() >= 4 {
        m[2] = 0;
        m[3] = 0;
        let c = icmp6_checksum(src_ip, dst_ip, &m);
        m[2..4].copy_from_slice(&c.to_be_bytes());
    }
    eth(dst, src, 0x86dd, &ipv6(src_ip, dst_ip, 58, 255, &m))
}

/// A router advertisement (ICMPv6 134, router lifetime 1800 s) with one prefix information
/// option for `prefix`/64 (on-link, autonomous: a host configures an address in it), followed
/// by `marker` as padding.
#[must_use]
pub fn router_advertisement(prefix: Ipv6Addr, marker: &[u8]) -> Vec<u8> {
    let mut m = vec![134, 0, 0, 0, 64, 0];
    m.extend(1800u16.to_be_bytes());
    m.extend([0; 8]); // reachable time, retransmission timer
    m.extend([3, 4, 64, 0xc0]);
    m.extend(86_400u32.to_be_bytes());
    m.extend(14_400u32.to_be_bytes());
    m.extend([0; 4]);
    m.extend(prefix.octets());
    // The marker as an option the receiver skips: type 200, length in units of 8 bytes.
    let len = (marker.len() + 2).div_ceil(8);
    m.push(200);
    m.push(u8::try_from(len).unwrap_or(u8::MAX));
    let mut pad = marker.to_vec();
    pad.resize(len * 8 - 2, 0);
    m.extend(pad);
    m
}

/// A redirect (ICMPv6 137): "`destination` is better reached through `target`", followed by
/// `marker` in a redirected-header option.
#[must_use]
pub fn redirect(target: Ipv6Addr, destination: Ipv6Addr, marker: &[u8]) -> Vec<u8> {
    let mut m = vec![137, 0, 0, 0, 0, 0, 0, 0];
    m.extend(target.octets());
    m.extend(destination.octets());
    let len = (marker.len() + 8).div_ceil(8);
    m.extend([4, u8::try_from(len).unwrap_or(u8::MAX), 0, 0, 0, 0, 0, 0]);
    let mut pad = marker.to_vec();
    pad.resize(len * 8 - 8, 0);
    m.extend(pad);
    m
}

/// An ARP reply `sender_mac`/`sender_ip` → `target_mac`/`target_ip` in a frame from `src`,
/// padded with `marker`.
#[must_use]
pub fn arp_reply_frame(
    dst: MacAddr,
    src: MacAddr,
    sender: (MacAddr, Ipv4Addr),
    target: (MacAddr, Ipv4Addr),
    marker: &[u8],
) -> Vec<u8> {
    let mut a = vec![0, 1, 0x08, 0, 6, 4, 0, 2];
    a.extend(sender.0.octets());
    a.extend(sender.1.octets());
    a.extend(target.0.octets());
    a.extend(target.1.octets());
    a.extend(marker);
    eth(dst, src, 0x0806, &a)
}

fn packet_socket(ifname: &str) -> std::io::Result<OwnedFd> {
    let idx = nix::net::if_::if_nametoindex(ifname).map_err(std::io::Error::from)?;
    let proto = u16::try_from(libc::ETH_P_ALL).unwrap_or(3).to_be();
    // SAFETY: plain socket(2) call; the result is checked before use.
    let fd = unsafe {
        libc::socket(
            libc::AF_PACKET,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            i32::from(proto),
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_ll is plain old data; all-zero is a valid starting value.
    let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sll.sll_family = u16::try_from(libc::AF_PACKET).unwrap_or(17);
    sll.sll_protocol = proto;
    sll.sll_ifindex = i32::try_from(idx).unwrap_or(0);
    let len = u32::try_from(std::mem::size_of::<libc::sockaddr_ll>()).unwrap_or(20);
    // SAFETY: `sll` is a valid sockaddr_ll of `len` bytes and `fd` is an open packet socket.
    let r = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            std::ptr::from_ref(&sll).cast::<libc::sockaddr>(),
            len,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(fd)
}

/// Sends `frame` as is out of interface `ifname` in namespace `ns`.
///
/// # Errors
/// When the namespace, the socket or the send fails.
pub fn send_frame(ns: &str, ifname: &str, frame: &[u8]) -> std::io::Result<()> {
    let fd = vmnet_kernel::netns::run_in(ns, || packet_socket(ifname))
        .map_err(std::io::Error::other)??;
    // SAFETY: `frame` is a valid buffer of its length; `fd` is a bound packet socket.
    let n = unsafe { libc::send(fd.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
    if n < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Frames received on one interface, collected by a background thread until dropped.
#[derive(Debug)]
pub struct Capture {
    frames: Arc<Mutex<Vec<Vec<u8>>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Capture {
    /// Starts capturing incoming frames (not the interface's own outgoing ones) on `ifname` in
    /// namespace `ns`.
    ///
    /// # Errors
    /// When the namespace or the socket fails.
    pub fn start(ns: &str, ifname: &str) -> std::io::Result<Self> {
        let fd = vmnet_kernel::netns::run_in(ns, || packet_socket(ifname))
            .map_err(std::io::Error::other)??;
        let tv = libc::timeval {
            tv_sec: 0,
            tv_usec: 50_000,
        };
        let tvlen = u32::try_from(std::mem::size_of::<libc::timeval>()).unwrap_or(16);
        // SAFETY: `tv` is a valid timeval for SO_RCVTIMEO.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                std::ptr::from_ref(&tv).cast(),
                tvlen,
            );
        }
        let frames = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (f2, s2) = (Arc::clone(&frames), Arc::clone(&stop));
        let thread = std::thread::spawn(move || {
            let mut buf = vec![0u8; 65536];
            while !s2.load(Ordering::Relaxed) {
                // SAFETY: sockaddr_ll is plain old data.
                let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
                let mut sl = u32::try_from(std::mem::size_of::<libc::sockaddr_ll>()).unwrap_or(20);
                // SAFETY: `buf` and `sll` are valid for writes of the given sizes.
                let n = unsafe {
                    libc::recvfrom(
                        fd.as_raw_fd(),
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                        0,
                        std::ptr::from_mut(&mut sll).cast(),
                        &raw mut sl,
                    )
                };
                if let Ok(n) = usize::try_from(n)
                    && sll.sll_pkttype != 4
                {
                    // 4 = PACKET_OUTGOING
                    f2.lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push(buf[..n].to_vec());
                }
            }
        });
        Ok(Self {
            frames,
            stop,
            thread: Some(thread),
        })
    }

    /// Every frame received so far.
    #[must_use]
    pub fn frames(&self) -> Vec<Vec<u8>> {
        self.frames
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Whether a frame containing `marker` arrived, waiting up to `wait`.
    #[must_use]
    pub fn saw(&self, marker: &[u8], wait: Duration) -> bool {
        let deadline = Instant::now() + wait;
        loop {
            {
                let f = self
                    .frames
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if f.iter()
                    .any(|fr| fr.windows(marker.len()).any(|w| w == marker))
                {
                    return true;
                }
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
