//! Single questions to a namespace's routing, one `ip route get` (or a dump the kernel filters
//! to one link) each: is an address local, which FIB entry routes it, which route goes through
//! a gateway. The driver asks them of the host when it checks a VM's public addresses
//! ([`host_use`]) and its mesh gateways.

use std::net::{IpAddr, Ipv6Addr};

use futures::TryStreamExt;
use ipnet::IpNet;
use netlink_packet_route::AddressFamily;
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteFlags, RouteMessage, RouteType,
};
use rtnetlink::Handle;

use super::NsError;
use super::routes::{errno, nl, route_ip};

/// What the host uses an address for, so that no VM may hold it as a public address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostUse {
    /// An address of the host itself (its uplink's, say): the VM would take the host's own
    /// inbound traffic.
    Own,
    /// An address the host's network needs, described (`the gateway of the host's default
    /// route`, `a broadcast address of the host's network`, `the network address of the host's
    /// subnet 203.0.113.0/24`): the host would send its own traffic to the VM, or the address
    /// is no host's to hold.
    Reserved(String),
}

/// The first of `addrs`, or of the host's addresses inside `block`, that the namespace of `h`
/// uses (see [`super::NsDriver::host_use`]). One `ip route get` per address; for an address on
/// a subnet the host is on, also a `fibmatch` lookup and a dump filtered to that link.
pub(super) async fn host_use(
    h: &Handle,
    addrs: &[IpAddr],
    block: Option<ipnet::Ipv6Net>,
) -> Result<Option<(IpAddr, HostUse)>, NsError> {
    for a in addrs {
        if let Some(u) = use_of(h, *a).await? {
            return Ok(Some((*a, u)));
        }
    }
    let Some(block) = block else { return Ok(None) };
    let held = local_v6_addrs(h).await?;
    Ok(held
        .into_iter()
        .find(|a| block.contains(a))
        .map(|a| (IpAddr::V6(a), HostUse::Own)))
}

/// What the host uses `a` for, if anything.
async fn use_of(h: &Handle, a: IpAddr) -> Result<Option<HostUse>, NsError> {
    let reserved = |what: &str| {
        Ok(Some(HostUse::Reserved(format!(
            "{what} of the host's network"
        ))))
    };
    match route_type(h, a).await? {
        Some(RouteType::Local) => return Ok(Some(HostUse::Own)),
        Some(RouteType::Broadcast) => return reserved("a broadcast address"),
        Some(RouteType::Anycast) => return reserved("a subnet-router anycast address"),
        _ => {}
    }
    // Only an address on a subnet the host is on (a connected route, no gateway) can be its
    // gateway or the subnet's network address. A VM's own mapped address routes through a /32
    // or /128 of its own and never matches.
    let Some((net, None, oif)) = fib_entry(h, a).await? else {
        return Ok(None);
    };
    if let Some(dst) = route_via(h, oif, a).await? {
        let what = if dst.prefix_len() == 0 {
            "the gateway of the host's default route".to_owned()
        } else {
            format!("the gateway of the host's route to {dst}")
        };
        return Ok(Some(HostUse::Reserved(what)));
    }
    // The kernel lists a subnet's broadcast (and, forwarding on, its IPv6 subnet-router anycast)
    // address as such, caught above; its network address only here.
    if net.prefix_len() < net.max_prefix_len() - 1 && net.network() == a {
        return Ok(Some(HostUse::Reserved(format!(
            "the network address of the host's subnet {net}"
        ))));
    }
    Ok(None)
}

/// An `ip route get` request for `addr` (a full-length destination of its family).
fn get_message(addr: IpAddr) -> RouteMessage {
    let mut m = RouteMessage::default();
    match addr {
        IpAddr::V4(a) => {
            m.header.address_family = AddressFamily::Inet;
            m.header.destination_prefix_length = 32;
            m.attributes
                .push(RouteAttribute::Destination(RouteAddress::Inet(a)));
        }
        IpAddr::V6(a) => {
            m.header.address_family = AddressFamily::Inet6;
            m.header.destination_prefix_length = 128;
            m.attributes
                .push(RouteAttribute::Destination(RouteAddress::Inet6(a)));
        }
    }
    m
}

/// The type of the route `ip route get` answers for `addr` (local, broadcast, unicast…), or
/// `None` when nothing routes it.
async fn route_type(h: &Handle, addr: IpAddr) -> Result<Option<RouteType>, NsError> {
    let m = get_message(addr);
    let res: Result<Vec<RouteMessage>, _> = h.route().get(m).execute().try_collect().await;
    match res {
        Ok(msgs) => Ok(msgs.first().map(|m| m.header.kind)),
        Err(e)
            if matches!(
                errno(&e),
                Some(libc::ENETUNREACH | libc::EHOSTUNREACH | libc::ESRCH)
            ) =>
        {
            Ok(None)
        }
        Err(e) => Err(nl(format!("route get {addr}"))(e)),
    }
}

/// The IPv6 addresses of this namespace: the local routes of its local table (255; filtered by
/// the kernel on a strict socket).
async fn local_v6_addrs(h: &Handle) -> Result<Vec<Ipv6Addr>, NsError> {
    let mut m = RouteMessage::default();
    m.header.address_family = AddressFamily::Inet6;
    m.attributes.push(RouteAttribute::Table(255));
    h.route()
        .get(m)
        .execute()
        .try_filter_map(|msg| {
            let local = msg.header.kind == RouteType::Local;
            let addr = msg.attributes.iter().find_map(|a| match a {
                RouteAttribute::Destination(RouteAddress::Inet6(v)) => Some(*v),
                _ => None,
            });
            std::future::ready(Ok(addr.filter(|_| local)))
        })
        .try_collect()
        .await
        .map_err(nl("dump local IPv6 routes"))
}

/// The FIB entry that routes `addr` from this namespace (`ip route get fibmatch`), as
/// (entry prefix, gateway, oif), or `None` when nothing routes it.
pub(super) async fn fib_match(
    h: &Handle,
    addr: Ipv6Addr,
) -> Result<Option<(IpNet, Option<IpAddr>, u32)>, NsError> {
    fib_entry(h, IpAddr::V6(addr)).await
}

/// The destination of the first main-table route out of link `oif` whose gateway is `gw`, of
/// any protocol (a default route `ip route add` made, a DHCP client's…), or `None`. A dump
/// filtered by the kernel to `oif` on a strict socket.
async fn route_via(h: &Handle, oif: u32, gw: IpAddr) -> Result<Option<IpNet>, NsError> {
    let mut m = RouteMessage::default();
    m.header.address_family = match gw {
        IpAddr::V4(_) => AddressFamily::Inet,
        IpAddr::V6(_) => AddressFamily::Inet6,
    };
    m.attributes
        .push(RouteAttribute::Table(vmnet_plan::ns::MAIN_TABLE));
    m.attributes.push(RouteAttribute::Oif(oif));
    let found: Vec<IpNet> = h
        .route()
        .get(m)
        .execute()
        .try_filter_map(|msg| {
            let via = msg
                .attributes
                .iter()
                .any(|a| matches!(a, RouteAttribute::Gateway(g) if route_ip(g) == Some(gw)));
            let dst = msg
                .attributes
                .iter()
                .find_map(|a| match a {
                    RouteAttribute::Destination(d) => route_ip(d),
                    _ => None,
                })
                .unwrap_or(match gw {
                    IpAddr::V4(_) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
                    IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
                });
            let net = IpNet::new(dst, msg.header.destination_prefix_length).ok();
            std::future::ready(Ok(net.filter(|_| via)))
        })
        .try_collect()
        .await
        .map_err(nl("dump routes via a gateway"))?;
    Ok(found.into_iter().next())
}

/// [`fib_match`] for either family.
async fn fib_entry(
    h: &Handle,
    addr: IpAddr,
) -> Result<Option<(IpNet, Option<IpAddr>, u32)>, NsError> {
    let mut m = get_message(addr);
    m.header.flags.insert(RouteFlags::FibMatch);
    let res: Result<Vec<RouteMessage>, _> = h.route().get(m).execute().try_collect().await;
    let msgs = match res {
        Ok(m) => m,
        Err(e)
            if matches!(
                errno(&e),
                Some(libc::ENETUNREACH | libc::EHOSTUNREACH | libc::ESRCH)
            ) =>
        {
            return Ok(None);
        }
        Err(e) => return Err(nl(format!("route get {addr}"))(e)),
    };
    let Some(m) = msgs.first() else {
        return Ok(None);
    };
    if m.header.kind != RouteType::Unicast {
        return Ok(None);
    }
    let unspecified = match addr {
        IpAddr::V4(_) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    };
    let (mut dst, mut gw, mut oif) = (unspecified, None, None);
    for a in &m.attributes {
        match a {
            RouteAttribute::Destination(d) => dst = route_ip(d).unwrap_or(dst),
            RouteAttribute::Gateway(g) => gw = route_ip(g),
            RouteAttribute::Oif(o) => oif = Some(*o),
            _ => {}
        }
    }
    let Some(oif) = oif else { return Ok(None) };
    let net = IpNet::new(dst, m.header.destination_prefix_length)
        .map_err(|_| NsError::Missing(format!("route get {addr}: bad prefix")))?;
    Ok(Some((net, gw, oif)))
}
