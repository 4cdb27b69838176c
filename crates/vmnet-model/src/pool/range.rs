//! Pool ranges: [`SetIpPool`] (the caller's strings) validated into an [`IpRange`] (spec:
//! hosted-pool-networking.md, "Give a hosted pool a range"). Re-exported from [`crate::pool`].
//!
//! # Ranges
//! * IPv4 only; an IPv6 `cidr` is refused.
//! * Addresses and CIDRs are parsed strictly: no surrounding whitespace, no leading zeros
//!   (`010.5.0.0/24` and `" 10.5.0.0/24"` are refused, never read as `10.5.0.0/24`).
//! * `cidr` must be canonical (no host bits set).
//! * The prefix length of `cidr` lies between [`MIN_PREFIX_LEN`] (`/16`, 65,534 guests) and
//!   [`MAX_PREFIX_LEN`] (`/32`, one routed address). A pool's guests share one bridge per host,
//!   one broadcast domain; anything larger than a /16 is not a sensible guest subnet, and
//!   `0.0.0.0/0` would lease up to `255.255.255.254`.
//! * `cidr` must not lie in a block that cannot hold guest addresses ([`RESERVED`]):
//!   `0.0.0.0/8` ("this network"), `127.0.0.0/8` (loopback), `169.254.0.0/16` (link-local),
//!   `224.0.0.0/4` (multicast) and `240.0.0.0/4` (reserved, with the limited broadcast address
//!   `255.255.255.255`). With the prefix limit above, a `cidr` either lies wholly inside such a
//!   block or wholly outside it.
//! * `first_host` defaults to the address after the gateway, `last_host` to the address before the
//!   broadcast address. Both must be *usable host addresses* of `cidr` (see below), with
//!   `first_host <= last_host`.
//! * The gateway may lie anywhere (inside or outside the range, even outside `cidr`) except on
//!   the network or broadcast address of `cidr` (prefixes up to /30) and in the reserved blocks
//!   other than link-local: a link-local gateway such as `169.254.1.1` is the usual on-link
//!   gateway of routed `/32` guests, so it is accepted. The gateway is never leased.
//! * Between pools (checked by the store, in the transaction that writes the range; see
//!   [`IpRange::clash`]): two pools' `cidr`s must not overlap, and no pool's gateway may be a
//!   leasable address of another pool. Either is `CONFLICT` naming the other pool.
//!
//! # DNS servers
//! At most [`MAX_DNS`] (8; glibc's stub resolver reads only the first 3, systemd-resolved all),
//! each an IPv4 or IPv6 unicast address given once. Refused: the unspecified addresses
//! `0.0.0.0` and `::`, the broadcast address `255.255.255.255`, multicast addresses, IPv4-mapped
//! IPv6 addresses (`::ffff:10.0.0.1`; give the IPv4 address) and repeats (compared after
//! parsing, so `2001:db8::1` and `2001:DB8::1` are one address).
//!
//! # Usable addresses, /31 and /32
//! * Prefix length 0 to 30: the network address and the broadcast address are never usable, so
//!   they can never be `first_host`/`last_host` and are never leased.
//! * `/31` follows RFC 3021 (point-to-point): there is no network or broadcast address, both
//!   addresses are usable, and the default `last_host` is the upper address.
//! * `/32`: the one address is usable and is the default `last_host`. A gateway inside the /32
//!   leaves nothing to lease: with the default `first_host` (the address after the gateway, outside
//!   the /32) the range is refused with `INVALID_INPUT`; with `first_host` set explicitly it is
//!   accepted but leases nothing (every lease is `CAPACITY_UNAVAILABLE`). With a gateway outside
//!   it (a routed /32), set `first_host` explicitly to the address (the default is refused with
//!   that hint).

use std::net::{IpAddr, Ipv4Addr};
use std::str::FromStr;

use ipnet::{IpNet, Ipv4Net};
use serde::{Deserialize, Serialize};

use crate::ValidationError;
use crate::ids::validate_id;

/// The shortest prefix length a pool's `cidr` may have: `/16`.
pub const MIN_PREFIX_LEN: u8 = 16;

/// The longest prefix length a pool's `cidr` may have: `/32`.
pub const MAX_PREFIX_LEN: u8 = 32;

/// The most DNS servers a range may list.
pub const MAX_DNS: usize = 8;

/// IPv4 blocks that cannot hold guest addresses, with the name errors give them. A `cidr` may not
/// lie in any of them; a gateway may not lie in any but `169.254.0.0/16`.
pub const RESERVED: [(Ipv4Addr, u8, &str); 5] = [
    (Ipv4Addr::new(0, 0, 0, 0), 8, "\"this network\""),
    (Ipv4Addr::new(127, 0, 0, 0), 8, "loopback"),
    (Ipv4Addr::new(169, 254, 0, 0), 16, "link-local"),
    (Ipv4Addr::new(224, 0, 0, 0), 4, "multicast"),
    (Ipv4Addr::new(240, 0, 0, 0), 4, "reserved"),
];

/// The reserved block (see [`RESERVED`]) `net` overlaps, as `(block, name)`.
fn reserved_block(net: Ipv4Net) -> Option<(Ipv4Net, &'static str)> {
    RESERVED.iter().find_map(|&(a, len, name)| {
        let block = Ipv4Net::new(a, len).ok()?;
        (block.contains(&net.network()) || net.contains(&block.network())).then_some((block, name))
    })
}

/// The request of `set_ip_pool`: strings as the caller gave them, validated by
/// [`SetIpPool::validate`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetIpPool {
    /// The hosted pool (an id, see [`validate_id`]).
    pub pool_id: String,
    /// The IPv4 network, e.g. `10.0.0.0/24`; prefix length [`MIN_PREFIX_LEN`] to
    /// [`MAX_PREFIX_LEN`], outside the [`RESERVED`] blocks.
    pub cidr: String,
    /// The gateway address; never leased.
    pub gateway: String,
    /// The first address to lease. Default: the address after the gateway.
    #[serde(default)]
    pub first_host: Option<String>,
    /// The last address to lease. Default: the address before the broadcast address.
    #[serde(default)]
    pub last_host: Option<String>,
    /// DNS servers for the guests (IPv4 or IPv6 unicast, each once, at most [`MAX_DNS`]).
    /// Default: empty.
    #[serde(default)]
    pub dns: Vec<String>,
}

/// A pool's stored range with its defaults filled in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpRange {
    /// The hosted pool.
    pub pool_id: String,
    /// The IPv4 network (canonical).
    pub cidr: Ipv4Net,
    /// The gateway; never leased.
    pub gateway: Ipv4Addr,
    /// The first address leased.
    pub first_host: Ipv4Addr,
    /// The last address leased.
    pub last_host: Ipv4Addr,
    /// DNS servers for the guests, possibly empty.
    pub dns: Vec<IpAddr>,
}

impl IpRange {
    /// Whether `addr` is leasable: inside `first_host..=last_host` and not the gateway.
    #[must_use]
    pub fn is_leasable(&self, addr: Ipv4Addr) -> bool {
        self.first_host <= addr && addr <= self.last_host && addr != self.gateway
    }

    /// The number of leasable addresses (the range minus the gateway if inside it).
    #[must_use]
    pub fn size(&self) -> u64 {
        let n = u64::from(u32::from(self.last_host)) - u64::from(u32::from(self.first_host)) + 1;
        if (self.first_host..=self.last_host).contains(&self.gateway) {
            n - 1
        } else {
            n
        }
    }

    /// Why this range cannot coexist with `other`, another pool's range, or `None` when it can.
    /// Two ranges clash when their `cidr`s overlap (they would lease the same addresses, or one
    /// another's network and broadcast addresses, on one bridge), or when either's gateway is a
    /// leasable address of the other. The sentence names the other pool, e.g.
    /// `cidr 10.0.0.0/24 overlaps cidr 10.0.0.0/16 of pool p2`.
    #[must_use]
    pub fn clash(&self, other: &IpRange) -> Option<String> {
        super::ranges::PoolRange::from(self).clash(&super::ranges::PoolRange::from(other))
    }
}

/// The usable host addresses of `net` as `(lowest, highest)`: without the network and broadcast
/// addresses for prefixes up to /30, both addresses of a /31 (RFC 3021), the address of a /32.
#[must_use]
pub fn usable_hosts(net: Ipv4Net) -> (Ipv4Addr, Ipv4Addr) {
    let lo = u32::from(net.network());
    let hi = u32::from(net.broadcast());
    if net.prefix_len() >= 31 {
        (lo.into(), hi.into())
    } else {
        ((lo + 1).into(), (hi - 1).into())
    }
}

impl SetIpPool {
    /// Validates the request and fills in the defaults.
    ///
    /// # Errors
    /// `INVALID_INPUT` naming the pool and the field, e.g.
    /// `pool p1: cidr 10.0.0.1/24 has host bits set (the network is 10.0.0.0/24)`,
    /// `pool p1: cidr 10.0.0.0/8 has prefix length 8; it must be between /16 and /32`,
    /// `pool p1: cidr 127.0.0.0/24 lies in 127.0.0.0/8 (loopback), which cannot hold guest addresses`,
    /// `pool p1: first_host 10.0.1.2 is outside cidr 10.0.0.0/24`,
    /// `pool p1: first_host 10.0.0.9 is after last_host 10.0.0.6`,
    /// `pool p1: dns[2] 10.0.0.53 repeats dns[0]`.
    pub fn validate(&self) -> Result<IpRange, ValidationError> {
        validate_id("pool_id", &self.pool_id)?;
        let p = &self.pool_id;
        let bad =
            |field: &str, what: String| ValidationError::rule(format!("pool {p}: {field} {what}"));
        let cidr = parse_cidr(&self.cidr).map_err(|what| bad("cidr", what))?;
        let gateway = parse_v4(&self.gateway).map_err(|what| bad("gateway", what))?;
        if let Some((block, name)) = reserved_block(Ipv4Net::from(gateway))
            && name != "link-local"
        {
            return Err(bad(
                "gateway",
                format!("{gateway} lies in {block} ({name}), which cannot be a gateway"),
            ));
        }
        if cidr.prefix_len() <= 30 {
            if gateway == cidr.network() {
                return Err(bad(
                    "gateway",
                    format!("{gateway} is the network address of {cidr}"),
                ));
            }
            if gateway == cidr.broadcast() {
                return Err(bad(
                    "gateway",
                    format!("{gateway} is the broadcast address of {cidr}"),
                ));
            }
        }
        let (lo, hi) = usable_hosts(cidr);
        let first_host = match &self.first_host {
            Some(s) => parse_v4(s).map_err(|what| bad("first_host", what))?,
            None => {
                let next = u32::from(gateway).checked_add(1).ok_or_else(|| {
                    bad(
                        "first_host",
                        format!("has no default: gateway {gateway} is the last IPv4 address"),
                    )
                })?;
                Ipv4Addr::from(next)
            }
        };
        let last_host = match &self.last_host {
            Some(s) => parse_v4(s).map_err(|what| bad("last_host", what))?,
            None => hi,
        };
        let default_hint = |field: &str| {
            if field == "first_host" && self.first_host.is_none() {
                " (the default is the address after the gateway; set first_host explicitly)"
            } else {
                ""
            }
        };
        for (field, addr) in [("first_host", first_host), ("last_host", last_host)] {
            if !cidr.contains(&addr) {
                let hint = default_hint(field);
                return Err(bad(field, format!("{addr} is outside cidr {cidr}{hint}")));
            }
            if addr < lo {
                return Err(bad(
                    field,
                    format!("{addr} is the network address of {cidr}"),
                ));
            }
            if addr > hi {
                let hint = default_hint(field);
                return Err(bad(
                    field,
                    format!("{addr} is the broadcast address of {cidr}{hint}"),
                ));
            }
        }
        if first_host > last_host {
            return Err(bad(
                "first_host",
                format!("{first_host} is after last_host {last_host}"),
            ));
        }
        let dns = parse_dns(&self.dns).map_err(|(field, what)| bad(&field, what))?;
        Ok(IpRange {
            pool_id: p.clone(),
            cidr,
            gateway,
            first_host,
            last_host,
            dns,
        })
    }
}

/// Parses and checks the DNS list (see the module docs); on error the field (`dns` or
/// `dns[i]`) and what is wrong with it.
fn parse_dns(list: &[String]) -> Result<Vec<IpAddr>, (String, String)> {
    if list.len() > MAX_DNS {
        return Err((
            "dns".into(),
            format!("has {} entries; at most {MAX_DNS} are allowed", list.len()),
        ));
    }
    let mut dns: Vec<IpAddr> = Vec::with_capacity(list.len());
    for (i, s) in list.iter().enumerate() {
        let field = format!("dns[{i}]");
        let ip = IpAddr::from_str(s)
            .map_err(|_| (field.clone(), format!("{s:?} is not an IP address")))?;
        let why = match ip {
            IpAddr::V4(a) if a.is_unspecified() => Some("is the unspecified address".to_owned()),
            IpAddr::V4(a) if a.is_broadcast() => Some("is the broadcast address".to_owned()),
            IpAddr::V6(a) if a.is_unspecified() => Some("is the unspecified address".to_owned()),
            IpAddr::V6(a) => a
                .to_ipv4_mapped()
                .map(|v4| format!("is an IPv4-mapped IPv6 address; give the IPv4 address {v4}")),
            IpAddr::V4(_) => None,
        };
        let why = why.or_else(|| {
            ip.is_multicast()
                .then(|| "is a multicast address".to_owned())
        });
        if let Some(why) = why {
            return Err((field, format!("{ip} {why}")));
        }
        if let Some(j) = dns.iter().position(|d| *d == ip) {
            return Err((field, format!("{ip} repeats dns[{j}]")));
        }
        dns.push(ip);
    }
    Ok(dns)
}

fn parse_cidr(s: &str) -> Result<Ipv4Net, String> {
    let net = match crate::vm::parse_net(s) {
        Some(IpNet::V4(net)) => net,
        Some(IpNet::V6(net)) => {
            return Err(format!("{net} is IPv6; only IPv4 ranges are supported"));
        }
        None => return Err(format!("{s:?} is not an IPv4 CIDR such as 10.0.0.0/24")),
    };
    if net.network() != net.addr() {
        return Err(format!(
            "{net} has host bits set (the network is {})",
            net.trunc()
        ));
    }
    let len = net.prefix_len();
    if !(MIN_PREFIX_LEN..=MAX_PREFIX_LEN).contains(&len) {
        return Err(format!(
            "{net} has prefix length {len}; it must be between /{MIN_PREFIX_LEN} and /{MAX_PREFIX_LEN}"
        ));
    }
    if let Some((block, name)) = reserved_block(net) {
        return Err(format!(
            "{net} lies in {block} ({name}), which cannot hold guest addresses"
        ));
    }
    Ok(net)
}

/// Parses an IPv4 address strictly (std's parser: no whitespace, no leading zeros).
fn parse_v4(s: &str) -> Result<Ipv4Addr, String> {
    match IpAddr::from_str(s) {
        Ok(IpAddr::V4(a)) => Ok(a),
        Ok(IpAddr::V6(a)) => Err(format!("{a} is IPv6; only IPv4 is supported")),
        Err(_) => Err(format!("{s:?} is not an IPv4 address")),
    }
}
