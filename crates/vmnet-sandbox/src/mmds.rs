//! A metadata-service client for checks from inside a simulated guest: one raw HTTP request
//! (the bytes as given, so checks can send forged headers or absolute-form URIs) to
//! 169.254.169.254:80 from a namespace, optionally from a chosen source address, read until the
//! service closes the connection.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpStream};
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use nix::sys::socket::{AddressFamily, SockFlag, SockType, SockaddrIn, bind, connect, socket};

use crate::{SandboxError, netns};

/// The metadata address.
pub const MMDS_V4: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);

/// One answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MmdsReply {
    /// The HTTP status code.
    pub status: u16,
    /// The body, as text.
    pub body: String,
    /// How long the request took, connect to close.
    pub elapsed: Duration,
}

/// A `GET` of `path` with `headers` (`Name: value` lines without CRLF), closing the connection.
#[must_use]
pub fn get_request(path: &str, headers: &[&str]) -> String {
    let mut r = format!("GET {path} HTTP/1.1\r\nHost: 169.254.169.254\r\nConnection: close\r\n");
    for h in headers {
        r.push_str(h);
        r.push_str("\r\n");
    }
    r.push_str("\r\n");
    r
}

/// A token `PUT` asking for `ttl` seconds.
#[must_use]
pub fn token_request(ttl: u32) -> String {
    format!(
        "PUT /latest/api/token HTTP/1.1\r\nHost: 169.254.169.254\r\nConnection: close\r\nX-metadata-token-ttl-seconds: {ttl}\r\nContent-Length: 0\r\n\r\n"
    )
}

fn exchange(source: Option<Ipv4Addr>, raw: &str, timeout: Duration) -> std::io::Result<MmdsReply> {
    let started = Instant::now();
    let fd: OwnedFd = socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    if let Some(s) = source {
        bind(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            &SockaddrIn::from(SocketAddrV4::new(s, 0)),
        )?;
    }
    let mut stream = TcpStream::from(fd);
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    // A blocking connect bounded by the socket's send timeout.
    connect(
        std::os::fd::AsRawFd::as_raw_fd(&stream),
        &SockaddrIn::from(SocketAddrV4::new(MMDS_V4, 80)),
    )?;
    stream.write_all(raw.as_bytes())?;
    let mut buf = Vec::new();
    stream.read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP response: {text:?}")))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok(MmdsReply {
        status,
        body,
        elapsed: started.elapsed(),
    })
}

/// Sends `raw` to the metadata service from namespace `ns` (from `source` when given).
///
/// # Errors
/// When the namespace cannot be entered, or the connection or the exchange fails or times out.
pub fn request(
    ns: &str,
    source: Option<Ipv4Addr>,
    raw: &str,
    timeout: Duration,
) -> Result<MmdsReply, SandboxError> {
    netns::run_in(ns, || exchange(source, raw, timeout))?
        .map_err(|e| SandboxError::io(format!("netns {ns}: metadata request"), e))
}

/// `GET path` with a fresh version-2 token: the token `PUT`, then the `GET` carrying it.
///
/// # Errors
/// As [`request`], or when the token `PUT` is not answered 200.
pub fn get_with_token(ns: &str, path: &str, timeout: Duration) -> Result<MmdsReply, SandboxError> {
    let t = request(ns, None, &token_request(60), timeout)?;
    if t.status != 200 {
        return Err(SandboxError::io(
            format!("netns {ns}: metadata token"),
            std::io::Error::other(format!("{} {}", t.status, t.body)),
        ));
    }
    let header = format!("X-metadata-token: {}", t.body.trim());
    request(ns, None, &get_request(path, &[&header]), timeout)
}
