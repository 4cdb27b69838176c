//! The permanent neighbour entries between the two ends of a VM's veth, and the host end's
//! multicast route.
//!
//! # Design
//! The host end of a veth carries no IPv6 address (README, "Namespace mode: derived names and addresses"), so
//! neither side can resolve the other by neighbour discovery: the netns maps the host's next hop
//! `fe80::1:<uid>` to the host end's planned MAC, and the host maps `fe80::2` to the netns end's
//! planned MAC, both as permanent entries (the kernel equivalent of `ip neigh replace … nud
//! permanent`). A check reads one entry (`RTM_GETNEIGH` for one address on one link), so it
//! costs the same at any number of VMs. The kernel flushes a link's entries, permanent ones
//! included, when the link goes down: they are made after the link is up, and an audit finds
//! them missing after someone took the link down and up.
//!
//! The kernel gives every IPv6 link an `ff00::/8` multicast route in the local table when it
//! configures the link for IPv6; the host end needs none (nothing it receives is multicast once
//! neither side solicits), and with one per VM every IPv6 route added next to it on the host,
//! and every link event there, walks them all. A new host end is read back while it is down
//! (`create`), so the kernel configures it for IPv6 only from its link-watch work, once the
//! carrier is seen after the end came up. So when the end has been brought up, a task deletes
//! the route as soon as it appears, trying again with growing pauses for up to
//! [`MULTICAST_ROUTE_WAIT`], off the request's path. The route is not planned state: one left
//! (the host end taken down and up by hand) costs time, not traffic, and is not reported as
//! drift.

use std::net::{IpAddr, Ipv6Addr};
use std::time::Duration;

use netlink_packet_core::{NLM_F_REQUEST, NetlinkMessage, NetlinkPayload};
use netlink_packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourMessage, NeighbourState,
};
use netlink_packet_route::route::{RouteAddress, RouteAttribute, RouteMessage};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use rtnetlink::Handle;

use crate::ns::NsError;
use crate::ns::routes::{self, errno, nl};

/// A neighbour entry as the driver compares it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::ns) struct KNeigh {
    /// Its link-layer address, when it has one.
    pub mac: Option<[u8; 6]>,
    /// Whether the entry is permanent (`NUD_PERMANENT`).
    pub permanent: bool,
}

impl KNeigh {
    /// Whether this is the permanent entry for `mac`.
    pub(in crate::ns) fn is_permanent_for(&self, mac: [u8; 6]) -> bool {
        self.permanent && self.mac == Some(mac)
    }
}

/// A neighbour message naming `ip` on link `index` (no state, no flags): a lookup or delete.
pub(in crate::ns) fn message(index: u32, ip: IpAddr) -> NeighbourMessage {
    let mut m = NeighbourMessage::default();
    m.header.family = match ip {
        IpAddr::V4(_) => AddressFamily::Inet,
        IpAddr::V6(_) => AddressFamily::Inet6,
    };
    m.header.ifindex = index;
    m.attributes.push(NeighbourAttribute::Destination(match ip {
        IpAddr::V4(a) => NeighbourAddress::Inet(a),
        IpAddr::V6(a) => NeighbourAddress::Inet6(a),
    }));
    m
}

/// The one entry `req` names ([`message`], with flags such as proxy), as the kernel answers
/// (`RTM_GETNEIGH` without a dump), or `None` when there is none; `what` describes the lookup in
/// errors.
pub(in crate::ns) async fn lookup(
    h: &Handle,
    req: NeighbourMessage,
    what: &str,
) -> Result<Option<NeighbourMessage>, NsError> {
    let mut req = NetlinkMessage::from(RouteNetlinkMessage::GetNeighbour(req));
    req.header.flags = NLM_F_REQUEST;
    let mut h = h.clone();
    let mut answers = h.request(req).map_err(nl(what))?;
    while let Some(msg) = futures::StreamExt::next(&mut answers).await {
        match msg.payload {
            NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewNeighbour(m)) => {
                return Ok(Some(m));
            }
            NetlinkPayload::Error(e) if e.raw_code() == -libc::ENOENT => return Ok(None),
            NetlinkPayload::Error(e) => {
                return Err(nl(what)(rtnetlink::Error::NetlinkError(e)));
            }
            _ => {}
        }
    }
    Ok(None)
}

/// The entry for `ip` on link `index`, or `None` (one lookup, not a dump; `w` names the side
/// in errors).
pub(in crate::ns) async fn get(
    h: &Handle,
    index: u32,
    ip: IpAddr,
    w: &str,
) -> Result<Option<KNeigh>, NsError> {
    let what = format!("{w}: get neighbour {ip} on #{index}");
    Ok(lookup(h, message(index, ip), &what).await?.map(|m| KNeigh {
        mac: m.attributes.iter().find_map(|a| match a {
            NeighbourAttribute::LinkLayerAddress(l) => <[u8; 6]>::try_from(&l[..]).ok(),
            _ => None,
        }),
        permanent: m.header.state == NeighbourState::Permanent,
    }))
}

/// Makes (or replaces) the permanent entry `ip` → `mac` on link `name` (ifindex `index`).
pub(in crate::ns) async fn set(
    h: &Handle,
    index: u32,
    name: &str,
    ip: IpAddr,
    mac: [u8; 6],
    w: &str,
) -> Result<(), NsError> {
    h.neighbours()
        .add(index, ip)
        .state(NeighbourState::Permanent)
        .link_layer_address(&mac)
        .replace()
        .execute()
        .await
        .map_err(nl(format!("{w}: set permanent neighbour {ip} dev {name}")))
}

/// The local table, where the kernel puts a link's `ff00::/8` route.
const LOCAL_TABLE: u8 = 255;

/// How long a host end's `ff00::/8` route is waited for after the end came up.
pub(in crate::ns) const MULTICAST_ROUTE_WAIT: Duration = Duration::from_secs(5);

/// Deletes the `ff00::/8` route of the host end `name` (ifindex `index`) from a task, as soon
/// as the kernel has made it (see the module docs); the caller does not wait.
pub(in crate::ns) fn drop_multicast_route(h: &Handle, index: u32, name: &str) {
    let (h, name) = (h.clone(), name.to_owned());
    tokio::spawn(async move {
        let (mut pause, mut waited) = (Duration::ZERO, Duration::ZERO);
        while waited < MULTICAST_ROUTE_WAIT {
            tokio::time::sleep(pause).await;
            waited += pause;
            pause = (pause * 2).clamp(Duration::from_millis(1), Duration::from_millis(250));
            // The index names the same link still (a VM deleted meanwhile frees it).
            match routes::link_by_index(&h, index).await {
                Ok(Some(l)) if l.name == name => {}
                _ => return,
            }
            match del_multicast_route(&h, index).await {
                Ok(true) => return,
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(link = %name, error = %e, "deleting the host end's multicast route failed");
                    return;
                }
            }
        }
        tracing::debug!(link = %name, "the host end got no multicast route to delete");
    });
}

/// Deletes the `ff00::/8` route of link `index` from the local table: `true` when it was
/// deleted or the link is gone, `false` when the link has no such route.
async fn del_multicast_route(h: &Handle, index: u32) -> Result<bool, NsError> {
    let mut m = RouteMessage::default();
    m.header.address_family = AddressFamily::Inet6;
    m.header.destination_prefix_length = 8;
    m.header.table = LOCAL_TABLE;
    m.attributes
        .push(RouteAttribute::Destination(RouteAddress::Inet6(
            Ipv6Addr::new(0xff00, 0, 0, 0, 0, 0, 0, 0),
        )));
    m.attributes.push(RouteAttribute::Oif(index));
    match h.route().del(m).execute().await {
        Ok(()) => Ok(true),
        Err(e) if errno(&e) == Some(libc::ENODEV) => Ok(true),
        Err(e) if matches!(errno(&e), Some(libc::ESRCH | libc::ENOENT)) => Ok(false),
        Err(e) => Err(nl(format!("host: delete route ff00::/8 dev #{index}"))(e)),
    }
}
