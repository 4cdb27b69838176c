//! Deleting the conntrack entries of given addresses over ctnetlink, in process (no `conntrack`
//! binary), with the message types of `netlink-packet-netfilter`.
//!
//! # Design
//! [`flush_addresses`] dumps the conntrack table (every family, one dump) of the calling
//! thread's network namespace and deletes, by their original tuple, exactly the entries whose
//! original destination or reply destination is one of the addresses: inbound connections to a
//! public address (DNAT: the original destination) and the VM's own outbound connections
//! (SNAT: the reply comes back to it). Nothing else is touched. An entry that vanished between
//! the dump and the delete (`ENOENT`) is not an error.
//!
//! # Limitations
//! A dump walks the kernel's whole conntrack hash table, shared by every namespace (about 5 ms
//! with 262144 buckets here), whatever the number of VMs or entries; the driver runs it in a
//! background task and skips it while the namespace tracks no connection at all.

use std::collections::BTreeSet;
use std::net::IpAddr;

use netlink_packet_core::{NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NetlinkMessage, NetlinkPayload};
use netlink_packet_netfilter::conntrack::{ConntrackAttribute, ConntrackMessage, IPTuple, Tuple};
use netlink_packet_netfilter::{
    NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily,
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};

mod select;
pub use select::{Tracked, delete_where};

/// Errors of a conntrack flush.
#[derive(Debug, thiserror::Error)]
pub enum ConntrackError {
    /// The netlink socket failed (open, bind, send or receive).
    #[error("ctnetlink {op}")]
    Io {
        /// What was attempted.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The kernel answered with an error.
    #[error("ctnetlink {op}: the kernel answered {code}")]
    Kernel {
        /// What was attempted.
        op: &'static str,
        /// The error as the kernel gave it.
        #[source]
        code: std::io::Error,
    },
    /// A message could not be read.
    #[error("ctnetlink: unreadable message: {0}")]
    Decode(String),
}

fn io(op: &'static str) -> impl FnOnce(std::io::Error) -> ConntrackError {
    move |source| ConntrackError::Io { op, source }
}

/// The IP addresses of a tuple attribute list: (source, destination).
fn ip_pair(tuple: &[Tuple]) -> (Option<IpAddr>, Option<IpAddr>) {
    let (mut src, mut dst) = (None, None);
    for t in tuple {
        if let Tuple::Ip(ips) = t {
            for ip in ips {
                match ip {
                    IPTuple::SourceAddress(a) => src = Some(*a),
                    IPTuple::DestinationAddress(a) => dst = Some(*a),
                    _ => {}
                }
            }
        }
    }
    (src, dst)
}

/// The original tuple of a dumped entry when its original or reply destination is in `addrs`.
fn matching(attrs: &[ConntrackAttribute], addrs: &BTreeSet<IpAddr>) -> Option<Vec<Tuple>> {
    let mut orig = None;
    let mut hit = false;
    for a in attrs {
        match a {
            ConntrackAttribute::CtaTupleOrig(t) => {
                hit |= ip_pair(t).1.is_some_and(|d| addrs.contains(&d));
                orig = Some(t.clone());
            }
            ConntrackAttribute::CtaTupleReply(t) => {
                hit |= ip_pair(t).1.is_some_and(|d| addrs.contains(&d));
            }
            _ => {}
        }
    }
    orig.filter(|_| hit)
}

struct Conn {
    sock: Socket,
    seq: u32,
    buf: Vec<u8>,
}

impl Conn {
    fn open() -> Result<Self, ConntrackError> {
        let mut sock = Socket::new(NETLINK_NETFILTER).map_err(io("open socket"))?;
        sock.bind_auto().map_err(io("bind"))?;
        sock.connect(&SocketAddr::new(0, 0))
            .map_err(io("connect"))?;
        Ok(Self {
            sock,
            seq: 0,
            buf: vec![0; 1 << 16],
        })
    }

    fn send(
        &mut self,
        family: NetfilterProtoFamily,
        msg: ConntrackMessage,
        flags: u16,
    ) -> Result<u32, ConntrackError> {
        self.seq += 1;
        let mut nl = NetlinkMessage::from(NetfilterMessage::new(
            NetfilterHeader::new(family, 0, 0),
            msg,
        ));
        nl.header.flags = flags;
        nl.header.sequence_number = self.seq;
        nl.finalize();
        let mut out = vec![0; nl.header.length as usize];
        nl.serialize(&mut out);
        self.sock.send(&out, 0).map_err(io("send"))?;
        Ok(self.seq)
    }

    /// Receives until the answer to `seq` is complete; calls `each` for every conntrack entry.
    /// Returns the kernel's error code for an acknowledged request (0 on success).
    fn receive(
        &mut self,
        seq: u32,
        op: &'static str,
        mut each: impl FnMut(&[ConntrackAttribute]),
    ) -> Result<i32, ConntrackError> {
        loop {
            let n = self
                .sock
                .recv(&mut &mut self.buf[..], 0)
                .map_err(io("receive"))?;
            let mut off = 0;
            while off < n {
                let msg = NetlinkMessage::<NetfilterMessage>::deserialize(&self.buf[off..n])
                    .map_err(|e| ConntrackError::Decode(e.to_string()))?;
                let len = msg.header.length as usize;
                if len == 0 {
                    return Err(ConntrackError::Decode("zero-length message".into()));
                }
                off += len;
                if msg.header.sequence_number != seq {
                    continue;
                }
                match msg.payload {
                    NetlinkPayload::Done(_) => return Ok(0),
                    NetlinkPayload::Error(e) => {
                        let code = e.raw_code();
                        if code == 0 || code == -libc::ENOENT {
                            return Ok(code);
                        }
                        return Err(ConntrackError::Kernel {
                            op,
                            code: e.to_io(),
                        });
                    }
                    NetlinkPayload::InnerMessage(NetfilterMessage {
                        inner: NetfilterMessageInner::Conntrack(ConntrackMessage::New(attrs)),
                        ..
                    }) => each(&attrs),
                    _ => {}
                }
            }
        }
    }
}

/// How many conntrack entries of the calling thread's namespace have one of `addrs` as their
/// original or reply destination (what [`flush_addresses`] would delete).
///
/// # Errors
/// When the netlink socket or the kernel fails.
pub fn count_addresses(addrs: &[IpAddr]) -> Result<usize, ConntrackError> {
    walk(addrs, false)
}

/// Deletes every conntrack entry of the calling thread's namespace whose original or reply
/// destination is one of `addrs`; returns how many were deleted.
///
/// # Errors
/// When the netlink socket or the kernel fails.
pub fn flush_addresses(addrs: &[IpAddr]) -> Result<usize, ConntrackError> {
    walk(addrs, true)
}

fn walk(addrs: &[IpAddr], delete: bool) -> Result<usize, ConntrackError> {
    let set: BTreeSet<IpAddr> = addrs.iter().copied().collect();
    if set.is_empty() {
        return Ok(0);
    }
    let mut conn = Conn::open()?;
    // One dump of every family (a dump walks the kernel's whole hash table, whatever the family
    // asked for), then each match deleted in its own family.
    let seq = conn.send(
        NetfilterProtoFamily::Unspec,
        ConntrackMessage::Get(Vec::new()),
        NLM_F_REQUEST | NLM_F_DUMP,
    )?;
    let mut doomed = Vec::new();
    conn.receive(seq, "dump", |attrs| {
        if let Some(t) = matching(attrs, &set) {
            doomed.push(t);
        }
    })?;
    if !delete {
        return Ok(doomed.len());
    }
    let mut deleted = 0;
    for t in doomed {
        let family = match ip_pair(&t).0 {
            Some(IpAddr::V6(_)) => NetfilterProtoFamily::IPv6,
            _ => NetfilterProtoFamily::IPv4,
        };
        let seq = conn.send(
            family,
            ConntrackMessage::Delete(vec![ConntrackAttribute::CtaTupleOrig(t)]),
            NLM_F_REQUEST | NLM_F_ACK,
        )?;
        if conn.receive(seq, "delete", |_| {})? == 0 {
            deleted += 1;
        }
    }
    Ok(deleted)
}
