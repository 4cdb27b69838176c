//! The mesh range route: `fdaa::/16 dev <wg> mtu lock <vm mtu>` in the main table. It carries no
//! VM traffic (the BPF program encapsulates that, and the /128 peer routes are more specific);
//! it gives the kernel's forwarding path the MTU for a VM packet too big to encapsulate, so the
//! VM gets an ICMPv6 Packet Too Big. The MTU must be locked: an unlocked route MTU is ignored
//! for forwarded packets (the device's MTU applies). A route already in place is left as it is
//! (a read, no write): a reconcile pass that finds nothing to do changes nothing in the kernel.

use std::net::Ipv6Addr;

use futures::TryStreamExt;
use netlink_packet_route::AddressFamily;
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteFlags, RouteHeader, RouteMessage, RouteMetric,
    RouteProtocol, RouteScope, RouteType,
};
use rtnetlink::Handle;

use super::MeshError;

/// The mesh range, `fdaa::/16`.
pub const MESH_RANGE: (Ipv6Addr, u8) = (Ipv6Addr::new(0xfdaa, 0, 0, 0, 0, 0, 0, 0), 16);

/// `RTAX_MTU`, the bit of the MTU metric in `RTAX_LOCK`.
const RTAX_MTU: u32 = 2;

/// Whether `m`, a route the kernel answered, is the mesh range route into `wg_index` with the
/// MTU locked at `vm_mtu`.
fn is_range_route(m: &RouteMessage, wg_index: u32, vm_mtu: u32) -> bool {
    let mut oif = None;
    let (mut locked, mut mtu) = (false, None);
    for a in &m.attributes {
        match a {
            RouteAttribute::Oif(i) => oif = Some(*i),
            RouteAttribute::Metrics(ms) => {
                for x in ms {
                    match x {
                        RouteMetric::Lock(bits) => locked = bits & (1 << RTAX_MTU) != 0,
                        RouteMetric::Mtu(v) => mtu = Some(*v),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    m.header.destination_prefix_length == MESH_RANGE.1
        && m.header.table == RouteHeader::RT_TABLE_MAIN
        && m.header.kind == RouteType::Unicast
        && oif == Some(wg_index)
        && locked
        && mtu == Some(vm_mtu)
}

/// Whether the mesh range route is in place: the entry of the main table that a lookup of the
/// range's first address matches (`RTM_F_FIB_MATCH`, the table's own entry rather than a cached
/// result) is the range itself, into `wg_index`, with the MTU locked at `vm_mtu`. A lookup that
/// fails (no route) or matches anything else (a more specific route to that one address) says
/// no.
async fn range_route_in_place(h: &Handle, wg_index: u32, vm_mtu: u32) -> bool {
    let mut m = RouteMessage::default();
    m.header.address_family = AddressFamily::Inet6;
    m.header.destination_prefix_length = 128;
    m.header.flags = RouteFlags::FibMatch;
    m.attributes
        .push(RouteAttribute::Destination(RouteAddress::Inet6(
            MESH_RANGE.0,
        )));
    let found: Result<Vec<RouteMessage>, _> = h.route().get(m).execute().try_collect().await;
    found.is_ok_and(|f| matches!(f.as_slice(), [r] if is_range_route(r, wg_index, vm_mtu)))
}

/// Adds or replaces the mesh range route into link `wg_index` with the MTU locked at `vm_mtu`,
/// unless it is in place already.
///
/// # Errors
/// [`MeshError::Netlink`] on a failed request.
pub async fn ensure_range_route(h: &Handle, wg_index: u32, vm_mtu: u32) -> Result<(), MeshError> {
    if range_route_in_place(h, wg_index, vm_mtu).await {
        return Ok(());
    }
    let mut m = RouteMessage::default();
    m.header.address_family = AddressFamily::Inet6;
    m.header.destination_prefix_length = MESH_RANGE.1;
    m.header.table = RouteHeader::RT_TABLE_MAIN;
    m.header.protocol = RouteProtocol::Static;
    m.header.scope = RouteScope::Universe;
    m.header.kind = RouteType::Unicast;
    m.attributes
        .push(RouteAttribute::Destination(RouteAddress::Inet6(
            MESH_RANGE.0,
        )));
    m.attributes.push(RouteAttribute::Oif(wg_index));
    m.attributes.push(RouteAttribute::Metrics(vec![
        RouteMetric::Lock(1 << RTAX_MTU),
        RouteMetric::Mtu(vm_mtu),
    ]));
    h.route()
        .add(m)
        .replace()
        .execute()
        .await
        .map_err(|source| MeshError::Netlink {
            what: format!(
                "add route {}/{} dev #{wg_index} mtu lock {vm_mtu}",
                MESH_RANGE.0, MESH_RANGE.1
            ),
            source,
        })
}
