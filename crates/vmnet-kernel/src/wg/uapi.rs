//! A small client of WireGuard's cross-platform configuration protocol (UAPI), spoken on the
//! unix socket `/var/run/wireguard/<interface>.sock` by `wireguard-go` (and by `wg`).
//!
//! One request per connection: `get=1` answers the device and its peers as `key=value` lines,
//! ended by `errno=N` and a blank line (the server keeps the connection open: we read until the
//! blank line, never to EOF); `set=1` takes `key=value` lines ended by a blank line and answers
//! `errno=N`. A `set` is one transaction: every peer change of a sync goes in one request,
//! without `replace_peers`, so peers the request does not name are left as they are.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Read;
use std::net::{IpAddr, SocketAddr};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use ipnet::IpNet;
use zeroize::Zeroizing;

use super::WgError;

/// Where `wireguard-go` puts the UAPI sockets (one directory for the whole machine, not per
/// network namespace: interface names must be unique across namespaces).
pub const SOCKET_DIR: &str = "/var/run/wireguard";

/// How long one request may take.
const TIMEOUT: Duration = Duration::from_secs(10);

/// The UAPI socket path of interface `ifname`.
#[must_use]
pub fn socket_path(ifname: &str) -> PathBuf {
    Path::new(SOCKET_DIR).join(format!("{ifname}.sock"))
}

/// What `get=1` shows of one peer.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct UapiPeer {
    /// Its endpoint, if known.
    pub endpoint: Option<SocketAddr>,
    /// Its allowed IPs, in the order shown.
    pub allowed_ips: Vec<IpNet>,
    /// Seconds since the epoch of the last handshake; 0 when none.
    pub last_handshake_sec: u64,
    /// Bytes received from it.
    pub rx_bytes: u64,
    /// Bytes sent to it.
    pub tx_bytes: u64,
    /// Persistent keepalive interval in seconds; 0 when off.
    pub keepalive: u16,
}

/// What `get=1` shows of the device.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct UapiDevice {
    /// Whether a private key is set.
    pub has_private_key: bool,
    /// Its listen port.
    pub listen_port: u16,
    /// Its peers by public key (32 bytes).
    pub peers: BTreeMap<[u8; 32], UapiPeer>,
}

/// A UAPI client of one interface.
#[derive(Debug, Clone)]
pub struct Uapi {
    path: PathBuf,
}

fn hex_key(v: &str) -> Result<[u8; 32], WgError> {
    let mut k = [0u8; 32];
    hex::decode_to_slice(v, &mut k)
        .map_err(|e| WgError::Protocol(format!("key {v:?} is not 32 bytes of hex: {e}")))?;
    Ok(k)
}

fn endpoint(v: &str) -> Option<SocketAddr> {
    SocketAddr::from_str(v).ok().or_else(|| {
        // wireguard-go writes IPv6 endpoints in brackets; accept a bare form too.
        let (a, p) = v.rsplit_once(':')?;
        Some(SocketAddr::new(IpAddr::from_str(a).ok()?, p.parse().ok()?))
    })
}

/// Parses a `get=1` answer (the lines before the final blank line).
///
/// # Errors
/// `Protocol` on a malformed line or a non-zero `errno`.
pub fn parse_get(text: &str) -> Result<UapiDevice, WgError> {
    let mut dev = UapiDevice::default();
    let mut cur: Option<([u8; 32], UapiPeer)> = None;
    let num = |k: &str, v: &str| {
        v.parse::<u64>()
            .map_err(|_| WgError::Protocol(format!("{k}={v}: not a number")))
    };
    for line in text.lines().filter(|l| !l.is_empty()) {
        let (k, v) = line
            .split_once('=')
            .ok_or_else(|| WgError::Protocol(format!("line {line:?} is not key=value")))?;
        match k {
            "errno" if v != "0" => return Err(WgError::Protocol(format!("get failed: errno={v}"))),
            "private_key" => dev.has_private_key = v.bytes().any(|b| b != b'0'),
            "listen_port" => {
                dev.listen_port = v
                    .parse()
                    .map_err(|_| WgError::Protocol(format!("listen_port={v}")))?;
            }
            "public_key" => {
                if let Some((k, p)) = cur.take() {
                    dev.peers.insert(k, p);
                }
                cur = Some((hex_key(v)?, UapiPeer::default()));
            }
            _ => {
                let Some((_, p)) = cur.as_mut() else { continue };
                match k {
                    "endpoint" => p.endpoint = endpoint(v),
                    "allowed_ip" => p.allowed_ips.push(
                        IpNet::from_str(v)
                            .map_err(|_| WgError::Protocol(format!("allowed_ip={v}")))?,
                    ),
                    "last_handshake_time_sec" => p.last_handshake_sec = num(k, v)?,
                    "rx_bytes" => p.rx_bytes = num(k, v)?,
                    "tx_bytes" => p.tx_bytes = num(k, v)?,
                    "persistent_keepalive_interval" => {
                        p.keepalive = u16::try_from(num(k, v)?).unwrap_or(u16::MAX);
                    }
                    _ => {}
                }
            }
        }
    }
    if let Some((k, p)) = cur.take() {
        dev.peers.insert(k, p);
    }
    Ok(dev)
}

/// One peer change of a `set` request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerChange {
    /// Create or update the peer: its endpoint and exactly these allowed IPs.
    Set {
        /// Public key.
        key: [u8; 32],
        /// Endpoint.
        endpoint: SocketAddr,
        /// The complete allowed IPs (they replace the peer's).
        allowed_ips: Vec<IpNet>,
        /// Persistent keepalive in seconds (0: off).
        keepalive: u16,
    },
    /// Remove the peer.
    Remove {
        /// Public key.
        key: [u8; 32],
    },
}

/// The text of a `set=1` request: the device's private key and port when given, then every
/// peer change; never `replace_peers`. Zeroed when dropped (it may hold the private key).
#[must_use]
pub fn set_text(
    private_key: Option<&[u8; 32]>,
    listen_port: Option<u16>,
    changes: &[PeerChange],
) -> Zeroizing<String> {
    let mut s = Zeroizing::new(String::from("set=1\n"));
    if let Some(k) = private_key {
        let hexed = Zeroizing::new(hex::encode(k));
        s.push_str("private_key=");
        s.push_str(&hexed);
        s.push('\n');
    }
    if let Some(p) = listen_port {
        let _ = writeln!(s, "listen_port={p}");
    }
    for c in changes {
        match c {
            PeerChange::Set {
                key,
                endpoint,
                allowed_ips,
                keepalive,
            } => {
                let _ = writeln!(s, "public_key={}", hex::encode(key));
                let _ = writeln!(s, "endpoint={endpoint}");
                let _ = writeln!(s, "persistent_keepalive_interval={keepalive}");
                s.push_str("replace_allowed_ips=true\n");
                for ip in allowed_ips {
                    let _ = writeln!(s, "allowed_ip={ip}");
                }
            }
            PeerChange::Remove { key } => {
                let _ = writeln!(s, "public_key={}\nremove=true", hex::encode(key));
            }
        }
    }
    s.push('\n');
    s
}

impl Uapi {
    /// A client of interface `ifname`'s socket.
    #[must_use]
    pub fn new(ifname: &str) -> Self {
        Self {
            path: socket_path(ifname),
        }
    }

    /// The socket path.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn connect(&self) -> Result<UnixStream, WgError> {
        let s = UnixStream::connect(&self.path).map_err(|e| WgError::Io {
            what: format!("connect to {}", self.path.display()),
            source: e,
        })?;
        s.set_read_timeout(Some(TIMEOUT)).ok();
        s.set_write_timeout(Some(TIMEOUT)).ok();
        Ok(s)
    }

    /// The pid of the process serving the socket (`SO_PEERCRED`).
    ///
    /// # Errors
    /// `Io` when nothing serves the socket.
    pub fn server_pid(&self) -> Result<u32, WgError> {
        let s = self.connect()?;
        let cred = nix::sys::socket::getsockopt(&s, nix::sys::socket::sockopt::PeerCredentials)
            .map_err(|e| WgError::Io {
                what: format!("peer credentials of {}", self.path.display()),
                source: e.into(),
            })?;
        u32::try_from(cred.pid())
            .map_err(|_| WgError::Protocol(format!("peer pid {} is negative", cred.pid())))
    }

    /// Sends `text` and reads the answer up to its blank line (or the end). The answer may
    /// hold the private key (`get=1`): every buffer it passes through is zeroed when dropped.
    /// A server that vanishes mid-request is an error of this request (`EPIPE`, never a
    /// signal: the socket is written with `MSG_NOSIGNAL`).
    fn request(&self, text: &str) -> Result<Zeroizing<String>, WgError> {
        let io = |what: &str| {
            let what = format!("{what} {}", self.path.display());
            move |source| WgError::Io { what, source }
        };
        let mut s = self.connect()?;
        let mut sent = 0;
        while sent < text.len() {
            let n = nix::sys::socket::send(
                std::os::fd::AsRawFd::as_raw_fd(&s),
                &text.as_bytes()[sent..],
                nix::sys::socket::MsgFlags::MSG_NOSIGNAL,
            )
            .map_err(|e| io("write to")(e.into()))?;
            sent += n;
        }
        let mut raw = Zeroizing::new(Vec::with_capacity(4096));
        let mut chunk = Zeroizing::new([0u8; 4096]);
        // The answer ends with a blank line; look for it only in what is new (and the byte
        // before), so a long answer costs one pass.
        let end = loop {
            let n = s.read(chunk.as_mut()).map_err(io("read from"))?;
            if n == 0 {
                return Err(WgError::Protocol(format!(
                    "{} closed the connection after {} bytes, before the end of its answer",
                    self.path.display(),
                    raw.len()
                )));
            }
            let from = raw.len().saturating_sub(1);
            raw.extend_from_slice(&chunk[..n]);
            if raw.first() == Some(&b'\n') {
                break 0;
            }
            if let Some(i) = raw[from..].windows(2).position(|w| w == b"\n\n") {
                break from + i + 1;
            }
        };
        let text = std::str::from_utf8(&raw[..end])
            .map_err(|_| WgError::Protocol("the answer is not UTF-8".into()))?;
        Ok(Zeroizing::new(text.to_owned()))
    }

    /// `get=1`.
    ///
    /// # Errors
    /// `Io` when the socket does not answer; `Protocol` on a malformed answer.
    pub fn get(&self) -> Result<UapiDevice, WgError> {
        parse_get(&self.request("get=1\n\n")?)
    }

    /// Sends a `set=1` request made by [`set_text`].
    ///
    /// # Errors
    /// `Io` when the socket does not answer; `Protocol` when the device refused the request.
    pub fn set(&self, text: &str) -> Result<(), WgError> {
        let answer = self.request(text)?;
        match answer.trim() {
            "errno=0" => Ok(()),
            other => Err(WgError::Protocol(format!("set refused: {other}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_get_answer_parses_with_its_peers() {
        let a = "a".repeat(64);
        let b = "b".repeat(64);
        let text = format!(
            "private_key={}\nlisten_port=51820\npublic_key={a}\nendpoint=[fd00:10::2]:51820\n\
             last_handshake_time_sec=17\nlast_handshake_time_nsec=3\nrx_bytes=10\ntx_bytes=20\n\
             persistent_keepalive_interval=25\nallowed_ip=fdaa::2/128\nprotocol_version=1\n\
             public_key={b}\nendpoint=10.10.0.3:51820\nallowed_ip=fdaa::3/128\nallowed_ip=10.1.0.0/16\nerrno=0\n",
            "1".repeat(64)
        );
        let d = parse_get(&text).unwrap();
        assert!(d.has_private_key);
        assert_eq!(d.listen_port, 51820);
        let pa = &d.peers[&[0xaa; 32]];
        assert_eq!(pa.endpoint, Some("[fd00:10::2]:51820".parse().unwrap()));
        assert_eq!(
            (
                pa.last_handshake_sec,
                pa.rx_bytes,
                pa.tx_bytes,
                pa.keepalive
            ),
            (17, 10, 20, 25)
        );
        assert_eq!(d.peers[&[0xbb; 32]].allowed_ips.len(), 2);
        assert!(parse_get("errno=2\n").is_err());
    }

    #[test]
    fn a_set_request_names_each_change_and_never_replaces_the_peer_set() {
        let t = set_text(
            Some(&[1; 32]),
            Some(51820),
            &[
                PeerChange::Set {
                    key: [2; 32],
                    endpoint: "[fd00:10::2]:51820".parse().unwrap(),
                    allowed_ips: vec!["fdaa::2/128".parse().unwrap()],
                    keepalive: 25,
                },
                PeerChange::Remove { key: [3; 32] },
            ],
        );
        let want = format!(
            "set=1\nprivate_key={}\nlisten_port=51820\npublic_key={}\nendpoint=[fd00:10::2]:51820\n\
             persistent_keepalive_interval=25\nreplace_allowed_ips=true\nallowed_ip=fdaa::2/128\n\
             public_key={}\nremove=true\n\n",
            "01".repeat(32),
            "02".repeat(32),
            "03".repeat(32)
        );
        assert_eq!(t.as_str(), want);
        assert!(!t.contains("replace_peers"));
    }
}
