//! A route's `via` (the host uplink or a gateway VM's mesh address), the route itself, and the
//! parsing of a VM's own mesh address.

use std::fmt;
use std::net::Ipv6Addr;
use std::str::FromStr;

use ipnet::IpNet;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::MESH_RANGE;

/// Where a route's traffic goes (spec "Routes": the `via` column).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Via {
    /// `"host"`: the host uplink; IPv4 leaves through NAT in the VM's namespace.
    Host,
    /// A gateway VM's mesh address in `fdaa::/16` (IPv6 destinations only).
    Mesh(Ipv6Addr),
}

impl fmt::Display for Via {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Host => f.write_str("host"),
            Self::Mesh(a) => write!(f, "{a}"),
        }
    }
}

impl FromStr for Via {
    type Err = String;

    /// Parses `host` or an IPv6 address in `fdaa::/16`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "host" {
            return Ok(Self::Host);
        }
        match s.parse::<Ipv6Addr>() {
            Ok(a) if MESH_RANGE.contains(&a) => Ok(Self::Mesh(a)),
            Ok(a) => Err(format!("{a} is not a mesh address in fdaa::/16")),
            Err(_) => Err(format!(
                "{s:?} is neither \"host\" nor a mesh address in fdaa::/16"
            )),
        }
    }
}

impl Serialize for Via {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Via {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// One route: traffic to `destination` goes `via` the host uplink or a gateway VM.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Route {
    /// A canonical IPv4 or IPv6 prefix, e.g. `0.0.0.0/0`, `2000::/3`.
    pub destination: IpNet,
    /// `host` or a mesh address.
    pub via: Via,
}

/// Parses a mesh address: plain (`fdaa:1::7`) or as a /128 (`fdaa:1::7/128`), in `fdaa::/16` and
/// not `fdaa::` itself.
pub(super) fn parse_mesh(s: &str) -> Result<Ipv6Addr, String> {
    let addr = match s.split_once('/') {
        Some((a, "128")) => a.parse::<Ipv6Addr>().ok(),
        Some(_) => return Err(format!("{s} must be a single address (a /128)")),
        None => s.parse::<Ipv6Addr>().ok(),
    }
    .ok_or_else(|| format!("{s:?} is not an IPv6 address"))?;
    if !MESH_RANGE.contains(&addr) {
        return Err(format!("{addr} is not in fdaa::/16"));
    }
    if addr == MESH_RANGE.network() {
        return Err(format!(
            "{addr} is the mesh range's subnet-router anycast address, not one VM's"
        ));
    }
    Ok(addr)
}
