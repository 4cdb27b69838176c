//! One netfilter netlink socket (`NETLINK_NETFILTER`) with request/answer handling, shared by
//! the conntrack deletions ([`crate::conntrack`]), the nf_tables element lookups
//! ([`crate::nftelem`]) and the nf_tables generation reads ([`crate::nftgen`]), on the message
//! types of `netlink-packet-netfilter`.

use netlink_packet_core::{NetlinkMessage, NetlinkPayload};
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

    /// Moves the socket to the lowest free descriptor number at or above `min` (the same
    /// socket under a new, close-on-exec descriptor; the old one is closed, which does not close
    /// the socket). Where that fails (e.g. `min` at or above `RLIMIT_NOFILE`) it stays where it
    /// is. For sockets kept by the thousand: libnftables waits for its answers with `select(2)`,
    /// which takes descriptors below `FD_SETSIZE` (1024) only, so those are left free for it.
    pub(crate) fn move_fd_above(&mut self, min: i32) {
        use std::os::fd::{AsRawFd, FromRawFd};
        if self.sock.as_raw_fd() >= min {
            return;
        }
        let Ok(fd) = nix::fcntl::fcntl(&self.sock, nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(min))
        else {
            return;
        };
        // SAFETY: `fd` is a descriptor fcntl(2) just made for this socket; nothing else owns it.
        let moved = unsafe { Socket::from_raw_fd(fd) };
        drop(std::mem::replace(&mut self.sock, moved));
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
