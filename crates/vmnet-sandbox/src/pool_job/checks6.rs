//! The IPv6 half of the pool sandbox's checks, for a dual-stack pool (an IPv6 range in the
//! spec's `ranges`): each guest's IPv6 lease and seed, reachability over IPv6 by policy (the
//! gateway, the fake internet, another guest), and the IPv6 spoof frames the spoof suite
//! sends beside its IPv4 ones, each kind with an honest control.

use std::net::{IpAddr, Ipv6Addr};

use vmnet_model::nic::NetworkPolicy;
use vmnet_model::pool::PoolRange;

use super::checks::{Check, GuestInfo, check, passes, ping, stop};
use crate::probe::{ALL_NODES_MAC, icmp6_frame, udp6_frame};
use crate::sandbox::ECHO_V6;

/// Builds a frame around a marker.
pub(super) type Build = Box<dyn Fn(&[u8]) -> Vec<u8>>;

/// The n-th leasable address of the IPv6 range `r` (lowest first, gateway skipped).
fn nth_leasable6(r: &PoolRange, n: usize) -> Option<Ipv6Addr> {
    let (IpAddr::V6(first), IpAddr::V6(last)) = (r.first_host, r.last_host) else {
        return None;
    };
    let mut a = u128::from(first);
    let mut left = n;
    loop {
        let addr = Ipv6Addr::from(a);
        if addr > last {
            return None;
        }
        if IpAddr::V6(addr) != r.gateway {
            if left == 0 {
                return Some(addr);
            }
            left -= 1;
        }
        a = a.checked_add(1)?;
    }
}

/// The IPv6 leases against the walk-through: the k-th instance placed holds the k-th
/// leasable address of `r` (`placed` the leases in placement order).
pub(super) fn leases(r: &PoolRange, placed: &[(&str, Option<Ipv6Addr>)]) -> Vec<Check> {
    placed
        .iter()
        .enumerate()
        .map(|(k, (id, got))| {
            check(
                format!("IPv6 lease of {id}"),
                nth_leasable6(r, k).map_or_else(|| "none".to_owned(), |a| a.to_string()),
                got.map_or_else(|| "none".to_owned(), |a| a.to_string()),
            )
        })
        .collect()
}

/// Each guest's default routes as configured from its seed: IPv4 via `gw4`, IPv6 via the
/// range's gateway.
pub(super) fn seed_routes(guests: &[GuestInfo], gw4: IpAddr, r: &PoolRange) -> Vec<Check> {
    guests
        .iter()
        .take_while(|_| !stop())
        .map(|g| {
            check(
                format!("seed of {} gives both default routes", g.id),
                format!("0.0.0.0/0 via {gw4}, ::/0 via {}", r.gateway),
                g.seed_routes
                    .iter()
                    .map(|(to, via)| format!("{to} via {via}"))
                    .collect::<Vec<_>>()
                    .join(", "),
            )
        })
        .collect()
}

/// Reachability over IPv6 by policy, as the IPv4 checks: each guest to the IPv6 gateway
/// (not `none`) and to the fake internet's [`ECHO_V6`] (only `public`); the first public
/// guest to the second by its IPv6 lease (passes) and to each `none` guest (dropped). The
/// pings of different guests run at once (each guest is its own namespace), so the dropped
/// ones cost one ping's wait, not one each.
pub(super) fn reach(guests: &[GuestInfo], r: &PoolRange) -> Vec<Check> {
    if stop() {
        return Vec::new();
    }
    let mut out: Vec<Check> = std::thread::scope(|s| {
        let runs: Vec<_> = guests
            .iter()
            .map(|g| s.spawn(move || (ping(&g.ns, r.gateway), ping(&g.ns, IpAddr::V6(ECHO_V6)))))
            .collect();
        guests
            .iter()
            .zip(runs)
            .flat_map(|(g, run)| {
                let (gw, inet) = run.join().unwrap_or((false, false));
                [
                    check(
                        format!("{} ({:?}) → IPv6 gateway {}", g.id, g.policy, r.gateway)
                            .to_lowercase(),
                        passes(g.policy != NetworkPolicy::None),
                        passes(gw),
                    ),
                    check(
                        format!("{} ({:?}) → internet {ECHO_V6}", g.id, g.policy).to_lowercase(),
                        passes(g.policy == NetworkPolicy::Public),
                        passes(inet),
                    ),
                ]
            })
            .collect()
    });
    let public: Vec<&GuestInfo> = guests
        .iter()
        .filter(|g| g.policy == NetworkPolicy::Public)
        .collect();
    let (Some(a), Some(b)) = (public.first(), public.get(1)) else {
        return out;
    };
    let v6 = |g: &GuestInfo| g.ip6.map_or(IpAddr::V6(Ipv6Addr::UNSPECIFIED), IpAddr::V6);
    out.push(check(
        format!("{} → {} over IPv6", a.id, b.id),
        "passes",
        passes(b.ip6.is_some() && ping(&a.ns, v6(b))),
    ));
    for none in guests.iter().filter(|g| g.policy == NetworkPolicy::None) {
        if stop() {
            return out;
        }
        out.push(check(
            format!("{} → {} (none) over IPv6", a.id, none.id),
            "dropped",
            passes(none.ip6.is_some() && ping(&a.ns, v6(none))),
        ));
    }
    out
}

/// The IPv6 spoof frames from `a` towards `b` (both with IPv6 leases; `other` another guest's
/// lease, not `a`'s): an honest UDP frame and an honest ICMPv6 echo from `a`'s lease (the
/// controls), then a source in the range nobody leases, `other`'s lease as source, and a
/// router advertisement from `a`'s lease. Empty when `a` or `b` has no IPv6 lease.
pub(super) fn spoof_cases(
    a: &GuestInfo,
    b: &GuestInfo,
    other: Option<Ipv6Addr>,
) -> Vec<(&'static str, bool, Build)> {
    let (Some(a6), Some(b6), Some(other6)) = (a.ip6, b.ip6, other) else {
        return Vec::new();
    };
    let (am, bm) = (a.mac, b.mac);
    // Above every lease of the walk-through, inside the range's /64: leased to nobody.
    let foreign6 = Ipv6Addr::from(u128::from(b6).wrapping_add(0x100));
    let all_nodes = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);
    vec![
        (
            "honest IPv6 frame from its lease",
            true,
            Box::new(move |m| udp6_frame(bm, am, a6, b6, (4000, 4001), m)),
        ),
        (
            "foreign IPv6 source in the range",
            false,
            Box::new(move |m| udp6_frame(bm, am, foreign6, b6, (4000, 4001), m)),
        ),
        (
            "another guest's IPv6 lease as source",
            false,
            Box::new(move |m| udp6_frame(bm, am, other6, b6, (4000, 4001), m)),
        ),
        (
            "honest ICMPv6 echo from its lease",
            true,
            Box::new(move |m| icmp6_frame(bm, am, a6, b6, 128, m)),
        ),
        (
            "router advertisement from a guest's IPv6 lease",
            false,
            Box::new(move |m| icmp6_frame(ALL_NODES_MAC, am, a6, all_nodes, 134, m)),
        ),
    ]
}

/// The IPv6 lease of a guest other than `a` to forge: a third guest's, else `b`'s.
pub(super) fn other_lease(guests: &[GuestInfo], a: &GuestInfo, b: &GuestInfo) -> Option<Ipv6Addr> {
    guests
        .iter()
        .filter(|g| g.id != a.id && g.id != b.id)
        .find_map(|g| g.ip6)
        .or(b.ip6)
}
