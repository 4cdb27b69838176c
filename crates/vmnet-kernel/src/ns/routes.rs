//! Routes as the kernel sees them (interfaces by index), with conversion to and from netlink
//! messages, dumps, and small netlink helpers shared by the driver (rules: [`super::rules`]).

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};

use futures::TryStreamExt;
use ipnet::IpNet;
use netlink_packet_route::AddressFamily;
use netlink_packet_route::address::{
    AddressAttribute, AddressFlags, AddressHeaderFlags, AddressScope,
};
use netlink_packet_route::link::{
    AfSpecInet6, AfSpecUnspec, In6AddrGenMode, LinkAttribute, LinkFlags, LinkMessage,
};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteFlags, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use rtnetlink::{Handle, IpVersion};

use super::NsError;

pub(super) use vmnet_plan::ns::diff::kform::describe_kind;
pub(super) use vmnet_plan::ns::diff::{GUARD_METRIC, KKind, KRoute};

/// The positive errno of a netlink error, if it is one.
pub(super) use crate::netlink::errno;

/// Wraps a netlink error with a description of the attempt.
pub(super) fn nl(what: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> NsError {
    let what = what.into();
    move |source| NsError::Netlink { what, source }
}

/// A route's netlink form: the message that adds or deletes it, and the route a dumped message
/// holds.
pub(super) trait RouteMsg: Sized {
    /// The netlink message adding (or deleting) this route; `onlink` marks the next hop on-link.
    fn to_message(&self, onlink: bool) -> RouteMessage;
    /// The route in a dumped message, if it is one of the kinds we make (static protocol).
    fn from_message(m: &RouteMessage) -> Option<Self>;
}

impl RouteMsg for KRoute {
    fn to_message(&self, onlink: bool) -> RouteMessage {
        let mut m = RouteMessage::default();
        m.header.address_family = match self.dst {
            IpNet::V4(_) => AddressFamily::Inet,
            IpNet::V6(_) => AddressFamily::Inet6,
        };
        m.header.destination_prefix_length = self.dst.prefix_len();
        m.header.protocol = RouteProtocol::Static;
        m.header.scope = RouteScope::Universe;
        if let Ok(t) = u8::try_from(self.table) {
            m.header.table = t;
        } else {
            m.attributes.push(RouteAttribute::Table(self.table));
        }
        m.attributes
            .push(RouteAttribute::Destination(RouteAddress::from(
                self.dst.network(),
            )));
        if self.metric != 0 {
            m.attributes.push(RouteAttribute::Priority(self.metric));
        }
        match &self.kind {
            KKind::Dev { oif } => {
                m.header.kind = RouteType::Unicast;
                m.header.scope = RouteScope::Link;
                m.attributes.push(RouteAttribute::Oif(*oif));
            }
            KKind::Via { gw, oif } => {
                m.header.kind = RouteType::Unicast;
                m.attributes
                    .push(RouteAttribute::Gateway(RouteAddress::from(*gw)));
                m.attributes.push(RouteAttribute::Oif(*oif));
                if onlink {
                    m.header.flags.insert(RouteFlags::Onlink);
                }
            }
            KKind::Throw => m.header.kind = RouteType::Throw,
            KKind::Unreachable => m.header.kind = RouteType::Unreachable,
        }
        m
    }

    fn from_message(m: &RouteMessage) -> Option<Self> {
        if m.header.protocol != RouteProtocol::Static {
            return None;
        }
        let mut table = u32::from(m.header.table);
        let (mut dst, mut gw, mut oif, mut metric) = (None, None, None, 0);
        for a in &m.attributes {
            match a {
                RouteAttribute::Table(t) => table = *t,
                RouteAttribute::Destination(d) => dst = route_ip(d),
                RouteAttribute::Gateway(g) => gw = route_ip(g),
                RouteAttribute::Oif(o) => oif = Some(*o),
                RouteAttribute::Priority(p) => metric = *p,
                _ => {}
            }
        }
        let plen = m.header.destination_prefix_length;
        let dst = match (dst, m.header.address_family) {
            (Some(d), _) => d,
            (None, AddressFamily::Inet) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
            (None, AddressFamily::Inet6) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            _ => return None,
        };
        let dst = IpNet::new(dst, plen).ok()?;
        let kind = match (m.header.kind, gw, oif) {
            (RouteType::Unicast, Some(gw), Some(oif)) => KKind::Via { gw, oif },
            (RouteType::Unicast, None, Some(oif)) => KKind::Dev { oif },
            (RouteType::Throw, _, _) => KKind::Throw,
            (RouteType::Unreachable, _, _) => KKind::Unreachable,
            _ => return None,
        };
        Some(Self {
            table,
            dst,
            kind,
            metric,
        })
    }
}

pub(super) fn route_ip(a: &RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(v) => Some(IpAddr::V4(*v)),
        RouteAddress::Inet6(v) => Some(IpAddr::V6(*v)),
        _ => None,
    }
}

/// Dumps the static routes of `version`, optionally only table `table` and output interface
/// `oif` (filtered by the kernel on a strict socket, and again here).
pub(super) async fn dump_routes(
    h: &Handle,
    version: IpVersion,
    table: Option<u32>,
    oif: Option<u32>,
) -> Result<Vec<KRoute>, NsError> {
    let mut m = RouteMessage::default();
    m.header.address_family = match version {
        IpVersion::V4 => AddressFamily::Inet,
        IpVersion::V6 => AddressFamily::Inet6,
    };
    if let Some(t) = table {
        m.attributes.push(RouteAttribute::Table(t));
    }
    if let Some(o) = oif {
        m.attributes.push(RouteAttribute::Oif(o));
    }
    // Each message is converted as it arrives: a parsed message is much larger than a KRoute,
    // and a dump of every host route (1000 VMs) would otherwise be held whole.
    h.route()
        .get(m)
        .execute()
        .try_filter_map(|msg| {
            let r = KRoute::from_message(&msg)
                .filter(|r| table.is_none_or(|t| r.table == t))
                .filter(|r| {
                    oif.is_none_or(|o| {
                        matches!(r.kind, KKind::Dev { oif } | KKind::Via { oif, .. } if oif == o)
                    })
                });
            std::future::ready(Ok(r))
        })
        .try_collect()
        .await
        .map_err(nl("dump routes"))
}

/// Adds (or replaces) a route. `names` maps the ifindexes of `whereis` to link names, for the
/// error message (`fu1n00c8: add route ::/0 table 100 via fdaa:2::2 dev fu1t00c8 onlink: …`).
pub(super) async fn add_route(
    h: &Handle,
    r: &KRoute,
    onlink: bool,
    whereis: &str,
    names: &HashMap<u32, String>,
) -> Result<(), NsError> {
    h.route()
        .add(r.to_message(onlink))
        .replace()
        .execute()
        .await
        .map_err(nl(format!(
            "{whereis}: add route {} table {} {}",
            r.dst,
            r.table,
            describe_kind(&r.kind, onlink, names)
        )))
}

/// Deletes a route; a route that is already gone is fine.
pub(super) async fn del_route(h: &Handle, r: &KRoute, whereis: &str) -> Result<(), NsError> {
    match h.route().del(r.to_message(false)).execute().await {
        Ok(()) => Ok(()),
        Err(e) if matches!(errno(&e), Some(libc::ESRCH | libc::ENOENT | libc::ENODEV)) => Ok(()),
        Err(e) => Err(nl(format!(
            "{whereis}: delete route {} table {}",
            r.dst, r.table
        ))(e)),
    }
}

/// A link's state as the driver compares it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct KLink {
    pub index: u32,
    pub name: String,
    pub mtu: u32,
    pub up: bool,
    /// The link's MAC (`IFLA_ADDRESS`), when it has a 6-byte one.
    pub mac: Option<[u8; 6]>,
    /// Whether the kernel makes no IPv6 link-local of its own on it (`addrgenmode none`).
    pub no_auto_link_local: bool,
    /// Whether IPv6 is turned off on it (`disable_ipv6` = 1): the kernel then drops every IPv6
    /// packet it would send or receive there, and refuses IPv6 addresses on it.
    pub ipv6_off: bool,
}

fn klink(m: &LinkMessage) -> KLink {
    let mut name = String::new();
    let (mut mtu, mut mac, mut no_auto_link_local, mut ipv6_off) = (0, None, false, false);
    for a in &m.attributes {
        match a {
            LinkAttribute::IfName(n) => name.clone_from(n),
            LinkAttribute::Mtu(v) => mtu = *v,
            LinkAttribute::Address(a) => mac = <[u8; 6]>::try_from(a.as_slice()).ok(),
            LinkAttribute::AfSpecUnspec(specs) => {
                let v6 = specs.iter().flat_map(|s| match s {
                    AfSpecUnspec::Inet6(v6) => v6.as_slice(),
                    _ => &[],
                });
                for a in v6 {
                    match a {
                        AfSpecInet6::AddrGenMode(In6AddrGenMode::None) => no_auto_link_local = true,
                        AfSpecInet6::DevConf(c) => ipv6_off = c.disable_ipv6 != 0,
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    KLink {
        index: m.header.index,
        name,
        mtu,
        up: m.header.flags.contains(LinkFlags::Up),
        mac,
        no_auto_link_local,
        ipv6_off,
    }
}

/// The link called `name`, or `None`.
pub(super) async fn link_by_name(h: &Handle, name: &str) -> Result<Option<KLink>, NsError> {
    crate::netlink::link_by_name(h, name)
        .await
        .map(|m| m.as_ref().map(klink))
        .map_err(nl(format!("get link {name}")))
}

/// The link with ifindex `index`, or `None`.
pub(super) async fn link_by_index(h: &Handle, index: u32) -> Result<Option<KLink>, NsError> {
    let res: Result<Vec<LinkMessage>, _> = h
        .link()
        .get()
        .match_index(index)
        .execute()
        .try_collect()
        .await;
    match res {
        Ok(v) => Ok(v.first().map(klink)),
        Err(e) if matches!(errno(&e), Some(libc::ENODEV | libc::ENOENT)) => Ok(None),
        Err(e) => Err(nl(format!("get link #{index}"))(e)),
    }
}

/// The output interfaces of the IPv6 routes the kernel learned from router advertisements
/// (`proto ra`: default routes, prefix routes), each once.
pub(super) async fn ra_route_links(h: &Handle) -> Result<Vec<u32>, NsError> {
    let mut m = RouteMessage::default();
    m.header.address_family = AddressFamily::Inet6;
    m.header.protocol = RouteProtocol::Ra;
    let mut oifs: Vec<u32> = h
        .route()
        .get(m)
        .execute()
        .try_filter_map(|msg| {
            let oif = (msg.header.protocol == RouteProtocol::Ra)
                .then(|| {
                    msg.attributes.iter().find_map(|a| match a {
                        RouteAttribute::Oif(o) => Some(*o),
                        _ => None,
                    })
                })
                .flatten();
            std::future::ready(Ok(oif))
        })
        .try_collect()
        .await
        .map_err(nl("dump router-advertisement routes"))?;
    oifs.sort_unstable();
    oifs.dedup();
    Ok(oifs)
}

/// A dump request for the addresses of link `index`. The index goes in the request header, so
/// a strict socket (the host's) has the kernel dump that link's addresses only, instead of every
/// address of the namespace (two per VM's host veth end: the dump grew with the number of VMs);
/// rtnetlink's filter drops other links' addresses again for a socket that is not strict.
pub(crate) fn addr_dump(h: &Handle, index: u32) -> rtnetlink::AddressGetRequest {
    let mut req = h.address().get().set_link_index_filter(index);
    req.message_mut().header.index = index;
    req
}

/// The links carrying a global IPv6 address with a finite lifetime (not `IFA_F_PERMANENT`: an
/// address formed by SLAAC, or leased by DHCPv6), each once.
pub(super) async fn dynamic_v6_links(h: &Handle) -> Result<Vec<u32>, NsError> {
    let mut req = h.address().get();
    req.message_mut().header.family = AddressFamily::Inet6;
    let mut links: Vec<u32> = req
        .execute()
        .try_filter_map(|m| {
            let permanent = m.header.flags.contains(AddressHeaderFlags::Permanent)
                || m.attributes.iter().any(
                    |a| matches!(a, AddressAttribute::Flags(f) if f.contains(AddressFlags::Permanent)),
                );
            let dynamic = m.header.family == AddressFamily::Inet6
                && m.header.scope == AddressScope::Universe
                && !permanent;
            std::future::ready(Ok(dynamic.then_some(m.header.index)))
        })
        .try_collect()
        .await
        .map_err(nl("dump IPv6 addresses"))?;
    links.sort_unstable();
    links.dedup();
    Ok(links)
}

/// All links.
pub(super) async fn dump_links(h: &Handle) -> Result<Vec<KLink>, NsError> {
    // Each message is converted as it arrives: a parsed link message (stats, per-family
    // settings) is ~10 KiB, so a dump of 1000 host veths held whole would be ~10 MiB.
    h.link()
        .get()
        .execute()
        .map_ok(|m| klink(&m))
        .try_collect()
        .await
        .map_err(nl("dump links"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(r: &KRoute) -> KRoute {
        KRoute::from_message(&r.to_message(false)).expect("parses back")
    }

    #[test]
    fn route_messages_round_trip() {
        let cases = [
            KRoute::new(254, "fdaa::7/128".parse().unwrap(), KKind::Dev { oif: 3 }),
            KRoute::new(
                254,
                "0.0.0.0/0".parse().unwrap(),
                KKind::Via {
                    gw: "10.200.0.29".parse().unwrap(),
                    oif: 4,
                },
            ),
            KRoute::new(
                0x0100_0007,
                "2000::/3".parse().unwrap(),
                KKind::Via {
                    gw: "fe80::2".parse().unwrap(),
                    oif: 9,
                },
            ),
            KRoute::new(0x0100_0007, "fdaa::/16".parse().unwrap(), KKind::Throw),
            KRoute {
                metric: GUARD_METRIC,
                ..KRoute::new(0x0100_0007, "2000::/3".parse().unwrap(), KKind::Unreachable)
            },
        ];
        for r in &cases {
            assert_eq!(&round_trip(r), r);
        }
        assert_eq!(cases[0].metric, 1024, "IPv6 default metric");
        assert_eq!(cases[1].metric, 0, "IPv4 default metric");
    }

    #[test]
    fn large_tables_use_the_attribute_and_small_ones_the_header() {
        let big = KRoute::new(0x0100_0007, "::/0".parse().unwrap(), KKind::Throw).to_message(false);
        assert!(big.attributes.contains(&RouteAttribute::Table(0x0100_0007)));
        let main = KRoute::new(254, "::/0".parse().unwrap(), KKind::Throw).to_message(false);
        assert_eq!(main.header.table, 254);
    }

    #[test]
    fn onlink_sets_the_flag_and_kernel_routes_are_ignored() {
        let r = KRoute::new(
            100,
            "::/0".parse().unwrap(),
            KKind::Via {
                gw: "fdaa::7".parse().unwrap(),
                oif: 2,
            },
        );
        assert!(r.to_message(true).header.flags.contains(RouteFlags::Onlink));
        let mut m = r.to_message(false);
        m.header.protocol = RouteProtocol::Kernel;
        assert_eq!(
            KRoute::from_message(&m),
            None,
            "only our static routes are read back"
        );
    }
}
