//! Proxy ARP/NDP entries on the uplink for public addresses (`--public-neighbors proxy`): the
//! kernel equivalent of `ip neigh add proxy ADDR dev UPLINK`, over rtnetlink.
//!
//! # Design
//! A VM's entries derive from its public addresses ([`vmnet_plan::ns::public::proxy_addresses`]).
//! An apply adds the planned ones (idempotent replace) and deletes the ones of the VM's previous
//! addresses that are no longer planned; each is one request, and a check is one lookup of one
//! entry (`RTM_GETNEIGH` for a single proxy entry), so the cost never depends on how many VMs
//! the host has.
//!
//! # Limitations
//! Only the VM's own previous addresses are candidates for deletion: an entry added by hand on
//! the uplink is left alone (and not reported).

use std::net::IpAddr;

use netlink_packet_core::{NLM_F_REQUEST, NetlinkMessage, NetlinkPayload};
use netlink_packet_route::AddressFamily;
use netlink_packet_route::RouteNetlinkMessage;
use netlink_packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourFlags, NeighbourMessage,
};
use rtnetlink::Handle;

use super::NsError;
use super::routes::{errno, nl};

fn message(index: u32, ip: IpAddr) -> NeighbourMessage {
    let mut m = NeighbourMessage::default();
    m.header.family = match ip {
        IpAddr::V4(_) => AddressFamily::Inet,
        IpAddr::V6(_) => AddressFamily::Inet6,
    };
    m.header.ifindex = index;
    m.header.flags = NeighbourFlags::Proxy;
    m.attributes.push(NeighbourAttribute::Destination(match ip {
        IpAddr::V4(a) => NeighbourAddress::Inet(a),
        IpAddr::V6(a) => NeighbourAddress::Inet6(a),
    }));
    m
}

/// Adds (or keeps) the proxy entry for `ip` on link `index` (`uplink` names it in errors).
pub(super) async fn add(h: &Handle, index: u32, uplink: &str, ip: IpAddr) -> Result<(), NsError> {
    h.neighbours()
        .add(index, ip)
        .flags(NeighbourFlags::Proxy)
        .replace()
        .execute()
        .await
        .map_err(nl(format!("host: add proxy neighbour {ip} dev {uplink}")))
}

/// Deletes the proxy entry for `ip` on link `index`; a missing entry is not an error.
pub(super) async fn del(h: &Handle, index: u32, uplink: &str, ip: IpAddr) -> Result<(), NsError> {
    match h.neighbours().del(message(index, ip)).execute().await {
        Ok(()) => Ok(()),
        Err(e) if matches!(errno(&e), Some(libc::ENOENT | libc::ESRCH)) => Ok(()),
        Err(e) => Err(nl(format!(
            "host: delete proxy neighbour {ip} dev {uplink}"
        ))(e)),
    }
}

/// Whether the proxy entry for `ip` exists on link `index` (one lookup, not a dump).
pub(super) async fn exists(h: &Handle, index: u32, ip: IpAddr) -> Result<bool, NsError> {
    let mut req = NetlinkMessage::from(RouteNetlinkMessage::GetNeighbour(message(index, ip)));
    req.header.flags = NLM_F_REQUEST;
    let mut h = h.clone();
    let mut answers = h
        .request(req)
        .map_err(nl(format!("host: get proxy neighbour {ip}")))?;
    while let Some(msg) = futures::StreamExt::next(&mut answers).await {
        match msg.payload {
            NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewNeighbour(_)) => return Ok(true),
            NetlinkPayload::Error(e) if e.raw_code() == -libc::ENOENT => return Ok(false),
            NetlinkPayload::Error(e) => {
                return Err(nl(format!("host: get proxy neighbour {ip}"))(
                    rtnetlink::Error::NetlinkError(e),
                ));
            }
            _ => {}
        }
    }
    Ok(false)
}
