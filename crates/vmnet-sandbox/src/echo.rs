//! A TCP and UDP echo service inside a namespace that tells the client what it saw.
//!
//! # Protocol
//! - TCP: the client sends up to 4 KiB ending in `\n` (or shuts down its write side); the server
//!   answers with one header line `peer=<ip:port> syn_mss=<n|none>\n`, then the bytes it
//!   received, and closes. `syn_mss` is the MSS option of the client's SYN *as it arrived*
//!   (from `TCP_SAVED_SYN`), so a test sees the clamp applied on the path.
//! - UDP: each datagram is answered with `peer=<ip:port>\n` followed by the datagram.
//!
//! [`crate::traffic::tcp_echo`] and [`crate::traffic::udp_echo`] speak it and parse the answer.
//!
//! # Design
//! One thread per listening socket, started inside the namespace; sockets wait with a 100 ms
//! receive timeout so the threads notice [`EchoService`]'s drop and exit. Each accepted TCP
//! connection is served on its own short-lived thread.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::{SandboxError, netns};

const POLL: Duration = Duration::from_millis(100);
const MAX_MESSAGE: usize = 4096;

/// One request the service answered (or tried to): which socket, from whom.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    /// `true` for TCP, `false` for UDP.
    pub tcp: bool,
    /// The listening address that received it.
    pub local: SocketAddr,
    /// The client address as it arrived.
    pub peer: SocketAddr,
}

type SeenLog = Arc<Mutex<Vec<Seen>>>;

/// A running echo service; stops when dropped.
#[derive(Debug)]
pub struct EchoService {
    stop: Arc<AtomicBool>,
    seen: SeenLog,
    threads: Vec<JoinHandle<Result<(), SandboxError>>>,
    addrs: Vec<SocketAddr>,
}

impl EchoService {
    /// Starts TCP and UDP echo on each of `addrs` inside the named namespace. Returns once all
    /// sockets listen.
    ///
    /// # Errors
    /// When the namespace cannot be entered or a socket cannot be bound (the threads already
    /// started are stopped).
    pub fn start(ns: &str, addrs: &[SocketAddr]) -> Result<Self, SandboxError> {
        let mut svc = Self {
            stop: Arc::new(AtomicBool::new(false)),
            seen: Arc::default(),
            threads: Vec::new(),
            addrs: addrs.to_vec(),
        };
        for &addr in addrs {
            for tcp in [true, false] {
                let (tx, rx) = mpsc::channel::<Result<(), SandboxError>>();
                let stop = Arc::clone(&svc.stop);
                let seen = Arc::clone(&svc.seen);
                let name = format!("echo-{}-{addr}", if tcp { "tcp" } else { "udp" });
                let handle = netns::spawn_in(ns, &name, move || {
                    if tcp {
                        serve_tcp(addr, &stop, &seen, &tx)
                    } else {
                        serve_udp(addr, &stop, &seen, &tx)
                    }
                })?;
                svc.threads.push(handle);
                match rx.recv_timeout(Duration::from_secs(10)) {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return Err(e),
                    Err(_) => {
                        // The thread ended before listening (e.g. setns failed): return its error.
                        let h = svc.threads.pop().expect("just pushed");
                        return Err(match h.join() {
                            Ok(Err(e)) => e,
                            Ok(Ok(())) => SandboxError::Unexpected(format!(
                                "echo {name}: stopped before listening"
                            )),
                            _ => SandboxError::Unexpected(format!("echo {name}: did not start")),
                        });
                    }
                }
            }
        }
        Ok(svc)
    }

    /// The addresses it listens on (TCP and UDP each).
    #[must_use]
    pub fn addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// Every request received so far, oldest first (one-way checks look here).
    #[must_use]
    pub fn seen(&self) -> Vec<Seen> {
        self.seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Blocks until the service is stopped from elsewhere (used by a background process, which
    /// ends on a signal).
    pub fn wait(mut self) {
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

impl Drop for EchoService {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

fn set_int_opt(fd: i32, level: i32, opt: i32, value: i32) -> std::io::Result<()> {
    // SAFETY: `fd` is an open socket owned by the caller; the option value is a valid c_int and
    // its size is passed.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            opt,
            std::ptr::from_ref(&value).cast(),
            libc::socklen_t::try_from(size_of::<i32>()).unwrap_or(4),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn serve_tcp(
    addr: SocketAddr,
    stop: &AtomicBool,
    seen: &SeenLog,
    ready: &mpsc::Sender<Result<(), SandboxError>>,
) {
    let what = format!("echo tcp {addr}");
    let listener = match TcpListener::bind(addr).and_then(|l| {
        set_int_opt(l.as_raw_fd(), libc::IPPROTO_TCP, libc::TCP_SAVE_SYN, 1).map(|()| l)
    }) {
        Ok(l) => l,
        Err(e) => {
            let _ = ready.send(Err(SandboxError::io(format!("{what}: bind"), e)));
            return;
        }
    };
    if let Err(e) = listener.set_nonblocking(true) {
        let _ = ready.send(Err(SandboxError::io(format!("{what}: nonblocking"), e)));
        return;
    }
    let _ = ready.send(Ok(()));
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((stream, peer)) => {
                seen.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(Seen {
                        tcp: true,
                        local: addr,
                        peer,
                    });
                std::thread::spawn(move || {
                    let _ = answer_tcp(stream, peer);
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(_) => std::thread::sleep(POLL),
        }
    }
}

fn answer_tcp(mut stream: TcpStream, peer: SocketAddr) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let syn_mss = saved_syn(stream.as_raw_fd()).and_then(|syn| syn_mss(&syn));
    let mut data = Vec::new();
    let mut buf = [0u8; 1024];
    while data.len() < MAX_MESSAGE && !data.ends_with(b"\n") {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => data.extend_from_slice(&buf[..n]),
        }
    }
    let mss = syn_mss.map_or_else(|| "none".to_owned(), |m| m.to_string());
    let mut reply = format!("peer={peer} syn_mss={mss}\n").into_bytes();
    reply.extend_from_slice(&data);
    stream.write_all(&reply)?;
    stream.shutdown(std::net::Shutdown::Both)
}

/// The network and TCP headers of the SYN that opened the accepted socket `fd`.
fn saved_syn(fd: i32) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; 512];
    let mut len = libc::socklen_t::try_from(buf.len()).ok()?;
    // SAFETY: `fd` is an open socket; `buf` has `len` writable bytes and the kernel writes at
    // most `len` of them, updating `len`.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_SAVED_SYN,
            buf.as_mut_ptr().cast(),
            &raw mut len,
        )
    };
    if rc != 0 {
        return None;
    }
    buf.truncate(usize::try_from(len).ok()?);
    Some(buf)
}

/// The MSS option of a saved SYN (IPv4 or IPv6 header followed by the TCP header).
#[must_use]
pub fn syn_mss(syn: &[u8]) -> Option<u16> {
    let ip_len = match syn.first()? >> 4 {
        4 => usize::from(syn[0] & 0x0f) * 4,
        6 => 40,
        _ => return None,
    };
    let tcp = syn.get(ip_len..)?;
    let tcp_len = usize::from(tcp.get(12)? >> 4) * 4;
    let mut opts = tcp.get(20..tcp_len)?;
    while let Some(&kind) = opts.first() {
        match kind {
            0 => break,
            1 => opts = &opts[1..],
            _ => {
                let len = usize::from(*opts.get(1)?);
                if len < 2 || len > opts.len() {
                    return None;
                }
                if kind == 2 && len == 4 {
                    return Some(u16::from_be_bytes([opts[2], opts[3]]));
                }
                opts = &opts[len..];
            }
        }
    }
    None
}

fn serve_udp(
    addr: SocketAddr,
    stop: &AtomicBool,
    seen: &SeenLog,
    ready: &mpsc::Sender<Result<(), SandboxError>>,
) {
    let what = format!("echo udp {addr}");
    let socket = match UdpSocket::bind(addr) {
        Ok(s) => s,
        Err(e) => {
            let _ = ready.send(Err(SandboxError::io(format!("{what}: bind"), e)));
            return;
        }
    };
    if let Err(e) = socket.set_read_timeout(Some(POLL)) {
        let _ = ready.send(Err(SandboxError::io(format!("{what}: timeout"), e)));
        return;
    }
    let _ = ready.send(Ok(()));
    let mut buf = vec![0u8; 65536];
    while !stop.load(Ordering::Relaxed) {
        if let Ok((n, peer)) = socket.recv_from(&mut buf) {
            seen.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(Seen {
                    tcp: false,
                    local: addr,
                    peer,
                });
            let mut reply = format!("peer={peer}\n").into_bytes();
            reply.extend_from_slice(&buf[..n]);
            let _ = socket.send_to(&reply, peer);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::syn_mss;

    #[test]
    fn mss_from_ipv4_syn() {
        let mut syn = vec![0x45u8; 1];
        syn.extend([0u8; 19]);
        // TCP header with data offset 7 words: 20 bytes + NOP, NOP, MSS 1340, EOL padding.
        let mut tcp = vec![0u8; 12];
        tcp.push(7 << 4);
        tcp.extend([0u8; 7]);
        tcp.extend([1, 1, 2, 4, 0x05, 0x3c, 0, 0]);
        syn.extend(tcp);
        assert_eq!(syn_mss(&syn), Some(1340));
    }

    #[test]
    fn no_mss_option() {
        let mut syn = vec![0x60u8];
        syn.extend([0u8; 39]);
        let mut tcp = vec![0u8; 12];
        tcp.push(5 << 4);
        tcp.extend([0u8; 7]);
        syn.extend(tcp);
        assert_eq!(syn_mss(&syn), None);
        assert_eq!(syn_mss(&[0x10]), None);
    }
}
