//! A pool's ordered list of ranges, IPv4 and IPv6: [`PoolRange`], and [`AddRange`], the request
//! that appends one to the list.
//!
//! The first IPv4 range is the one `set_ip_pool` sets ([`IpRange`], with the pool's DNS
//! servers); [`AddRange`] appends further IPv4 ranges after it and IPv6 ranges. An instance
//! leases at most one address per family: the lowest free address of the first range of that
//! family with room, then the next range.
//!
//! # IPv4 ranges
//! An added IPv4 range follows every rule of the first one (see the `range` module): the
//! request is checked by [`SetIpPool::validate`], so its errors read the same.
//!
//! # IPv6 ranges
//! * `cidr`: an IPv6 network without host bits, prefix length [`MIN_PREFIX_LEN_V6`] (`/48`) to
//!   [`MAX_PREFIX_LEN_V6`] (`/128`), outside the blocks that cannot hold guest addresses
//!   ([`RESERVED_V6`]: `::/8` with the unspecified, loopback and IPv4-mapped addresses,
//!   `fe80::/10` link-local, `ff00::/8` multicast).
//! * Usable addresses: for prefixes up to `/126` the network address (the subnet-router
//!   anycast address, RFC 4291) is never usable; for prefixes up to `/120` neither are the
//!   highest 128 addresses (the reserved subnet anycast addresses, RFC 2526). Both addresses
//!   of a `/127` (RFC 6164) and the address of a `/128` are usable.
//! * `gateway`: any IPv6 unicast address outside `::/8` (so not `::` or `::1`) and not
//!   multicast; a link-local gateway (`fe80::1`) is accepted, since IPv6 guests usually route
//!   through one. It is never leased, and it may not be the network address for prefixes up to
//!   `/126`.
//! * `first_host` defaults to the address after the gateway when the gateway lies inside
//!   `cidr`, else to the lowest usable address; `last_host` defaults to the highest usable
//!   address (in a `/64` with gateway `2001:db8::1`: `2001:db8::2` to
//!   `2001:db8::ffff:ffff:ffff:ff7f`). Both must be usable, with `first_host <= last_host`.
//!
//! # Between ranges
//! Checked by the store in the transaction that writes a range ([`PoolRange::clash`]): the
//! `cidr`s of two ranges of one family, of any pools (the same pool included), must not
//! overlap, and neither's gateway may be a leasable address of the other.

use std::net::{IpAddr, Ipv6Addr};
use std::str::FromStr;

use ipnet::{IpNet, Ipv6Net};
use serde::{Deserialize, Serialize};

use super::range::{IpRange, SetIpPool};
use crate::ValidationError;
use crate::ids::validate_id;

/// The shortest prefix length of an IPv6 range: `/48`.
pub const MIN_PREFIX_LEN_V6: u8 = 48;

/// The longest prefix length of an IPv6 range: `/128` (one routed address).
pub const MAX_PREFIX_LEN_V6: u8 = 128;

/// IPv6 blocks that cannot hold guest addresses, with the name errors give them. A `cidr` may
/// not lie in any of them; a gateway may not lie in any but `fe80::/10`.
pub const RESERVED_V6: [(Ipv6Addr, u8, &str); 3] = [
    (
        Ipv6Addr::UNSPECIFIED,
        8,
        "reserved: unspecified, loopback and IPv4-mapped addresses",
    ),
    (Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0), 10, "link-local"),
    (Ipv6Addr::new(0xff00, 0, 0, 0, 0, 0, 0, 0), 8, "multicast"),
];

/// An address family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// IPv4.
    Ipv4,
    /// IPv6.
    Ipv6,
}

impl Family {
    /// `IPv4` or `IPv6`, as messages name the family.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Ipv4 => "IPv4",
            Self::Ipv6 => "IPv6",
        }
    }

    /// The family of an address.
    #[must_use]
    pub const fn of(a: IpAddr) -> Self {
        match a {
            IpAddr::V4(_) => Self::Ipv4,
            IpAddr::V6(_) => Self::Ipv6,
        }
    }
}

/// One range of a pool's list, with its defaults filled in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolRange {
    /// The pool.
    pub pool_id: String,
    /// `ipv4` or `ipv6`.
    pub family: Family,
    /// The network (canonical).
    pub cidr: IpNet,
    /// The gateway; never leased.
    pub gateway: IpAddr,
    /// The first address leased.
    pub first_host: IpAddr,
    /// The last address leased.
    pub last_host: IpAddr,
}

/// An address as a number (IPv4 addresses as their 32-bit value).
#[must_use]
pub fn addr_num(a: IpAddr) -> u128 {
    match a {
        IpAddr::V4(a) => u128::from(u32::from(a)),
        IpAddr::V6(a) => u128::from(a),
    }
}

impl From<&IpRange> for PoolRange {
    fn from(r: &IpRange) -> Self {
        Self {
            pool_id: r.pool_id.clone(),
            family: Family::Ipv4,
            cidr: IpNet::V4(r.cidr),
            gateway: IpAddr::V4(r.gateway),
            first_host: IpAddr::V4(r.first_host),
            last_host: IpAddr::V4(r.last_host),
        }
    }
}

impl PoolRange {
    /// The leasable bounds `(first_host, last_host)` and the gateway as numbers.
    #[must_use]
    pub fn bounds(&self) -> (u128, u128, u128) {
        (
            addr_num(self.first_host),
            addr_num(self.last_host),
            addr_num(self.gateway),
        )
    }

    /// Whether `addr` is leasable: of this family, inside `first_host..=last_host` and not the
    /// gateway.
    #[must_use]
    pub fn is_leasable(&self, addr: IpAddr) -> bool {
        let (lo, hi, gw) = self.bounds();
        let n = addr_num(addr);
        Family::of(addr) == self.family && lo <= n && n <= hi && n != gw
    }

    /// The number of leasable addresses (the range minus the gateway if inside it).
    #[must_use]
    pub fn size(&self) -> u128 {
        let (lo, hi, gw) = self.bounds();
        let n = hi - lo + 1;
        if (lo..=hi).contains(&gw) { n - 1 } else { n }
    }

    /// Why this range cannot coexist with `other` (another range of any pool, this one
    /// included), or `None` when it can: ranges of one family clash when their `cidr`s overlap or
    /// when either's gateway is a leasable address of the other. The sentence names the other
    /// pool, e.g. `cidr 10.0.0.0/24 overlaps cidr 10.0.0.0/16 of pool p2`.
    #[must_use]
    pub fn clash(&self, other: &PoolRange) -> Option<String> {
        if self.family != other.family {
            return None;
        }
        let o = &other.pool_id;
        if self.cidr.contains(&other.cidr.network()) || other.cidr.contains(&self.cidr.network()) {
            return Some(format!(
                "cidr {} overlaps cidr {} of pool {o}",
                self.cidr, other.cidr
            ));
        }
        if other.is_leasable(self.gateway) {
            return Some(format!(
                "gateway {} is a leasable address of pool {o} ({} to {})",
                self.gateway, other.first_host, other.last_host
            ));
        }
        if self.is_leasable(other.gateway) {
            return Some(format!(
                "the gateway {} of pool {o} would be leased by this range ({} to {})",
                other.gateway, self.first_host, self.last_host
            ));
        }
        None
    }
}

/// The request that appends a range to a pool's list (`add_range`): strings as the caller
/// gave them, validated by [`AddRange::validate`]. The family follows from `cidr`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddRange {
    /// The hosted pool (an id).
    pub pool_id: String,
    /// The network: IPv4 (as for `set_ip_pool`) or IPv6 (`/48` to `/128`).
    pub cidr: String,
    /// The gateway address; never leased.
    pub gateway: String,
    /// The first address to lease (default: see the module docs).
    #[serde(default)]
    pub first_host: Option<String>,
    /// The last address to lease (default: see the module docs).
    #[serde(default)]
    pub last_host: Option<String>,
}

impl AddRange {
    /// Validates the request and fills in the defaults.
    ///
    /// # Errors
    /// `INVALID_INPUT` naming the pool and the field, e.g.
    /// `pool p1: cidr 2001:db8::/32 has prefix length 32; it must be between /48 and /128`,
    /// `pool p1: gateway ff02::1 lies in ff00::/8 (multicast), which cannot be a gateway`;
    /// for an IPv4 `cidr` the errors of [`SetIpPool::validate`].
    pub fn validate(&self) -> Result<PoolRange, ValidationError> {
        validate_id("pool_id", &self.pool_id)?;
        if let Some(IpNet::V4(_)) = crate::vm::parse_net(&self.cidr) {
            let r = SetIpPool {
                pool_id: self.pool_id.clone(),
                cidr: self.cidr.clone(),
                gateway: self.gateway.clone(),
                first_host: self.first_host.clone(),
                last_host: self.last_host.clone(),
                dns: Vec::new(),
            }
            .validate()?;
            return Ok(PoolRange::from(&r));
        }
        let p = &self.pool_id;
        let bad =
            |field: &str, what: String| ValidationError::rule(format!("pool {p}: {field} {what}"));
        let cidr = parse_cidr6(&self.cidr).map_err(|what| bad("cidr", what))?;
        let gateway = parse_v6(&self.gateway).map_err(|what| bad("gateway", what))?;
        if let Some((block, name)) = reserved_block6(Ipv6Net::from(gateway))
            && name != "link-local"
        {
            return Err(bad(
                "gateway",
                format!("{gateway} lies in {block} ({name}), which cannot be a gateway"),
            ));
        }
        if cidr.prefix_len() <= 126 && gateway == cidr.network() {
            return Err(bad(
                "gateway",
                format!("{gateway} is the subnet-router anycast address of {cidr}"),
            ));
        }
        let (lo, hi) = usable_hosts6(cidr);
        let first_host = match &self.first_host {
            Some(s) => parse_v6(s).map_err(|what| bad("first_host", what))?,
            None if cidr.contains(&gateway) && gateway < hi => {
                Ipv6Addr::from(u128::from(gateway) + 1)
            }
            None => lo,
        };
        let last_host = match &self.last_host {
            Some(s) => parse_v6(s).map_err(|what| bad("last_host", what))?,
            None => hi,
        };
        for (field, addr) in [("first_host", first_host), ("last_host", last_host)] {
            if !cidr.contains(&addr) {
                return Err(bad(field, format!("{addr} is outside cidr {cidr}")));
            }
            if addr < lo {
                return Err(bad(
                    field,
                    format!("{addr} is the subnet-router anycast address of {cidr}"),
                ));
            }
            if addr > hi {
                return Err(bad(
                    field,
                    format!("{addr} is a reserved subnet anycast address of {cidr} (RFC 2526)"),
                ));
            }
        }
        if first_host > last_host {
            return Err(bad(
                "first_host",
                format!("{first_host} is after last_host {last_host}"),
            ));
        }
        Ok(PoolRange {
            pool_id: p.clone(),
            family: Family::Ipv6,
            cidr: IpNet::V6(cidr),
            gateway: IpAddr::V6(gateway),
            first_host: IpAddr::V6(first_host),
            last_host: IpAddr::V6(last_host),
        })
    }
}

/// The usable addresses of an IPv6 network as `(lowest, highest)` (see the module docs).
#[must_use]
pub fn usable_hosts6(net: Ipv6Net) -> (Ipv6Addr, Ipv6Addr) {
    let lo = u128::from(net.network());
    let hi = u128::from(net.broadcast());
    match net.prefix_len() {
        127.. => (lo.into(), hi.into()),
        121..=126 => ((lo + 1).into(), hi.into()),
        _ => ((lo + 1).into(), (hi - 128).into()),
    }
}

/// The reserved block (see [`RESERVED_V6`]) `net` overlaps, as `(block, name)`.
fn reserved_block6(net: Ipv6Net) -> Option<(Ipv6Net, &'static str)> {
    RESERVED_V6.iter().find_map(|&(a, len, name)| {
        let block = Ipv6Net::new(a, len).ok()?;
        (block.contains(&net.network()) || net.contains(&block.network())).then_some((block, name))
    })
}

fn parse_cidr6(s: &str) -> Result<Ipv6Net, String> {
    let Some(IpNet::V6(net)) = crate::vm::parse_net(s) else {
        return Err(format!(
            "{s:?} is not an IPv4 or IPv6 CIDR such as 2001:db8::/64"
        ));
    };
    if net.network() != net.addr() {
        return Err(format!(
            "{net} has host bits set (the network is {})",
            net.trunc()
        ));
    }
    let len = net.prefix_len();
    if !(MIN_PREFIX_LEN_V6..=MAX_PREFIX_LEN_V6).contains(&len) {
        return Err(format!(
            "{net} has prefix length {len}; it must be between /{MIN_PREFIX_LEN_V6} and /{MAX_PREFIX_LEN_V6}"
        ));
    }
    if let Some((block, name)) = reserved_block6(net) {
        return Err(format!(
            "{net} lies in {block} ({name}), which cannot hold guest addresses"
        ));
    }
    Ok(net)
}

/// Parses an IPv6 address strictly (std's parser).
fn parse_v6(s: &str) -> Result<Ipv6Addr, String> {
    match IpAddr::from_str(s) {
        Ok(IpAddr::V6(a)) => Ok(a),
        Ok(IpAddr::V4(a)) => Err(format!("{a} is IPv4; an IPv6 range needs IPv6 addresses")),
        Err(_) => Err(format!("{s:?} is not an IPv6 address")),
    }
}

#[cfg(test)]
mod tests;
