//! The mesh interface's link, address and /128 routes over netlink (rtnetlink), in the calling
//! process's network namespace. Routes into the interface are listed whatever made them; the
//! agent decides which are its own (see the agent's mesh plan).

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv6Addr};

use futures::TryStreamExt;
use netlink_packet_route::AddressFamily;
use netlink_packet_route::address::{AddressAttribute, AddressFlags, AddressHeaderFlags};
use netlink_packet_route::link::{LinkAttribute, LinkFlags, LinkMessage};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use rtnetlink::{Handle, LinkUnspec};

use super::WgError;

fn nl(what: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> WgError {
    let what = what.into();
    move |source| WgError::Netlink { what, source }
}

fn missing(e: &rtnetlink::Error) -> bool {
    matches!(e, rtnetlink::Error::NetlinkError(m)
        if m.code.is_some_and(|c| matches!(-c.get(), libc::ENODEV | libc::ENOENT | libc::ESRCH)))
}

/// A link: index, MTU, up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Link {
    /// Its ifindex.
    pub index: u32,
    /// Its MTU.
    pub mtu: u32,
    /// Whether it is administratively up.
    pub up: bool,
}

fn to_link(m: &LinkMessage) -> Link {
    let mtu = m
        .attributes
        .iter()
        .find_map(|a| match a {
            LinkAttribute::Mtu(v) => Some(*v),
            _ => None,
        })
        .unwrap_or(0);
    Link {
        index: m.header.index,
        mtu,
        up: m.header.flags.contains(LinkFlags::Up),
    }
}

/// The link called `name`, or `None`.
///
/// # Errors
/// `Netlink` on a failed request.
pub async fn by_name(h: &Handle, name: &str) -> Result<Option<Link>, WgError> {
    crate::netlink::link_by_name(h, name)
        .await
        .map(|m| m.as_ref().map(to_link))
        .map_err(nl(format!("get link {name}")))
}

/// Sets `link`'s MTU to `mtu` and brings it up, when it differs; adds `address`/128 (no
/// duplicate address detection) when given and missing, and deletes any other /128 of the mesh
/// range `fdaa::/16` on the link (the host's previous mesh address, after a changed
/// `--mesh-address`).
///
/// # Errors
/// `Netlink` on a failed request.
pub async fn prepare(
    h: &Handle,
    link: Link,
    mtu: u32,
    address: Option<Ipv6Addr>,
) -> Result<(), WgError> {
    if link.mtu != mtu || !link.up {
        h.link()
            .set(LinkUnspec::new_with_index(link.index).mtu(mtu).up().build())
            .execute()
            .await
            .map_err(nl(format!("set mtu {mtu} and up on #{}", link.index)))?;
    }
    if let Some(a) = address {
        let have: Vec<_> = crate::netlink::retry_busy(|| {
            h.address()
                .get()
                .set_link_index_filter(link.index)
                .execute()
                .try_collect()
        })
        .await
        .map_err(nl("list addresses"))?;
        let present = have.iter().any(|m| {
            m.header.prefix_len == 128
                && m.attributes
                    .iter()
                    .any(|x| matches!(x, AddressAttribute::Address(IpAddr::V6(v)) if *v == a))
        });
        for m in &have {
            let stale = m.header.prefix_len == 128
                && m.attributes.iter().any(|x| {
                    matches!(x, AddressAttribute::Address(IpAddr::V6(v))
                        if *v != a && v.segments()[0] == 0xfdaa)
                });
            if stale {
                h.address()
                    .del(m.clone())
                    .execute()
                    .await
                    .map_err(nl(format!("delete an old mesh address on #{}", link.index)))?;
            }
        }
        if !present {
            let mut req = h.address().add(link.index, IpAddr::V6(a), 128).replace();
            let m = req.message_mut();
            m.header.flags = AddressHeaderFlags::Nodad;
            m.attributes
                .retain(|x| !matches!(x, AddressAttribute::Flags(_)));
            m.attributes
                .push(AddressAttribute::Flags(AddressFlags::Nodad));
            req.execute()
                .await
                .map_err(nl(format!("add address {a}/128 on #{}", link.index)))?;
        }
    }
    Ok(())
}

/// The destinations of the IPv6 /128 unicast routes of the main table into link `index`,
/// whoever made them, except the kernel's own (the route of an address on the link).
///
/// # Errors
/// `Netlink` on a failed dump.
pub async fn routes_into(h: &Handle, index: u32) -> Result<BTreeSet<Ipv6Addr>, WgError> {
    crate::netlink::retry_busy(|| dump_routes_into(h, index))
        .await
        .map_err(nl("dump IPv6 routes"))
}

async fn dump_routes_into(h: &Handle, index: u32) -> Result<BTreeSet<Ipv6Addr>, rtnetlink::Error> {
    let mut m = RouteMessage::default();
    m.header.address_family = AddressFamily::Inet6;
    h.route()
        .get(m)
        .execute()
        .try_filter_map(|r| {
            let mut dst = None;
            let mut oif = None;
            let mut table = u32::from(r.header.table);
            for a in &r.attributes {
                match a {
                    RouteAttribute::Destination(RouteAddress::Inet6(d)) => dst = Some(*d),
                    RouteAttribute::Oif(o) => oif = Some(*o),
                    RouteAttribute::Table(t) => table = *t,
                    _ => {}
                }
            }
            let ours = r.header.destination_prefix_length == 128
                && r.header.kind == RouteType::Unicast
                && r.header.protocol != RouteProtocol::Kernel
                && table == u32::from(RouteHeader::RT_TABLE_MAIN)
                && oif == Some(index);
            std::future::ready(Ok(dst.filter(|_| ours)))
        })
        .try_collect()
        .await
}

fn route_message(index: u32, dst: Ipv6Addr) -> RouteMessage {
    let mut m = RouteMessage::default();
    m.header.address_family = AddressFamily::Inet6;
    m.header.destination_prefix_length = 128;
    m.header.table = RouteHeader::RT_TABLE_MAIN;
    m.header.protocol = RouteProtocol::Static;
    m.header.scope = RouteScope::Link;
    m.header.kind = RouteType::Unicast;
    m.attributes
        .push(RouteAttribute::Destination(RouteAddress::Inet6(dst)));
    m.attributes.push(RouteAttribute::Oif(index));
    m
}

/// Adds (or replaces) the route `dst`/128 dev `index`.
///
/// # Errors
/// `Netlink` on a failed request.
pub async fn add_route(h: &Handle, index: u32, dst: Ipv6Addr) -> Result<(), WgError> {
    h.route()
        .add(route_message(index, dst))
        .replace()
        .execute()
        .await
        .map_err(nl(format!("add route {dst}/128 dev #{index}")))
}

/// Deletes the route `dst`/128 dev `index`; a route already gone is fine.
///
/// # Errors
/// `Netlink` on a failed request.
pub async fn del_route(h: &Handle, index: u32, dst: Ipv6Addr) -> Result<(), WgError> {
    match h.route().del(route_message(index, dst)).execute().await {
        Err(e) if !missing(&e) => Err(nl(format!("delete route {dst}/128 dev #{index}"))(e)),
        _ => Ok(()),
    }
}

/// The MTU of the link the kernel routes `dst` through, or `None` when no route leads there.
///
/// # Errors
/// `Netlink` on a failed link request.
pub async fn mtu_towards(h: &Handle, dst: IpAddr) -> Result<Option<u32>, WgError> {
    let mut m = RouteMessage::default();
    let (family, plen) = match dst {
        IpAddr::V4(_) => (AddressFamily::Inet, 32),
        IpAddr::V6(_) => (AddressFamily::Inet6, 128),
    };
    m.header.address_family = family;
    m.header.destination_prefix_length = plen;
    m.attributes
        .push(RouteAttribute::Destination(RouteAddress::from(dst)));
    let found: Result<Vec<RouteMessage>, _> = h.route().get(m).execute().try_collect().await;
    let Ok(found) = found else { return Ok(None) };
    let oif = found
        .iter()
        .flat_map(|r| &r.attributes)
        .find_map(|a| match a {
            RouteAttribute::Oif(o) => Some(*o),
            _ => None,
        });
    let Some(oif) = oif else { return Ok(None) };
    let res: Result<Vec<LinkMessage>, _> = h
        .link()
        .get()
        .match_index(oif)
        .execute()
        .try_collect()
        .await;
    match res {
        Ok(v) => Ok(v.first().map(|l| to_link(l).mtu)),
        Err(e) if missing(&e) => Ok(None),
        Err(e) => Err(nl(format!("get link #{oif}"))(e)),
    }
}
