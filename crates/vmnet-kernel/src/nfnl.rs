//! One netfilter netlink socket (`NETLINK_NETFILTER`) with request/answer handling, shared by
//! the conntrack deletions ([`crate::conntrack`]), the nf_tables element lookups
//! ([`crate::nftelem`]) and the nf_tables generation reads ([`crate::nftgen`]), on the message
//! types of `netlink-packet-netfilter`.

use netlink_packet_core::{NLM_F_REQUEST, NetlinkMessage, NetlinkPayload};
use netlink_packet_netfilter::{
    NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily,
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};

/// Errors of a netfilter netlink request.
#[derive(Debug, thiserror::Error)]
pub enum NetfilterError {
    /// The netlink socket failed (open, bind, send or receive).
    #[error("netfilter netlink {op}")]
    Io {
        /// What was attempted.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The kernel answered with an error (other than "no such object").
    #[error("netfilter netlink {op}: the kernel answered {code}")]
    Kernel {
        /// What was attempted.
        op: String,
        /// The error as the kernel gave it.
        #[source]
        code: std::io::Error,
    },
    /// A message could not be read.
    #[error("netfilter netlink: unreadable message: {0}")]
    Decode(String),
}

/// The nfnetlink subsystem id of nf_tables (`NFNL_SUBSYS_NFTABLES`), the resource id of a
/// batch's begin and end messages.
const NFNL_SUBSYS_NFTABLES: u16 = 10;

fn io(op: &'static str) -> impl FnOnce(std::io::Error) -> NetfilterError {
    move |source| NetfilterError::Io { op, source }
}

/// A netfilter netlink socket in the network namespace of the thread that opened it (usable
/// from any thread afterwards).
pub(crate) struct NfnlSocket {
    sock: Socket,
    seq: u32,
    buf: Vec<u8>,
}

impl NfnlSocket {
    /// Opens and binds the socket, with a 64 KiB receive buffer (dumps).
    pub(crate) fn open() -> Result<Self, NetfilterError> {
        Self::open_with_buffer(1 << 16)
    }

    /// Opens and binds the socket, with a receive buffer of `len` bytes: enough for the
    /// largest datagram of the answers it will read (a longer one is cut and fails to decode).
    pub(crate) fn open_with_buffer(len: usize) -> Result<Self, NetfilterError> {
        let mut sock = Socket::new(NETLINK_NETFILTER).map_err(io("open socket"))?;
        sock.bind_auto().map_err(io("bind"))?;
        sock.connect(&SocketAddr::new(0, 0))
            .map_err(io("connect"))?;
        Ok(Self {
            sock,
            seq: 0,
            buf: vec![0; len],
        })
    }

    /// The socket moved above the descriptors libnftables needs ([`crate::keptfd`]).
    pub(crate) fn kept(self) -> Self {
        Self {
            sock: crate::keptfd::move_above(self.sock),
            ..self
        }
    }

    /// The cookie of the namespace the socket was opened in (`SO_NETNS_COOKIE`): a number the
    /// kernel never gives another namespace until it reboots.
    pub(crate) fn netns_cookie(&self) -> std::io::Result<u64> {
        use std::os::fd::AsRawFd;
        let mut cookie: u64 = 0;
        let mut len = libc::socklen_t::try_from(std::mem::size_of::<u64>())
            .expect("eight bytes fit a socklen_t");
        // SAFETY: the descriptor is this socket's, open while `self` lives; the kernel writes
        // at most `len` bytes into `cookie`, which is that large.
        let rc = unsafe {
            libc::getsockopt(
                self.sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_NETNS_COOKIE,
                (&raw mut cookie).cast(),
                &raw mut len,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(cookie)
    }

    /// Sends one request of `family` with netlink `flags`; returns its sequence number.
    pub(crate) fn send(
        &mut self,
        family: NetfilterProtoFamily,
        inner: impl Into<NetfilterMessageInner>,
        flags: u16,
    ) -> Result<u32, NetfilterError> {
        self.seq = self.seq.wrapping_add(1);
        let mut nl = NetlinkMessage::from(NetfilterMessage::new(
            NetfilterHeader::new(family, 0, 0),
            inner,
        ));
        nl.header.flags = flags;
        nl.header.sequence_number = self.seq;
        nl.finalize();
        let mut out = vec![0; nl.header.length as usize];
        nl.serialize(&mut out);
        self.sock.send(&out, 0).map_err(io("send"))?;
        Ok(self.seq)
    }

    /// Sends `msgs` as one nf_tables transaction: `NFNL_MSG_BATCH_BEGIN`, the messages (each
    /// with netlink `flags` and `NLM_F_ACK`), `NFNL_MSG_BATCH_END`, in one datagram (the kernel
    /// reads a batch from one). Then waits for every message's answer: the kernel commits the
    /// whole batch or none of it.
    ///
    /// # Errors
    /// [`NetfilterError::Kernel`] (naming `op`) with the first error answered (the batch was
    /// not committed); socket and decode failures.
    pub(crate) fn transaction(
        &mut self,
        msgs: Vec<(NetfilterProtoFamily, NetfilterMessageInner, u16)>,
        op: &str,
    ) -> Result<(), NetfilterError> {
        use netlink_packet_core::NLM_F_ACK;
        use netlink_packet_netfilter::none::ControlMessage;
        let mut out = Vec::new();
        let mut push =
            |this: &mut Self, header: NetfilterHeader, inner: NetfilterMessageInner, flags: u16| {
                this.seq = this.seq.wrapping_add(1);
                let mut nl = NetlinkMessage::from(NetfilterMessage::new(header, inner));
                nl.header.flags = flags;
                nl.header.sequence_number = this.seq;
                nl.finalize();
                let at = out.len();
                out.resize(at + nl.header.length as usize, 0);
                nl.serialize(&mut out[at..]);
                this.seq
            };
        let control = NetfilterHeader::new(NetfilterProtoFamily::Unspec, 0, NFNL_SUBSYS_NFTABLES);
        let begin = push(
            self,
            control.clone(),
            ControlMessage::BatchBegin.into(),
            NLM_F_REQUEST,
        );
        let mut waiting = std::collections::BTreeSet::new();
        for (family, inner, flags) in msgs {
            let seq = push(
                self,
                NetfilterHeader::new(family, 0, 0),
                inner,
                flags | NLM_F_ACK,
            );
            waiting.insert(seq);
        }
        push(
            self,
            control,
            ControlMessage::BatchEnd.into(),
            NLM_F_REQUEST,
        );
        self.sock.send(&out, 0).map_err(io("send"))?;
        // Error answers carry the request they answer: room for the largest one.
        let mut buf = vec![0; out.len().max(self.buf.len()) + 4096];
        let mut first_error = None;
        while !waiting.is_empty() {
            let n = self
                .sock
                .recv(&mut &mut buf[..], 0)
                .map_err(io("receive"))?;
            let mut off = 0;
            while off < n {
                let msg = NetlinkMessage::<NetfilterMessage>::deserialize(&buf[off..n])
                    .map_err(|e| NetfilterError::Decode(e.to_string()))?;
                let len = msg.header.length as usize;
                if len == 0 {
                    return Err(NetfilterError::Decode("zero-length message".into()));
                }
                off += len;
                let seq = msg.header.sequence_number;
                let NetlinkPayload::Error(e) = msg.payload else {
                    continue;
                };
                let failed = (e.raw_code() != 0).then(|| NetfilterError::Kernel {
                    op: op.to_owned(),
                    code: e.to_io(),
                });
                if seq == begin {
                    // The whole batch was refused (or its commit failed): no other answer comes.
                    return Err(failed.unwrap_or_else(|| {
                        NetfilterError::Decode("an acknowledgement of the batch begin".into())
                    }));
                }
                if waiting.remove(&seq) && first_error.is_none() {
                    first_error = failed;
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Receives until the answer to `seq` is complete (its acknowledgement, error or end of
    /// dump), calling `each` for every message of it. `Ok(true)` when it succeeded, `Ok(false)`
    /// when the kernel answered "no such object" (`ENOENT`).
    ///
    /// # Errors
    /// [`NetfilterError::Kernel`] (naming `op`) for any other error answer; socket and decode
    /// failures.
    pub(crate) fn receive(
        &mut self,
        seq: u32,
        op: &str,
        mut each: impl FnMut(NetfilterMessageInner),
    ) -> Result<bool, NetfilterError> {
        loop {
            let n = self
                .sock
                .recv(&mut &mut self.buf[..], 0)
                .map_err(io("receive"))?;
            let mut off = 0;
            while off < n {
                let msg = NetlinkMessage::<NetfilterMessage>::deserialize(&self.buf[off..n])
                    .map_err(|e| NetfilterError::Decode(e.to_string()))?;
                let len = msg.header.length as usize;
                if len == 0 {
                    return Err(NetfilterError::Decode("zero-length message".into()));
                }
                off += len;
                if msg.header.sequence_number != seq {
                    continue;
                }
                match msg.payload {
                    NetlinkPayload::Done(_) => return Ok(true),
                    NetlinkPayload::Error(e) => {
                        return match e.raw_code() {
                            0 => Ok(true),
                            c if c == -libc::ENOENT => Ok(false),
                            _ => Err(NetfilterError::Kernel {
                                op: op.to_owned(),
                                code: e.to_io(),
                            }),
                        };
                    }
                    NetlinkPayload::InnerMessage(m) => each(m.inner),
                    _ => {}
                }
            }
        }
    }
}
