//! Applying a [`GuestNet`] over rtnetlink, for images without networkd (`--apply netlink`):
//! the mesh address as a /128 without duplicate address detection (usable at once), the mesh
//! range and every host route via the gateway of its family, replacing what the previous
//! apply set (an address or route no longer asked for is deleted; nothing else is touched).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use futures::TryStreamExt;
use ipnet::IpNet;
use netlink_packet_route::AddressFamily;
use netlink_packet_route::address::{AddressAttribute, AddressFlags, AddressHeaderFlags};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use rtnetlink::Handle;

use crate::doc::GuestNet;

/// The IPv4 gateway.
pub const GATEWAY_V4: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 1);
/// The IPv6 gateway.
pub const GATEWAY_V6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);

/// The routes `net` asks for: the mesh range first, then the host routes.
#[must_use]
pub fn wanted_routes(net: &GuestNet) -> Vec<IpNet> {
    let mesh = IpNet::V6(vmnet_model::vm::MESH_RANGE);
    std::iter::once(mesh)
        .chain(net.host_routes.iter().copied().filter(|d| *d != mesh))
        .collect()
}

fn route_message(dst: IpNet, index: u32) -> RouteMessage {
    let mut m = RouteMessage::default();
    m.header.address_family = match dst {
        IpNet::V4(_) => AddressFamily::Inet,
        IpNet::V6(_) => AddressFamily::Inet6,
    };
    m.header.destination_prefix_length = dst.prefix_len();
    m.header.protocol = RouteProtocol::Static;
    m.header.scope = RouteScope::Universe;
    m.header.kind = RouteType::Unicast;
    m.header.table = 254;
    m.attributes
        .push(RouteAttribute::Destination(RouteAddress::from(
            dst.network(),
        )));
    let gw = match dst {
        IpNet::V4(_) => IpAddr::V4(GATEWAY_V4),
        IpNet::V6(_) => IpAddr::V6(GATEWAY_V6),
    };
    m.attributes
        .push(RouteAttribute::Gateway(RouteAddress::from(gw)));
    m.attributes.push(RouteAttribute::Oif(index));
    m
}

/// Configures interface `ifname` over one rtnetlink connection.
#[derive(Debug)]
pub struct Netlink {
    handle: Handle,
    ifname: String,
    applied: Option<GuestNet>,
}

impl Netlink {
    /// Opens the rtnetlink connection (its driver runs on the current tokio runtime).
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
            applied: None,
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

    /// Applies `net` (see the module docs).
    ///
    /// # Errors
    /// The first netlink request that fails; the next apply starts over.
    pub async fn apply(&mut self, net: &GuestNet) -> Result<(), String> {
        let index = self.index().await?;
        let h = &self.handle;
        let mut req = h
            .address()
            .add(index, IpAddr::V6(net.mesh_ipv6), 128)
            .replace();
        let m = req.message_mut();
        m.header.flags = AddressHeaderFlags::Nodad;
        m.attributes
            .retain(|a| !matches!(a, AddressAttribute::Flags(_)));
        m.attributes
            .push(AddressAttribute::Flags(AddressFlags::Nodad));
        req.execute()
            .await
            .map_err(|e| format!("add {}/128 on {}: {e}", net.mesh_ipv6, self.ifname))?;
        let wanted = wanted_routes(net);
        for d in &wanted {
            h.route()
                .add(route_message(*d, index))
                .replace()
                .execute()
                .await
                .map_err(|e| format!("add route {d}: {e}"))?;
        }
        if let Some(old) = self.applied.take() {
            for d in wanted_routes(&old).iter().filter(|d| !wanted.contains(d)) {
                // Already gone is fine.
                let _ = h.route().del(route_message(*d, index)).execute().await;
            }
            if old.mesh_ipv6 != net.mesh_ipv6 {
                self.del_address(index, old.mesh_ipv6).await?;
            }
        }
        self.applied = Some(net.clone());
        Ok(())
    }

    async fn del_address(&self, index: u32, addr: Ipv6Addr) -> Result<(), String> {
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
