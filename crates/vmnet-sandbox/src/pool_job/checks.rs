//! The checks of the pool sandbox: placement against the spec's walk-through, each seed's
//! address, reachability by policy, the spoof attempts (each with an honest control frame so
//! "dropped" means dropped, not "the capture saw nothing"), and the drift gap: the ruleset
//! flushed, the same spoofs seen at the bridge (the tap guard alone), nothing reaching a guest,
//! then the audit's repair.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use crate::probe::{
    ALL_NODES_MAC, BROADCAST, Capture, arp_reply_frame, icmp4_frame, icmp6_frame, send_frame,
    udp4_frame, udp6_frame,
};
use crate::sandbox::ECHO_V4;
use serde::Serialize;
use vmnet_model::ErrorCode;
use vmnet_model::nic::{MacAddr, NetworkPolicy};
use vmnet_model::pool::{IpRange, PoolRange};

use super::checks6;

/// A simulated guest of the sandbox.
#[derive(Debug, Clone)]
pub struct GuestInfo {
    /// Instance id.
    pub id: String,
    /// Its namespace.
    pub ns: String,
    /// Its MAC.
    pub mac: MacAddr,
    /// Its lease.
    pub ip4: Ipv4Addr,
    /// Its IPv6 lease (a dual-stack pool).
    pub ip6: Option<Ipv6Addr>,
    /// Its policy.
    pub policy: NetworkPolicy,
    /// The addresses it configured from its seed.
    pub seed_addresses: Vec<String>,
    /// The default routes it configured from its seed, `(to, via)`.
    pub seed_routes: Vec<(String, String)>,
}

/// One check: what was expected and what was seen.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// What was tried.
    pub name: String,
    /// Expected outcome.
    pub expected: String,
    /// Seen outcome.
    pub seen: String,
    /// Whether they agree.
    pub ok: bool,
}

/// The checks as a table (CHECK, EXPECTED, SEEN, RESULT), one row each.
#[must_use]
pub fn table(checks: &[Check]) -> String {
    let rows: Vec<Vec<String>> = checks
        .iter()
        .map(|c| {
            vec![
                c.name.clone(),
                c.expected.clone(),
                c.seen.clone(),
                if c.ok { "ok" } else { "FAIL" }.into(),
            ]
        })
        .collect();
    vmnet_agent::table::render(&["CHECK", "EXPECTED", "SEEN", "RESULT"], &rows)
}

/// A check of `name` from what was expected and what was seen (`ok` when they are equal).
pub fn check(
    name: impl Into<String>,
    expected: impl Into<String>,
    seen: impl Into<String>,
) -> Check {
    let (expected, seen) = (expected.into(), seen.into());
    Check {
        name: name.into(),
        ok: expected == seen,
        expected,
        seen,
    }
}

/// Whether `up` was interrupted: the checks end early then.
pub(super) fn stop() -> bool {
    crate::state::stopping()
}

pub(super) fn passes(b: bool) -> &'static str {
    if b { "passes" } else { "dropped" }
}

pub(super) fn ping(ns: &str, to: IpAddr) -> bool {
    crate::traffic::ping(ns, to, 3, Duration::from_millis(400)).is_ok_and(|r| r.received > 0)
}

/// The n-th leasable address of `range` (lowest first, gateway skipped).
fn nth_leasable(range: &IpRange, n: usize) -> Option<Ipv4Addr> {
    let mut a = u32::from(range.first_host);
    let mut left = n;
    loop {
        let addr = Ipv4Addr::from(a);
        if addr > range.last_host {
            return None;
        }
        if addr != range.gateway {
            if left == 0 {
                return Some(addr);
            }
            left -= 1;
        }
        a = a.checked_add(1)?;
    }
}

/// What placing an instance gave: its IPv4 and IPv6 leases, or the error code.
pub type Placed = Result<(Ipv4Addr, Option<Ipv6Addr>), ErrorCode>;

/// Runs every check (blocking: pings and captures); `ranges` the first IPv4 range and, for a
/// dual-stack pool, the IPv6 range.
pub fn run(
    guests: &[GuestInfo],
    (range, range6): (&IpRange, Option<&PoolRange>),
    placement: &[(String, Placed)],
) -> Vec<Check> {
    let mut out = Vec::new();
    for (n, (id, got)) in placement.iter().enumerate() {
        let expected = nth_leasable(range, n)
            .map_or_else(|| "CAPACITY_UNAVAILABLE".to_owned(), |a| a.to_string());
        let seen = match got {
            Ok((a, _)) => a.to_string(),
            Err(c) => c.to_string(),
        };
        out.push(check(format!("placement {id}"), expected, seen));
    }
    if let Some(r6) = range6 {
        let placed: Vec<(&str, Option<Ipv6Addr>)> = placement
            .iter()
            .filter_map(|(id, got)| got.as_ref().ok().map(|(_, a6)| (id.as_str(), *a6)))
            .collect();
        out.extend(checks6::leases(r6, &placed));
    }
    let prefix = range.cidr.prefix_len();
    for g in guests {
        if stop() {
            return out;
        }
        let mut want = format!("{}/{prefix}", g.ip4);
        if let (Some(r6), Some(a6)) = (range6, g.ip6) {
            want.push_str(&format!(",{a6}/{}", r6.cidr.prefix_len()));
        }
        out.push(check(
            format!("seed of {} carries its lease", g.id),
            want,
            g.seed_addresses.join(","),
        ));
    }
    if let Some(r6) = range6 {
        out.extend(checks6::seed_routes(guests, IpAddr::V4(range.gateway), r6));
    }
    let gw = IpAddr::V4(range.gateway);
    for g in guests {
        if stop() {
            return out;
        }
        let exp = g.policy != NetworkPolicy::None;
        out.push(check(
            format!("{} ({:?}) → gateway", g.id, g.policy).to_lowercase(),
            passes(exp),
            passes(ping(&g.ns, gw)),
        ));
        let exp = g.policy == NetworkPolicy::Public;
        out.push(check(
            format!("{} ({:?}) → internet {ECHO_V4}", g.id, g.policy).to_lowercase(),
            passes(exp),
            passes(ping(&g.ns, IpAddr::V4(ECHO_V4))),
        ));
    }
    if let Some(r6) = range6 {
        out.extend(checks6::reach(guests, r6));
    }
    let public: Vec<&GuestInfo> = guests
        .iter()
        .filter(|g| g.policy == NetworkPolicy::Public)
        .collect();
    let (Some(a), Some(b)) = (public.first(), public.get(1)) else {
        return out;
    };
    out.push(check(
        format!("{} → {}", a.id, b.id),
        "passes",
        passes(ping(&a.ns, IpAddr::V4(b.ip4))),
    ));
    for none in guests.iter().filter(|g| g.policy == NetworkPolicy::None) {
        if stop() {
            return out;
        }
        out.push(check(
            format!("{} → {} (none)", a.id, none.id),
            "dropped",
            passes(ping(&a.ns, IpAddr::V4(none.ip4))),
        ));
    }
    let other6 = checks6::other_lease(guests, a, b);
    out.extend(spoofs((a, b, other6), (&b.ns, "eth0"), ""));
    out
}

/// What guests reach on the host (blocking): from the first public guest, to the gateway
/// address the host owns ICMP and DNS pass and another port does not; to the bridge's IPv6
/// link-local address nothing passes, while a frame to all-nodes does (the control); with an
/// IPv6 gateway `gateway6` (a dual-stack pool) ICMPv6 and DNS to it from the guest's IPv6
/// lease pass and another port does not. Looked for on the bridge in `host_ns`.
pub fn host_reach(
    guests: &[GuestInfo],
    host_ns: &str,
    bridge: &str,
    (gateway, gateway6): (Ipv4Addr, Option<IpAddr>),
) -> Vec<Check> {
    let Some(a) = guests.iter().find(|g| g.policy == NetworkPolicy::Public) else {
        return Vec::new();
    };
    let t = Duration::from_secs(10);
    let json = |args: &[&str]| {
        crate::netns::exec(host_ns, "ip", args, t)
            .ok()
            .and_then(|o| serde_json::from_slice::<serde_json::Value>(&o.stdout).ok())
    };
    let br_mac: Option<MacAddr> = json(&["-j", "link", "show", "dev", bridge])
        .and_then(|v| v[0]["address"].as_str().and_then(|m| m.parse().ok()));
    let br_ll: Option<Ipv6Addr> =
        // iproute2 prints the addresses the scope filter leaves out as `{}`: the first entry
        // with an address is the link-local one.
        json(&["-j", "-6", "addr", "show", "dev", bridge, "scope", "link"]).and_then(|v| {
            v[0]["addr_info"]
                .as_array()?
                .iter()
                .find_map(|a| a["local"].as_str().and_then(|a| a.parse().ok()))
        });
    let (Some(br_mac), Some(br_ll)) = (br_mac, br_ll) else {
        return vec![check(
            format!("{bridge}'s MAC and IPv6 link-local address"),
            "read",
            "not found",
        )];
    };
    let Ok(cap) = Capture::start(host_ns, bridge) else {
        return vec![check(format!("capture on {bridge}"), "started", "failed")];
    };
    let ll_a = a.mac.link_local_v6();
    let all_nodes = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);
    type Build = Box<dyn Fn(&[u8]) -> Vec<u8>>;
    let (am, a4) = (a.mac, a.ip4);
    let mut cases: Vec<(String, bool, Build)> = vec![
        (
            format!("gateway {gateway}: ICMP echo"),
            true,
            Box::new(move |m| icmp4_frame(br_mac, am, a4, gateway, 8, m)),
        ),
        (
            format!("gateway {gateway}: DNS (udp/53)"),
            true,
            Box::new(move |m| udp4_frame(br_mac, am, a4, gateway, (4000, 53), m)),
        ),
        (
            format!("gateway {gateway}: another port (udp/9999)"),
            false,
            Box::new(move |m| udp4_frame(br_mac, am, a4, gateway, (4000, 9999), m)),
        ),
        (
            "all-nodes ff02::1 (control)".to_owned(),
            true,
            Box::new(move |m| udp6_frame(ALL_NODES_MAC, am, ll_a, all_nodes, (4000, 4001), m)),
        ),
        (
            format!("the host's link-local {br_ll}"),
            false,
            Box::new(move |m| udp6_frame(br_mac, am, ll_a, br_ll, (4000, 4001), m)),
        ),
    ];
    if let (Some(IpAddr::V6(gw6)), Some(a6)) = (gateway6, a.ip6) {
        cases.push((
            format!("IPv6 gateway {gw6}: ICMPv6 echo"),
            true,
            Box::new(move |m| icmp6_frame(br_mac, am, a6, gw6, 128, m)),
        ));
        cases.push((
            format!("IPv6 gateway {gw6}: DNS (udp/53)"),
            true,
            Box::new(move |m| udp6_frame(br_mac, am, a6, gw6, (4000, 53), m)),
        ));
        cases.push((
            format!("IPv6 gateway {gw6}: another port (udp/9999)"),
            false,
            Box::new(move |m| udp6_frame(br_mac, am, a6, gw6, (4000, 9999), m)),
        ));
    }
    let tag = std::process::id();
    cases
        .iter()
        .enumerate()
        .take_while(|_| !stop())
        .map(|(i, (name, arrives, build))| {
            let marker = format!("vmnet-sbx-host-{tag}-{i}").into_bytes();
            let seen = if send_frame(&a.ns, "eth0", &build(&marker)).is_err() {
                "not sent"
            } else if cap.saw(&marker, Duration::from_millis(600)) {
                "arrives"
            } else {
                "dropped"
            };
            check(
                format!("{} → host: {name}", a.id),
                if *arrives { "arrives" } else { "dropped" },
                seen,
            )
        })
        .collect()
}

/// The host side of the drift-gap checks.
pub struct GapHost<'a> {
    /// The sandbox host namespace.
    pub ns: &'a str,
    /// The bridge.
    pub bridge: &'a str,
    /// Called before the flush: holds the audit off (the agent is stopped) so the gap lasts
    /// until [`Self::audit`].
    pub hold_audit: &'a mut dyn FnMut() -> Result<(), String>,
    /// Lets the audit run again and waits for it; `Ok(true)` when it found the drift and
    /// repaired it within one audit period.
    pub audit: &'a mut dyn FnMut() -> Result<bool, String>,
}

/// The drift gap (blocking): holds the audit off, flushes the sandbox host's ruleset, sends the
/// spoof suite from the first public guest and looks for it on the bridge (promiscuous, so it
/// sees what passed the tap's ingress: the tap guard alone filters now), checks that nothing
/// reaches a guest, then lets the audit run and checks that it repaired the tables and that
/// traffic flows again.
pub fn gap(guests: &[GuestInfo], host: &mut GapHost<'_>) -> Vec<Check> {
    let public: Vec<&GuestInfo> = guests
        .iter()
        .filter(|g| g.policy == NetworkPolicy::Public)
        .collect();
    let (Some(a), Some(b)) = (public.first(), public.get(1)) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    if stop() {
        return out;
    }
    if let Err(e) = (host.hold_audit)() {
        out.push(check("gap: hold the audit off", "held", e));
        return out;
    }
    let t = Duration::from_secs(10);
    let flushed = crate::netns::exec(host.ns, "nft", &["flush", "ruleset"], t)
        .is_ok_and(|o| o.status.success());
    let tables = crate::netns::exec(host.ns, "nft", &["list", "tables"], t)
        .map(|o| String::from_utf8_lossy(&o.stdout).lines().count())
        .unwrap_or(usize::MAX);
    out.push(check(
        "gap: someone runs nft flush ruleset",
        "0 tables left",
        if flushed {
            format!("{tables} tables left")
        } else {
            "flush failed".to_owned()
        },
    ));
    let promisc = crate::netns::ip(host.ns, &["link", "set", host.bridge, "promisc", "on"]);
    if promisc.is_ok() {
        let other6 = checks6::other_lease(guests, a, b);
        out.extend(spoofs(
            (a, b, other6),
            (host.ns, host.bridge),
            "gap, at the bridge: ",
        ));
    }
    out.push(check(
        format!("gap: {} → {} (nothing reaches a guest)", a.id, b.id),
        "dropped",
        passes(ping(&a.ns, IpAddr::V4(b.ip4))),
    ));
    // Always let the audit run again (an interrupted run too: it then returns at once).
    let repaired = match (host.audit)() {
        Ok(true) => "repaired".to_owned(),
        Ok(false) => "no drift found".to_owned(),
        Err(e) => e,
    };
    out.push(check(
        "gap: the audit, running again, within one period",
        "repaired",
        repaired,
    ));
    out.push(check(
        format!("after the repair: {} → {}", a.id, b.id),
        "passes",
        passes(ping(&a.ns, IpAddr::V4(b.ip4))),
    ));
    out
}

/// The spoof suite from `a` towards `b`, looked for on `at` (namespace, interface); `label`
/// prefixes the check names. With IPv6 leases the IPv6 cases of [`checks6::spoof_cases`]
/// follow (`other6` the lease of a guest other than `a`).
fn spoofs(
    (a, b, other6): (&GuestInfo, &GuestInfo, Option<Ipv6Addr>),
    at: (&str, &str),
    label: &str,
) -> Vec<Check> {
    let Ok(cap) = Capture::start(at.0, at.1) else {
        return vec![check(
            format!("{label}capture on {}", at.1),
            "started",
            "failed",
        )];
    };
    let wait = Duration::from_millis(600);
    let tag = std::process::id();
    let foreign_mac = MacAddr([0x02, 0xde, 0xad, 0xbe, 0xef, 0x01]);
    let (ll_a, ll_b) = (a.mac.link_local_v6(), b.mac.link_local_v6());
    let all_nodes: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);
    let foreign4 = Ipv4Addr::from(u32::from(b.ip4).wrapping_add(100));
    let (am, bm, a4, b4) = (a.mac, b.mac, a.ip4, b.ip4);
    let mut cases: Vec<(&str, bool, checks6::Build)> = vec![
        (
            "honest IPv4 frame",
            true,
            Box::new(move |m| udp4_frame(bm, am, a4, b4, (4000, 4001), m)),
        ),
        (
            "foreign source MAC",
            false,
            Box::new(move |m| udp4_frame(bm, foreign_mac, a4, b4, (4000, 4001), m)),
        ),
        (
            "foreign IPv4 source",
            false,
            Box::new(move |m| udp4_frame(bm, am, foreign4, b4, (4000, 4001), m)),
        ),
        (
            "honest IPv6 link-local frame",
            true,
            Box::new(move |m| udp6_frame(bm, am, ll_a, ll_b, (4000, 4001), m)),
        ),
        (
            "foreign IPv6 source",
            false,
            Box::new(move |m| {
                udp6_frame(
                    bm,
                    am,
                    Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0xbad, 1),
                    ll_b,
                    (4000, 4001),
                    m,
                )
            }),
        ),
        (
            "honest ARP reply",
            true,
            Box::new(move |m| arp_reply_frame(bm, am, (am, a4), (bm, b4), m)),
        ),
        (
            "forged ARP reply (claims peer's address)",
            false,
            Box::new(move |m| arp_reply_frame(bm, am, (am, b4), (bm, b4), m)),
        ),
        (
            "DHCP offer from a guest",
            false,
            Box::new(move |m| udp4_frame(BROADCAST, am, a4, Ipv4Addr::BROADCAST, (67, 68), m)),
        ),
        (
            "router advertisement from a guest",
            false,
            Box::new(move |m| icmp6_frame(ALL_NODES_MAC, am, ll_a, all_nodes, 134, m)),
        ),
    ];
    cases.extend(checks6::spoof_cases(a, b, other6));
    // Every frame is sent first, then each is looked for until one shared deadline `wait`
    // after the last send: each frame gets at least `wait`, and the suite costs one wait, not
    // one per dropped frame.
    // Fixed width, so no marker is a prefix of another (`-1` of `-12`).
    let marker = |i: usize| format!("vmnet-sbx-{tag}-{label}{i:03}").into_bytes();
    let sent: Vec<bool> = cases
        .iter()
        .enumerate()
        .take_while(|_| !stop())
        .map(|(i, (_, _, build))| send_frame(&a.ns, "eth0", &build(&marker(i))).is_ok())
        .collect();
    let deadline = std::time::Instant::now() + wait;
    cases
        .iter()
        .zip(sent)
        .enumerate()
        .map(|(i, ((name, arrives, _), sent))| {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let seen = if !sent {
                "not sent"
            } else if cap.saw(&marker(i), left) {
                "arrives"
            } else {
                "dropped"
            };
            check(
                format!("{label}{} → {}: {name}", a.id, b.id),
                if *arrives { "arrives" } else { "dropped" },
                seen,
            )
        })
        .collect()
}

/// After every instance was deleted through the API: the `bc*` links and the per-tap elements
/// of the sets and maps of `bridge bcd_instances` left in the sandbox host (expected none).
pub fn left_behind(host_ns: &str) -> Check {
    let t = Duration::from_secs(10);
    let taps = crate::netns::exec(host_ns, "ip", &["-j", "link", "show"], t)
        .ok()
        .and_then(|o| serde_json::from_slice::<serde_json::Value>(&o.stdout).ok())
        .and_then(|v| v.as_array().cloned())
        .map(|links| {
            links
                .iter()
                .filter(|l| l["ifname"].as_str().is_some_and(|n| n.starts_with("bc")))
                .count()
        });
    let elements = crate::netns::exec(host_ns, "nft", &["-j", "list", "ruleset"], t)
        .ok()
        .and_then(|o| serde_json::from_slice::<serde_json::Value>(&o.stdout).ok())
        .map(|v| {
            v["nftables"].as_array().map_or(0, |objs| {
                objs.iter()
                    .filter_map(|o| o.get("set").or_else(|| o.get("map")))
                    .filter(|s| {
                        s["table"] == "bcd_instances"
                            && s["name"]
                                .as_str()
                                .is_some_and(|n| vmnet_plan::pool::nft::TAP_SETS.contains(&n))
                    })
                    .map(|s| s["elem"].as_array().map_or(0, Vec::len))
                    .sum::<usize>()
            })
        });
    let seen = match (taps, elements) {
        (Some(t), Some(e)) => format!("{t} taps, {e} elements"),
        _ => "could not list".to_owned(),
    };
    check(
        "teardown: instances deleted through the API",
        "0 taps, 0 elements",
        seen,
    )
}
