//! Public addresses of a VM (spec "Routes", the public address table): `public_ipv4` (one
//! address) and `public_ipv6` (an address, i.e. a /128 the host maps to the guest's mesh address,
//! or a shorter routed block the guest configures itself).
//!
//! # Rules (each `INVALID_INPUT` naming the VM and the field)
//! - `public_ipv4`: an IPv4 address, written plain or as a /32, that is global unicast: not
//!   unspecified (0.0.0.0/8), loopback, private (10/8, 172.16/12, 192.168/16), shared
//!   (100.64/10), link-local, multicast, reserved (240/4) or broadcast. Documentation ranges are
//!   allowed (the tests use them). It needs an IPv4 route via `host` (its replies leave through
//!   the host uplink).
//! - `public_ipv6`: an IPv6 address, or a canonical prefix (no host bits; a /128 is the address
//!   form), that is global unicast: not unspecified, loopback, multicast, link-local, unique
//!   local (fc00::/7, which holds the mesh range fdaa::/16) or IPv4-mapped. A routed block is at
//!   most a /48 (`MAX_BLOCK_PREFIX`: an end site's allocation; the host routes the whole block to
//!   one VM). It needs an IPv6 route via `host`.
//! - The transit range is a host setting: the planner refuses a public IPv4 inside it.

use std::net::{Ipv4Addr, Ipv6Addr};

use ipnet::Ipv6Net;
use serde_json::Value;

use super::{MESH_RANGE, VmConfig};
use crate::ValidationError;

/// The IPv4 ranges a public address must not lie in, with the name used in errors.
const V4_REFUSED: &[(&str, [u8; 4], u8)] = &[
    ("the unspecified range 0.0.0.0/8", [0, 0, 0, 0], 8),
    ("the private range 10.0.0.0/8", [10, 0, 0, 0], 8),
    ("the shared range 100.64.0.0/10", [100, 64, 0, 0], 10),
    ("the loopback range 127.0.0.0/8", [127, 0, 0, 0], 8),
    ("the link-local range 169.254.0.0/16", [169, 254, 0, 0], 16),
    ("the private range 172.16.0.0/12", [172, 16, 0, 0], 12),
    (
        "the IETF protocol assignments range 192.0.0.0/24",
        [192, 0, 0, 0],
        24,
    ),
    (
        "the 6to4 relay anycast range 192.88.99.0/24",
        [192, 88, 99, 0],
        24,
    ),
    ("the private range 192.168.0.0/16", [192, 168, 0, 0], 16),
    ("the benchmarking range 198.18.0.0/15", [198, 18, 0, 0], 15),
    ("the multicast range 224.0.0.0/4", [224, 0, 0, 0], 4),
    ("the reserved range 240.0.0.0/4", [240, 0, 0, 0], 4),
];

/// The IPv6 ranges a public address or block must not overlap, with the name used in errors.
/// The mesh range comes first so its name wins over the unique local range that holds it.
fn v6_refused() -> [(&'static str, Ipv6Net); 9] {
    let n = |s: &str| s.parse::<Ipv6Net>().expect("valid prefix");
    [
        ("the mesh range fdaa::/16", MESH_RANGE),
        ("the unspecified address ::/128", n("::/128")),
        ("the loopback address ::1/128", n("::1/128")),
        ("the IPv4-mapped range ::ffff:0:0/96", n("::ffff:0:0/96")),
        ("the discard-only range 100::/64", n("100::/64")),
        (
            "the IETF protocol assignments range 2001::/23",
            n("2001::/23"),
        ),
        ("the unique local range fc00::/7", n("fc00::/7")),
        ("the link-local range fe80::/10", n("fe80::/10")),
        ("the multicast range ff00::/8", n("ff00::/8")),
    ]
}

/// Why `a` is not a public IPv4 address, if it is not.
#[must_use]
pub fn ipv4_refusal(a: Ipv4Addr) -> Option<String> {
    if a.is_broadcast() {
        return Some(format!(
            "{a} is the broadcast address, not a global unicast address"
        ));
    }
    let bits = u32::from(a);
    V4_REFUSED.iter().find_map(|(name, net, len)| {
        let mask = u32::MAX << (32 - u32::from(*len));
        (bits & mask == u32::from(Ipv4Addr::from(*net)))
            .then(|| format!("{a} lies in {name}; a public address must be global unicast"))
    })
}

/// Why `n` is not a public IPv6 address or block, if it is not: it overlaps a refused range.
#[must_use]
pub fn ipv6_refusal(n: Ipv6Net) -> Option<String> {
    let refused = v6_refused();
    let hit = refused
        .iter()
        .find(|(_, r)| r.contains(&n))
        .or_else(|| refused.iter().find(|(_, r)| n.contains(r)));
    hit.map(|(name, _)| {
        let what = if n.prefix_len() == 128 {
            format!("{} lies in", n.addr())
        } else {
            format!("{n} overlaps")
        };
        format!("{what} {name}; a public address must be global unicast")
    })
}

/// Parses `public_ipv4` from JSON: a string holding an address or a /32.
pub(super) fn parse_ipv4(v: &Value) -> Result<Option<Ipv4Addr>, String> {
    let s = match v {
        Value::Null => return Ok(None),
        Value::String(s) => s,
        v => return Err(format!("must be a string, got {v}")),
    };
    let addr = match s.split_once('/') {
        Some((a, "32")) => a.parse::<Ipv4Addr>().ok(),
        Some(_) => return Err(format!("{s} must be a single IPv4 address (a /32)")),
        None => s.parse::<Ipv4Addr>().ok(),
    }
    .ok_or_else(|| format!("{s:?} is not an IPv4 address"))?;
    if let Some(m) = ipv4_refusal(addr) {
        return Err(m);
    }
    Ok(Some(addr))
}

/// Parses `public_ipv6` from JSON: a string holding an address (a /128) or a canonical prefix.
pub(super) fn parse_ipv6(v: &Value) -> Result<Option<Ipv6Net>, String> {
    let s = match v {
        Value::Null => return Ok(None),
        Value::String(s) => s,
        v => return Err(format!("must be a string, got {v}")),
    };
    let net = if s.contains('/') {
        match super::parse_net(s) {
            Some(ipnet::IpNet::V6(n)) => n,
            _ => return Err(format!("{s:?} is not an IPv6 address or prefix")),
        }
    } else {
        let a = s
            .parse::<Ipv6Addr>()
            .map_err(|_| format!("{s:?} is not an IPv6 address or prefix"))?;
        Ipv6Net::new(a, 128).expect("128 is a valid length")
    };
    check_ipv6(net)?;
    Ok(Some(net))
}

/// The shortest prefix a routed `public_ipv6` block may have: a /48, an end site's allocation.
pub const MAX_BLOCK_PREFIX: u8 = 48;

/// Checks a parsed `public_ipv6`: canonical, global unicast, and no larger than a /48.
pub(super) fn check_ipv6(net: Ipv6Net) -> Result<(), String> {
    if net.trunc() != net {
        return Err(format!(
            "{net} is not canonical (host bits set; did you mean {}?)",
            net.trunc()
        ));
    }
    let too_large = || {
        format!(
            "{net} is larger than a /{MAX_BLOCK_PREFIX}; a VM's routed block is at most a /{MAX_BLOCK_PREFIX}"
        )
    };
    // A huge prefix (`::/0`, `::/1`) overlaps some special range whatever it is: its size is
    // the mistake to name. A smaller one is named by the range it lies in, if any.
    if net.prefix_len() < 8 {
        return Err(too_large());
    }
    if let Some(m) = ipv6_refusal(net) {
        return Err(m);
    }
    if net.prefix_len() < MAX_BLOCK_PREFIX {
        return Err(too_large());
    }
    Ok(())
}

/// The text of a `public_ipv6` as configs write it: a /128 in the address form (`2001:db8::5`), a
/// block as a prefix (`2001:db8:7::/56`).
pub fn ipv6_text(n: &Ipv6Net) -> String {
    if n.prefix_len() == 128 {
        n.addr().to_string()
    } else {
        n.to_string()
    }
}

impl VmConfig {
    /// Whether the config routes `::/0` via host (a gateway VM; required of a VM that owns a
    /// public IPv6 block).
    #[must_use]
    pub fn default_v6_via_host(&self) -> bool {
        self.network.routes.iter().any(|r| {
            r.via == super::Via::Host
                && r.destination == ipnet::IpNet::V6(ipnet::Ipv6Net::default())
        })
    }

    /// The rules of the module docs for `public_ipv4` and `public_ipv6`, naming the VM and the
    /// field.
    pub(super) fn validate_public(&self) -> Result<(), ValidationError> {
        let vm = &self.id;
        if let Some(a) = self.public_ipv4 {
            if let Some(m) = ipv4_refusal(a) {
                return Err(ValidationError::rule(format!("vm {vm}: public_ipv4 {m}")));
            }
            if !self.ipv4_via_host() {
                return Err(ValidationError::rule(format!(
                    "vm {vm}: public_ipv4 {a} needs an IPv4 route via host (e.g. 0.0.0.0/0 via host): its replies leave through the host uplink"
                )));
            }
        }
        if let Some(n) = self.public_ipv6 {
            check_ipv6(n)
                .map_err(|m| ValidationError::rule(format!("vm {vm}: public_ipv6 {m}")))?;
            // The default route through something else (a mesh gateway VM) is named, so the
            // user sees which route to change.
            let other_default = self
                .network
                .routes
                .iter()
                .find(|r| {
                    r.via != super::Via::Host
                        && r.destination == ipnet::IpNet::V6(ipnet::Ipv6Net::default())
                })
                .map(|r| format!(" (its ::/0 goes via {} instead)", r.via))
                .unwrap_or_default();
            // A block is reached from anywhere (the internet, and VMs on other hosts through
            // the mesh), so every reply must be able to leave: spec "Atlas WG Mesh", a VM with a
            // block routes ::/0 through the host.
            if n.prefix_len() < 128 && !self.default_v6_via_host() {
                return Err(ValidationError::rule(format!(
                    "vm {vm}: public_ipv6 {n} is a block: a VM that owns a block needs the route ::/0 via host{other_default}: its replies to any address leave through the host uplink"
                )));
            }
            if !self.ipv6_via_host() {
                return Err(ValidationError::rule(format!(
                    "vm {vm}: public_ipv6 {} needs an IPv6 route via host (e.g. ::/0 via host){other_default}: its replies leave through the host uplink",
                    ipv6_text(&n)
                )));
            }
        }
        Ok(())
    }
}
