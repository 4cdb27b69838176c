//! The typed protocol between the agent and the metadata worker, over one unix socketpair.
//!
//! # Frames
//! Each message is one frame: an 8-byte header (body length and descriptor count, each a
//! big-endian `u32`) and a JSON body. A frame that carries descriptors (only
//! [`ToWorker::Listen`], one listening socket) sends them with `SCM_RIGHTS` on its first bytes;
//! the reader queues the descriptors it receives and hands a frame exactly as many as its
//! header names. Bodies are at most [`MAX_FRAME`] bytes. Every buffer that held a frame is
//! zeroed when dropped (frames carry the token key and provider credentials).
//!
//! # Messages
//! Agent → worker ([`ToWorker`]): `hello` (the token key, the HTTP client's settings; first and
//! once), `listen` (a VM's listener and document), `document` (a VM's new document), `forget`
//! (stop serving a VM) and `poll` (one provider poll: the ready `Authorization` header, the
//! machines). Worker → agent ([`FromWorker`]): `ready` (after `hello`) and `polled` (one poll's
//! outcome, by the id the agent gave it). The worker can answer polls the agent asked for, and
//! nothing else: the agent checks every answer against the job it sent ([`super::check`]) and
//! ends the worker on anything else, including descriptors sent its way.

use std::collections::VecDeque;
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::io::Interest;
use tokio::net::UnixStream;
use vmnet_model::pool::{Machine, Provider};
use vmnet_model::vm::metadata::MetadataVersion;
use zeroize::Zeroizing;

/// The largest frame body either side accepts, bytes.
pub const MAX_FRAME: u32 = 32 << 20;
/// The most descriptors one frame may carry.
pub const MAX_FRAME_FDS: u32 = 4;

/// A secret string on the wire: `Debug` shows `..`, the memory is zeroed when dropped.
pub struct WireSecret(pub SecretString);

impl std::fmt::Debug for WireSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("..")
    }
}

impl Serialize for WireSecret {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.0.expose_secret())
    }
}

impl<'de> Deserialize<'de> for WireSecret {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = Zeroizing::new(String::deserialize(d)?);
        Ok(Self(SecretString::from(s.as_str())))
    }
}

/// The provider client's settings, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpWire {
    /// One request's timeout.
    pub request_timeout_ms: u64,
    /// The connect timeout.
    pub connect_timeout_ms: u64,
    /// Attempts while the provider answers 429.
    pub rate_limit_attempts: u32,
    /// The longest `Retry-After` waited for.
    pub max_retry_wait_ms: u64,
    /// Requests of one poll in flight at once.
    pub concurrency: u32,
}

/// A message from the agent to the worker.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case", deny_unknown_fields)]
pub enum ToWorker {
    /// The first message: the key every VM's tokens are made with (64 hex digits) and the
    /// provider client's settings.
    Hello {
        /// The token key, hex.
        token_key: WireSecret,
        /// The HTTP client's settings.
        http: HttpWire,
    },
    /// Serve VM `vm` on the listening socket this frame carries (one descriptor), replacing any
    /// listener it had.
    Listen {
        /// The VM's id.
        vm: String,
        /// Its MMDS version.
        version: MetadataVersion,
        /// Its document.
        document: Value,
    },
    /// VM `vm`'s new document (its listener stays).
    Document {
        /// The VM's id.
        vm: String,
        /// Its MMDS version.
        version: MetadataVersion,
        /// Its document.
        document: Value,
    },
    /// Stop serving VM `vm`: close its listener and connections.
    Forget {
        /// The VM's id.
        vm: String,
    },
    /// Everything sent before this is in place: answer [`FromWorker::Synced`] with `upto`.
    Sync {
        /// The agent's number of the newest change sent before it.
        upto: u64,
    },
    /// One provider poll; answered by [`FromWorker::Polled`] with the same `id`.
    Poll {
        /// The agent's id of this poll.
        id: u64,
        /// The provider.
        provider: Provider,
        /// The API base URL.
        api_url: String,
        /// The `Authorization` header value.
        authorization: WireSecret,
        /// The machines, `(instance id, machine)`.
        machines: Vec<(String, Machine)>,
        /// Attempts while the provider answers 429.
        rate_limit_attempts: u32,
        /// The longest `Retry-After` waited for, ms.
        max_retry_wait_ms: u64,
        /// Requests in flight at once.
        concurrency: u32,
    },
}

/// One machine's result in a [`WireReport`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WireMachine {
    /// The instance.
    pub instance_id: String,
    /// Its addresses, `None` when its own call failed.
    pub addresses: Option<Vec<ipnet::IpNet>>,
}

/// A poll's report as the worker sends it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WireReport {
    /// Per machine.
    pub results: Vec<WireMachine>,
    /// Instances whose machine the provider does not list.
    pub missing: Vec<String>,
    /// Per-machine failures.
    pub errors: Vec<(String, crate::provider::PollError)>,
    /// Requests sent.
    pub requests: u64,
}

/// A message from the worker to the agent.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case", deny_unknown_fields)]
pub enum FromWorker {
    /// The worker took the `hello` and serves.
    Ready {},
    /// Poll `id` ended: its report, or its error and the requests it sent.
    Polled {
        /// The id the agent gave the poll.
        id: u64,
        /// The report, when the poll succeeded.
        report: Option<WireReport>,
        /// The error, when it failed.
        error: Option<crate::provider::PollError>,
        /// Requests the failed poll sent.
        requests: u64,
    },
    /// Every message before the `sync` of `upto` is in place.
    Synced {
        /// The number the `sync` carried.
        upto: u64,
    },
    /// The metadata requests answered since the last such message, by HTTP status, and the
    /// connections refused (sent every [`COUNTS_PERIOD`] when there are any).
    MetadataCounts {
        /// Requests by status: pairs of a status 100-599 and a count, at most
        /// [`MAX_STATUSES`] of them. A list, not a map: this enum is internally tagged, and
        /// serde reads a tagged variant through a buffer that does not turn JSON's string keys
        /// back into numbers.
        requests: Vec<(u16, u64)>,
        /// Connections refused.
        refused: u64,
    },
}

/// How often the worker reports its metadata counts.
pub const COUNTS_PERIOD: std::time::Duration = std::time::Duration::from_secs(2);

/// The most statuses one [`FromWorker::MetadataCounts`] may carry.
pub const MAX_STATUSES: usize = 32;

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    /// The socket failed.
    #[error("socket: {0}")]
    Io(#[from] std::io::Error),
    /// The peer broke the protocol (a bad length, too many descriptors, JSON that is not a
    /// message).
    #[error("protocol: {0}")]
    Violation(String),
}

/// A frame's body (zeroed when dropped) and the descriptors it carried.
pub type Frame = (Zeroizing<Vec<u8>>, Vec<OwnedFd>);

/// One end of the socketpair: frames in and out, with descriptors.
#[derive(Debug)]
pub struct Channel {
    sock: UnixStream,
    buf: Zeroizing<Vec<u8>>,
    fds: VecDeque<OwnedFd>,
}

/// Encodes `msg` as a frame's body.
///
/// # Errors
/// When it does not serialise (never for these types) or is over [`MAX_FRAME`].
pub fn encode<T: Serialize>(msg: &T) -> Result<Zeroizing<Vec<u8>>, ProtoError> {
    let body = Zeroizing::new(
        serde_json::to_vec(msg).map_err(|e| ProtoError::Violation(format!("encode: {e}")))?,
    );
    if body.len() > MAX_FRAME as usize {
        return Err(ProtoError::Violation(format!(
            "a message of {} bytes is over {MAX_FRAME}",
            body.len()
        )));
    }
    Ok(body)
}

/// Decodes a frame's body as `T`.
///
/// # Errors
/// [`ProtoError::Violation`] when it is not a `T`.
pub fn decode<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ProtoError> {
    serde_json::from_slice(body).map_err(|e| ProtoError::Violation(format!("message: {e}")))
}

impl Channel {
    /// A channel over `sock` (non-blocking, registered with the current runtime).
    #[must_use]
    pub fn new(sock: UnixStream) -> Self {
        Self {
            sock,
            buf: Zeroizing::new(Vec::new()),
            fds: VecDeque::new(),
        }
    }

    /// Sends one frame with `body` and `fds` (the descriptors go with its first bytes; the
    /// caller keeps its own).
    ///
    /// # Errors
    /// The socket's error (`EPIPE` when the peer is gone), or a frame over the limits.
    pub async fn send(&self, body: &[u8], fds: &[BorrowedFd<'_>]) -> Result<(), ProtoError> {
        let len = u32::try_from(body.len())
            .ok()
            .filter(|l| *l <= MAX_FRAME)
            .ok_or_else(|| ProtoError::Violation("frame too large".into()))?;
        let nfds = u32::try_from(fds.len())
            .ok()
            .filter(|n| *n <= MAX_FRAME_FDS)
            .ok_or_else(|| ProtoError::Violation("too many descriptors".into()))?;
        let mut frame = Zeroizing::new(Vec::with_capacity(8 + body.len()));
        frame.extend_from_slice(&len.to_be_bytes());
        frame.extend_from_slice(&nfds.to_be_bytes());
        frame.extend_from_slice(body);
        let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
        let mut sent = 0;
        while sent < frame.len() {
            let rest = &frame[sent..];
            let with_fds = sent == 0 && !raw.is_empty();
            let n = self
                .sock
                .async_io(Interest::WRITABLE, || {
                    let iov = [IoSlice::new(rest)];
                    let cmsg = [ControlMessage::ScmRights(&raw)];
                    let cmsgs: &[ControlMessage<'_>] = if with_fds { &cmsg } else { &[] };
                    sendmsg::<()>(
                        self.sock.as_raw_fd(),
                        &iov,
                        cmsgs,
                        MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT,
                        None,
                    )
                    .map_err(std::io::Error::from)
                })
                .await?;
            if n == 0 {
                return Err(ProtoError::Io(std::io::ErrorKind::WriteZero.into()));
            }
            sent += n;
        }
        Ok(())
    }

    /// Encodes and sends `msg` with `fds`.
    ///
    /// # Errors
    /// As [`Self::send`].
    pub async fn send_msg<T: Serialize>(
        &self,
        msg: &T,
        fds: &[BorrowedFd<'_>],
    ) -> Result<(), ProtoError> {
        let body = encode(msg)?;
        self.send(&body, fds).await
    }

    /// The next frame's body and descriptors; `None` when the peer closed the socket between
    /// frames. Cancel-safe: bytes and descriptors read so far stay in the channel.
    ///
    /// # Errors
    /// The socket's error, or [`ProtoError::Violation`] for a bad header, a frame cut short, or
    /// a frame naming descriptors that did not come.
    pub async fn recv(&mut self) -> Result<Option<Frame>, ProtoError> {
        loop {
            if let Some(frame) = self.take_frame()? {
                return Ok(Some(frame));
            }
            let mut chunk = Zeroizing::new(vec![0u8; 64 * 1024]);
            let mut got_fds: Vec<OwnedFd> = Vec::new();
            let n = self
                .sock
                .async_io(Interest::READABLE, || {
                    let mut iov = [IoSliceMut::new(&mut chunk)];
                    let mut space = nix::cmsg_space!([RawFd; 8]);
                    let msg = recvmsg::<()>(
                        self.sock.as_raw_fd(),
                        &mut iov,
                        Some(&mut space),
                        MsgFlags::MSG_CMSG_CLOEXEC | MsgFlags::MSG_DONTWAIT,
                    )
                    .map_err(std::io::Error::from)?;
                    let truncated = msg.flags.contains(MsgFlags::MSG_CTRUNC);
                    for c in msg.cmsgs().map_err(std::io::Error::from)? {
                        if let ControlMessageOwned::ScmRights(fds) = c {
                            for fd in fds {
                                // SAFETY: the kernel just installed `fd` in this process for
                                // this message; nothing else owns it.
                                got_fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                            }
                        }
                    }
                    if truncated {
                        return Err(std::io::Error::other("descriptors cut short (MSG_CTRUNC)"));
                    }
                    Ok(msg.bytes)
                })
                .await?;
            self.fds.extend(got_fds);
            if n == 0 {
                if self.buf.is_empty() {
                    return Ok(None);
                }
                return Err(ProtoError::Violation(format!(
                    "the peer closed the socket within a frame ({} bytes read)",
                    self.buf.len()
                )));
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    /// Descriptors received and not yet handed to a frame.
    #[must_use]
    pub fn pending_fds(&self) -> usize {
        self.fds.len()
    }

    fn take_frame(&mut self) -> Result<Option<Frame>, ProtoError> {
        if self.buf.len() < 8 {
            return Ok(None);
        }
        let word = |i: usize| {
            u32::from_be_bytes([
                self.buf[i],
                self.buf[i + 1],
                self.buf[i + 2],
                self.buf[i + 3],
            ])
        };
        let (len, nfds) = (word(0), word(4));
        if len > MAX_FRAME || nfds > MAX_FRAME_FDS {
            return Err(ProtoError::Violation(format!(
                "frame header: {len} bytes, {nfds} descriptors"
            )));
        }
        let end = 8 + len as usize;
        if self.buf.len() < end {
            return Ok(None);
        }
        if self.fds.len() < nfds as usize {
            return Err(ProtoError::Violation(format!(
                "a frame names {nfds} descriptors; {} came",
                self.fds.len()
            )));
        }
        let body = Zeroizing::new(self.buf[8..end].to_vec());
        self.buf.drain(..end);
        let fds = self.fds.drain(..nfds as usize).collect();
        Ok(Some((body, fds)))
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use super::*;

    /// Every message the worker sends decodes as the agent reads it.
    #[test]
    fn the_metadata_counts_decode_as_sent() {
        let msg = FromWorker::MetadataCounts {
            requests: vec![(200, 5), (401, 1)],
            refused: 2,
        };
        let body = encode(&msg).unwrap();
        match decode::<FromWorker>(&body).unwrap() {
            FromWorker::MetadataCounts { requests, refused } => {
                assert_eq!((requests, refused), (vec![(200, 5), (401, 1)], 2));
            }
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn frames_carry_descriptors_and_keep_their_order() {
        let (a, b) = UnixStream::pair().unwrap();
        let (a, mut b) = (Channel::new(a), Channel::new(b));
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        a.send(b"{\"first\":1}", &[]).await.unwrap();
        a.send(b"with-fd", &[l.as_fd()]).await.unwrap();
        let big = vec![b'x'; 300_000];
        let sender = tokio::spawn(async move {
            a.send(&big, &[]).await.unwrap();
            a
        });
        let (body, fds) = b.recv().await.unwrap().unwrap();
        assert_eq!((&body[..], fds.len()), (&b"{\"first\":1}"[..], 0));
        let (body, mut fds) = b.recv().await.unwrap().unwrap();
        assert_eq!((&body[..], fds.len()), (&b"with-fd"[..], 1));
        let got = std::net::TcpListener::from(fds.pop().unwrap());
        assert_eq!(got.local_addr().unwrap().port(), port, "the same socket");
        let (body, fds) = b.recv().await.unwrap().unwrap();
        assert_eq!((body.len(), fds.len()), (300_000, 0));
        drop(sender.await.unwrap());
        assert!(b.recv().await.unwrap().is_none(), "closed between frames");
    }

    #[tokio::test]
    async fn a_frame_naming_missing_descriptors_or_too_long_is_refused() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut b = Channel::new(b);
        // A header naming one descriptor, none sent.
        let mut raw = 2u32.to_be_bytes().to_vec();
        raw.extend_from_slice(&1u32.to_be_bytes());
        raw.extend_from_slice(b"{}");
        a.try_write(&raw).unwrap();
        assert!(matches!(b.recv().await, Err(ProtoError::Violation(_))));
        let (a, b) = UnixStream::pair().unwrap();
        let mut b = Channel::new(b);
        let mut raw = (MAX_FRAME + 1).to_be_bytes().to_vec();
        raw.extend_from_slice(&0u32.to_be_bytes());
        a.try_write(&raw).unwrap();
        assert!(matches!(b.recv().await, Err(ProtoError::Violation(_))));
    }

    #[test]
    fn secrets_never_show_in_debug() {
        let m = ToWorker::Hello {
            token_key: WireSecret(SecretString::from("00ff")),
            http: HttpWire {
                request_timeout_ms: 1,
                connect_timeout_ms: 1,
                rate_limit_attempts: 1,
                max_retry_wait_ms: 1,
                concurrency: 1,
            },
        };
        assert!(!format!("{m:?}").contains("00ff"));
        let wire = String::from_utf8(encode(&m).unwrap().to_vec()).unwrap();
        assert!(
            wire.starts_with("{\"msg\":\"hello\",\"token_key\":\"00ff\""),
            "{wire}"
        );
        let back: ToWorker = decode(wire.as_bytes()).unwrap();
        assert!(matches!(back, ToWorker::Hello { .. }));
        assert!(decode::<FromWorker>(b"{\"msg\":\"ready\",\"extra\":1}").is_err());
        assert!(decode::<FromWorker>(b"{\"msg\":\"listen\",\"vm\":\"a\"}").is_err());
    }
}
