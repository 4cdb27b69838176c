//! Deleting the conntrack entries a caller's predicate picks (the firewall's tightening: the
//! connections the new rules would not admit), in the calling thread's network namespace.

use std::net::IpAddr;

use netlink_packet_netfilter::conntrack::{ConntrackAttribute, ProtoTuple, Tuple};

use super::{ConntrackError, ip_pair};

/// What a predicate sees of one tracked connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tracked {
    /// The IP protocol number (6 TCP, 17 UDP, 1 ICMP, 58 ICMPv6, …).
    pub l4proto: u8,
    /// The original direction's source.
    pub orig_src: IpAddr,
    /// The original direction's destination (before any DNAT).
    pub orig_dst: IpAddr,
    /// The original direction's destination port (protocols with ports).
    pub orig_dport: Option<u16>,
    /// The reply direction's source (after DNAT: who answers).
    pub reply_src: IpAddr,
}

fn proto_of(tuple: &[Tuple]) -> (Option<u8>, Option<u16>) {
    let (mut proto, mut dport) = (None, None);
    for t in tuple {
        if let Tuple::Proto(ps) = t {
            for p in ps {
                match p {
                    ProtoTuple::Protocol(n) => proto = Some(u8::from(*n)),
                    ProtoTuple::DestinationPort(d) => dport = Some(*d),
                    _ => {}
                }
            }
        }
    }
    (proto, dport)
}

fn tracked(attrs: &[ConntrackAttribute]) -> Option<(Tracked, Vec<Tuple>)> {
    let mut orig = None;
    let mut reply_src = None;
    for a in attrs {
        match a {
            ConntrackAttribute::CtaTupleOrig(t) => orig = Some(t.clone()),
            ConntrackAttribute::CtaTupleReply(t) => reply_src = ip_pair(t).0,
            _ => {}
        }
    }
    let orig = orig?;
    let (src, dst) = ip_pair(&orig);
    let (proto, dport) = proto_of(&orig);
    Some((
        Tracked {
            l4proto: proto?,
            orig_src: src?,
            orig_dst: dst?,
            orig_dport: dport,
            reply_src: reply_src?,
        },
        orig,
    ))
}

/// Deletes every conntrack entry of the calling thread's namespace for which `doomed` answers
/// true (by its original tuple, after one dump of every family); returns how many were deleted.
/// An entry gone between the dump and the delete is not an error.
///
/// # Errors
/// When the netlink socket or the kernel fails.
pub fn delete_where(mut doomed: impl FnMut(&Tracked) -> bool) -> Result<usize, ConntrackError> {
    super::dump_then_delete(
        |attrs| {
            tracked(attrs)
                .filter(|(t, _)| doomed(t))
                .map(|(_, orig)| orig)
        },
        true,
    )
}
