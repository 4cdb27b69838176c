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

use netlink_packet_core::{NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST};
use netlink_packet_netfilter::conntrack::{ConntrackAttribute, ConntrackMessage, IPTuple, Tuple};
use netlink_packet_netfilter::{NetfilterMessageInner, NetfilterProtoFamily};

use crate::nfnl::NfnlSocket;

mod select;
pub use select::{Tracked, delete_where};

/// Errors of a conntrack flush.
pub type ConntrackError = crate::nfnl::NetfilterError;

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
    dump_then_delete(|attrs| matching(attrs, &set), delete)
}

/// One dump of every family (a dump walks the kernel's whole hash table, whatever the family
/// asked for), then, with `delete`, each entry `pick` chose deleted by its original tuple in
/// its own family; returns how many were picked (without `delete`) or deleted. An entry gone
/// between the dump and the delete is not counted and not an error.
fn dump_then_delete(
    mut pick: impl FnMut(&[ConntrackAttribute]) -> Option<Vec<Tuple>>,
    delete: bool,
) -> Result<usize, ConntrackError> {
    let mut conn = NfnlSocket::open()?;
    let seq = conn.send(
        NetfilterProtoFamily::Unspec,
        ConntrackMessage::Get(Vec::new()),
        NLM_F_REQUEST | NLM_F_DUMP,
    )?;
    let mut doomed = Vec::new();
    conn.receive(seq, "conntrack dump", |m| {
        if let NetfilterMessageInner::Conntrack(ConntrackMessage::New(attrs)) = m
            && let Some(t) = pick(&attrs)
        {
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
        if conn.receive(seq, "conntrack delete", |_| {})? {
            deleted += 1;
        }
    }
    Ok(deleted)
}
