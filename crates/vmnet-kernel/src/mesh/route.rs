//! The mesh range route: `fdaa::/16 dev <wg> mtu lock <vm mtu>` in the main table. It carries no
//! VM traffic (the BPF program encapsulates that, and the /128 peer routes are more specific);
//! it gives the kernel's forwarding path the MTU for a VM packet too big to encapsulate, so the
//! VM gets an ICMPv6 Packet Too Big. The MTU must be locked: an unlocked route MTU is ignored
//! for forwarded packets (the device's MTU applies).

use std::net::Ipv6Addr;

use netlink_packet_route::AddressFamily;
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteMetric, RouteProtocol,
    RouteScope, RouteType,
};
use rtnetlink::Handle;

use super::MeshError;

/// The mesh range, `fdaa::/16`.
pub const MESH_RANGE: (Ipv6Addr, u8) = (Ipv6Addr::new(0xfdaa, 0, 0, 0, 0, 0, 0, 0), 16);

/// `RTAX_MTU`, the bit of the MTU metric in `RTAX_LOCK`.
const RTAX_MTU: u32 = 2;

/// Adds or replaces the mesh range route into link `wg_index` with the MTU locked at `vm_mtu`.
///
/// # Errors
/// [`MeshError::Netlink`] on a failed request.
pub async fn ensure_range_route(h: &Handle, wg_index: u32, vm_mtu: u32) -> Result<(), MeshError> {
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
