//! The guest interface in the kernel, over rtnetlink: read its addresses and main-table routes
//! ([`Observed`]), apply [`Changes`] one object at a time. Nothing is written that is already
//! there: an address or route is added only when missing (no replace), so the kernel announces
//! only the objects that change.

use std::net::IpAddr;

use futures::TryStreamExt;
use ipnet::IpNet;
use netlink_packet_route::AddressFamily;
use netlink_packet_route::address::{AddressAttribute, AddressFlags, AddressHeaderFlags};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use rtnetlink::Handle;

use crate::plan::{Changes, KernelRoute, Observed, gateway_of};

/// The main routing table.
const MAIN_TABLE: u32 = 254;

/// Reads and changes the guest interface; faked in tests.
pub trait Kernel {
    /// The interface's addresses and main-table routes.
    ///
    /// # Errors
    /// A message when the interface or the dump fails.
    fn observe(&mut self) -> impl Future<Output = Result<Observed, String>>;
    /// Applies `c` in order: the new address, new routes, stale routes, stale addresses.
    ///
    /// # Errors
    /// The first request that fails; the next apply observes again and starts over.
    fn apply(&mut self, c: &Changes) -> impl Future<Output = Result<(), String>>;
}

/// The real kernel, over one rtnetlink connection.
#[derive(Debug)]
pub struct Rtnl {
    handle: Handle,
    ifname: String,
}

fn route_message(dst: IpNet, index: u32) -> RouteMessage {
    let mut m = RouteMessage::default();
    m.header.address_family = match dst {
        IpNet::V4(_) => AddressFamily::Inet,
        IpNet::V6(_) => AddressFamily::Inet6,
    };
    m.header.destination_prefix_length = dst.prefix_len();
    // As networkd's static routes: a later networkd restart finds them as its own.
    m.header.protocol = RouteProtocol::Static;
    m.header.scope = RouteScope::Universe;
    m.header.kind = RouteType::Unicast;
    m.header.table = u8::try_from(MAIN_TABLE).unwrap_or(254);
    m.attributes
        .push(RouteAttribute::Destination(RouteAddress::from(
            dst.network(),
        )));
    m.attributes
        .push(RouteAttribute::Gateway(RouteAddress::from(gateway_of(dst))));
    m.attributes.push(RouteAttribute::Oif(index));
    m
}

fn route_of(m: &RouteMessage, index: u32) -> Option<KernelRoute> {
    let mut dst = None;
    let mut gateway = None;
    let mut oif = None;
    let mut table = u32::from(m.header.table);
    for a in &m.attributes {
        match a {
            RouteAttribute::Destination(RouteAddress::Inet(v4)) => dst = Some(IpAddr::V4(*v4)),
            RouteAttribute::Destination(RouteAddress::Inet6(v6)) => dst = Some(IpAddr::V6(*v6)),
            RouteAttribute::Gateway(RouteAddress::Inet(v4)) => gateway = Some(IpAddr::V4(*v4)),
            RouteAttribute::Gateway(RouteAddress::Inet6(v6)) => gateway = Some(IpAddr::V6(*v6)),
            RouteAttribute::Oif(i) => oif = Some(*i),
            RouteAttribute::Table(t) => table = *t,
            _ => {}
        }
    }
    if oif != Some(index) || table != MAIN_TABLE {
        return None;
    }
    let len = m.header.destination_prefix_length;
    let dst = match (m.header.address_family, dst) {
        (_, Some(a)) => IpNet::new(a, len).ok()?,
        (AddressFamily::Inet, None) => IpNet::new(IpAddr::V4(0.into()), len).ok()?,
        (AddressFamily::Inet6, None) => {
            IpNet::new(IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED), len).ok()?
        }
        _ => return None,
    };
    Some(KernelRoute { dst, gateway })
}

impl Rtnl {
    /// Opens the rtnetlink connection for interface `ifname` (its driver runs on the current
    /// tokio runtime).
    ///
    /// # Errors
    /// When the socket cannot be opened.
    pub fn new(ifname: &str) -> Result<Self, String> {
        let (conn, handle, _) =
            rtnetlink::new_connection().map_err(|e| format!("rtnetlink: {e}"))?;
        tokio::spawn(conn);
        Ok(Self {
            handle,
            ifname: ifname.to_owned(),
        })
    }

    async fn index(&self) -> Result<u32, String> {
        let links: Vec<_> = self
            .handle
            .link()
            .get()
            .match_name(self.ifname.clone())
            .execute()
            .try_collect()
            .await
            .map_err(|e| format!("link {}: {e}", self.ifname))?;
        links
            .first()
            .map(|l| l.header.index)
            .ok_or_else(|| format!("link {} not found", self.ifname))
    }

    async fn observe_at(&self, index: u32) -> Result<Observed, String> {
        let h = &self.handle;
        let addrs: Vec<_> = h
            .address()
            .get()
            .set_link_index_filter(index)
            .execute()
            .try_collect()
            .await
            .map_err(|e| format!("dump addresses of {}: {e}", self.ifname))?;
        let mut o = Observed::default();
        for m in addrs.iter().filter(|m| m.header.index == index) {
            let a = m.attributes.iter().find_map(|a| match a {
                AddressAttribute::Address(a) => Some(*a),
                _ => None,
            });
            o.addresses.extend(a.map(|a| (a, m.header.prefix_len)));
        }
        for family in [AddressFamily::Inet, AddressFamily::Inet6] {
            let mut filter = RouteMessage::default();
            filter.header.address_family = family;
            let routes: Vec<_> = h
                .route()
                .get(filter)
                .execute()
                .try_collect()
                .await
                .map_err(|e| format!("dump routes: {e}"))?;
            o.routes
                .extend(routes.iter().filter_map(|m| route_of(m, index)));
        }
        Ok(o)
    }

    async fn del_address(&self, index: u32, addr: std::net::Ipv6Addr) -> Result<(), String> {
        let msgs: Vec<_> = self
            .handle
            .address()
            .get()
            .set_link_index_filter(index)
            .execute()
            .try_collect()
            .await
            .map_err(|e| format!("dump addresses of {}: {e}", self.ifname))?;
        for m in msgs {
            let here = m.header.index == index
                && m.header.prefix_len == 128
                && m.attributes
                    .iter()
                    .any(|a| matches!(a, AddressAttribute::Address(IpAddr::V6(a)) if *a == addr));
            if here {
                self.handle
                    .address()
                    .del(m)
                    .execute()
                    .await
                    .map_err(|e| format!("delete {addr}/128 on {}: {e}", self.ifname))?;
            }
        }
        Ok(())
    }
}

/// Whether a netlink error says the object is as wanted already: "exists" (added meanwhile) or
/// "no such object" (gone meanwhile; `ESRCH` for a route, `EADDRNOTAVAIL` for an address).
fn settled(e: &rtnetlink::Error) -> bool {
    let rtnetlink::Error::NetlinkError(m) = e else {
        return false;
    };
    let io = m.to_io();
    matches!(
        io.kind(),
        std::io::ErrorKind::AlreadyExists
            | std::io::ErrorKind::NotFound
            | std::io::ErrorKind::AddrNotAvailable
    ) || io.raw_os_error() == Some(ESRCH)
}

/// `ESRCH` on Linux (the kernel's answer to deleting a route that is not there).
const ESRCH: i32 = 3;

impl Kernel for Rtnl {
    async fn observe(&mut self) -> Result<Observed, String> {
        let index = self.index().await?;
        self.observe_at(index).await
    }

    async fn apply(&mut self, c: &Changes) -> Result<(), String> {
        if c.is_empty() {
            return Ok(());
        }
        let index = self.index().await?;
        let h = &self.handle;
        if let Some(a) = c.add_address {
            let mut req = h.address().add(index, IpAddr::V6(a), 128);
            let m = req.message_mut();
            m.header.flags = AddressHeaderFlags::Nodad;
            m.attributes
                .retain(|a| !matches!(a, AddressAttribute::Flags(_)));
            m.attributes
                .push(AddressAttribute::Flags(AddressFlags::Nodad));
            if let Err(e) = req.execute().await
                && !settled(&e)
            {
                return Err(format!("add {a}/128 on {}: {e}", self.ifname));
            }
        }
        for d in &c.add_routes {
            if let Err(e) = h.route().add(route_message(*d, index)).execute().await
                && !settled(&e)
            {
                return Err(format!("add route {d}: {e}"));
            }
        }
        for d in &c.del_routes {
            if let Err(e) = h.route().del(route_message(*d, index)).execute().await
                && !settled(&e)
            {
                return Err(format!("delete route {d}: {e}"));
            }
        }
        for a in &c.del_addresses {
            self.del_address(index, *a).await?;
        }
        Ok(())
    }
}
