//! What to change on the guest interface so that it carries a [`GuestNet`], and nothing else:
//! the difference between what the metadata asks for and what the kernel has (pure; the
//! kernel is read and written by [`crate::kernel`]).
//!
//! - The mesh address: added when missing; every other /128 inside the mesh range `fdaa::/16`
//!   on the interface is deleted (a guest has one mesh address, and only vmnet gives one). The
//!   new address goes on before the old one comes off.
//! - Routes: the mesh range and each host route, via the gateway of its family (`172.16.0.1`,
//!   `fe80::1`), added when missing. A route is deleted only when vmnet-guest put it there (it is
//!   in the drop-in on disk or in the last apply), is no longer asked for, and the interface's
//!   own `.network` file does not configure it (its `Gateway=` default route stays).
//! - Everything already right is left alone: no address or route is written again, so an
//!   unchanged object never goes away, even for a moment.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use vmnet_model::vm::MESH_RANGE;

use crate::doc::GuestNet;

/// The IPv4 gateway.
pub const GATEWAY_V4: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 1);
/// The IPv6 gateway.
pub const GATEWAY_V6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);

/// The gateway of `dst`'s family.
#[must_use]
pub fn gateway_of(dst: IpNet) -> IpAddr {
    match dst {
        IpNet::V4(_) => IpAddr::V4(GATEWAY_V4),
        IpNet::V6(_) => IpAddr::V6(GATEWAY_V6),
    }
}

/// The routes `net` asks for: the mesh range first, then the host routes.
#[must_use]
pub fn wanted_routes(net: &GuestNet) -> Vec<IpNet> {
    let mesh = IpNet::V6(MESH_RANGE);
    std::iter::once(mesh)
        .chain(net.host_routes.iter().copied().filter(|d| *d != mesh))
        .collect()
}

/// A route on the interface in the main table, as the kernel shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelRoute {
    /// The destination.
    pub dst: IpNet,
    /// The gateway, if any.
    pub gateway: Option<IpAddr>,
}

/// What the kernel has on the interface.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observed {
    /// Its addresses with their prefix lengths.
    pub addresses: Vec<(IpAddr, u8)>,
    /// Its routes in the main table.
    pub routes: Vec<KernelRoute>,
}

/// The changes that make the interface carry a configuration, in the order they are applied.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changes {
    /// The mesh address to add (a /128, without duplicate address detection).
    pub add_address: Option<Ipv6Addr>,
    /// Routes to add, each via the gateway of its family.
    pub add_routes: Vec<IpNet>,
    /// Routes to delete (vmnet-guest's own, no longer asked for).
    pub del_routes: Vec<IpNet>,
    /// Mesh addresses to delete (/128s in the mesh range other than the one asked for).
    pub del_addresses: Vec<Ipv6Addr>,
}

impl Changes {
    /// Whether nothing changes.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.add_address.is_none()
            && self.add_routes.is_empty()
            && self.del_routes.is_empty()
            && self.del_addresses.is_empty()
    }
}

impl std::fmt::Display for Changes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = Vec::new();
        parts.extend(self.add_address.map(|a| format!("+address {a}/128")));
        parts.extend(self.add_routes.iter().map(|r| format!("+route {r}")));
        parts.extend(self.del_routes.iter().map(|r| format!("-route {r}")));
        parts.extend(
            self.del_addresses
                .iter()
                .map(|a| format!("-address {a}/128")),
        );
        if parts.is_empty() {
            f.write_str("no kernel change")
        } else {
            f.write_str(&parts.join(", "))
        }
    }
}

/// The changes that make `seen` carry `want` (see the module docs); `owned` are the routes
/// vmnet-guest put on the interface before (the drop-in on disk, the last apply) and `kept`
/// those the interface's `.network` file configures itself.
#[must_use]
pub fn plan(want: &GuestNet, seen: &Observed, owned: &[IpNet], kept: &[IpNet]) -> Changes {
    let has_route = |dst: IpNet| {
        seen.routes
            .iter()
            .any(|r| r.dst == dst && r.gateway == Some(gateway_of(dst)))
    };
    let wanted = wanted_routes(want);
    let mesh_addr = |a: &IpAddr, len: u8| match a {
        IpAddr::V6(v6) if len == 128 && MESH_RANGE.contains(v6) => Some(*v6),
        _ => None,
    };
    let mut del_routes: Vec<IpNet> = Vec::new();
    for d in owned {
        if !wanted.contains(d) && !kept.contains(d) && has_route(*d) && !del_routes.contains(d) {
            del_routes.push(*d);
        }
    }
    Changes {
        add_address: (!seen
            .addresses
            .iter()
            .any(|(a, l)| mesh_addr(a, *l) == Some(want.mesh_ipv6)))
        .then_some(want.mesh_ipv6),
        add_routes: wanted.iter().copied().filter(|d| !has_route(*d)).collect(),
        del_routes,
        del_addresses: seen
            .addresses
            .iter()
            .filter_map(|(a, l)| mesh_addr(a, *l))
            .filter(|a| *a != want.mesh_ipv6)
            .collect(),
    }
}

/// The route destinations of a `.network` file or drop-in: each `[Route]` section's
/// `Destination=` (the default route of its `Gateway=`'s family when absent), and the default
/// route of each `Gateway=` of the `[Network]` section. Lines it does not understand are
/// skipped.
#[must_use]
pub fn file_routes(text: &str) -> Vec<IpNet> {
    let default_of = |gw: &str| match gw.parse::<IpAddr>() {
        Ok(IpAddr::V4(_)) => Some(IpNet::V4(Ipv4Net::default())),
        Ok(IpAddr::V6(_)) => Some(IpNet::V6(Ipv6Net::default())),
        Err(_) => None,
    };
    let mut out = Vec::new();
    let mut section = String::new();
    // The current [Route] section: its destination and gateway so far.
    let mut route: Option<(Option<IpNet>, Option<String>)> = None;
    let finish = |route: &mut Option<(Option<IpNet>, Option<String>)>, out: &mut Vec<IpNet>| {
        if let Some((dst, gw)) = route.take() {
            out.extend(dst.or_else(|| gw.as_deref().and_then(default_of)));
        }
    };
    for line in text.lines().map(str::trim) {
        if line.starts_with('#') || line.starts_with(';') || line.is_empty() {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            finish(&mut route, &mut out);
            section = name.to_owned();
            if section == "Route" {
                route = Some((None, None));
            }
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            continue;
        };
        let (key, value) = (key.trim(), value.trim());
        match (section.as_str(), key) {
            ("Network", "Gateway") => out.extend(default_of(value)),
            ("Route", "Destination") => {
                if let Some(r) = route.as_mut() {
                    r.0 = value.parse::<IpNet>().ok().map(|n| n.trunc());
                }
            }
            ("Route", "Gateway") => {
                if let Some(r) = route.as_mut() {
                    r.1 = Some(value.to_owned());
                }
            }
            _ => {}
        }
    }
    finish(&mut route, &mut out);
    out
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;
