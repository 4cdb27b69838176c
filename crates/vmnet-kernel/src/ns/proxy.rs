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

use netlink_packet_route::neighbour::{NeighbourFlags, NeighbourMessage};
use rtnetlink::Handle;

use super::NsError;
use super::links::neigh;
use super::routes::{errno, nl};

fn message(index: u32, ip: IpAddr) -> NeighbourMessage {
    let mut m = neigh::message(index, ip);
    m.header.flags = NeighbourFlags::Proxy;
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
    let what = format!("host: get proxy neighbour {ip}");
    Ok(neigh::lookup(h, message(index, ip), &what).await?.is_some())
}
