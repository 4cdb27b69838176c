//! The checks across the hosts of a fleet sandbox: which checks a fleet calls for and what each
//! should see (pure, unit-tested), and running them from the host namespaces with real packets.
//!
//! Per host `h` (TCP echo services run on every host's private addresses, port 7, for the
//! duration of the checks):
//!
//! | check | expected |
//! |---|---|
//! | `internet ipv4` / `internet ipv6` | `from <h's uplink address>`: TCP echo to the fake internet's echo service |
//! | `private ipv4 -> <k>` / `private ipv6 -> <k>` | `from <h's private address>`: TCP echo to host `k`'s private address, for every other host `k` |
//! | `private mtu` | `1500` on `h`'s leg of the private network |
//! | `public <block>` (IPv4 and IPv6) | the fake internet's route to `h`'s public block: `via <h's uplink address>` (routed) or `on-link <uplink>` (proxy) |

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use serde::Serialize;
use vmnet_model::error::chain;

use crate::echo::EchoService;
use crate::fleet::{HostNet, PRIVATE_IF, PRIVATE_MTU, PublicNeighbors};
use crate::sandbox::{ECHO_PORT, ECHO_V4, ECHO_V6};
use crate::{SandboxError, netns, traffic};

const TIMEOUT: Duration = Duration::from_secs(2);

/// How a check runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// TCP echo from the host's namespace; seen: `from <ip>` or `no reach`.
    Tcp(SocketAddr),
    /// The fake internet's route to a prefix; seen: `via <ip>`, `on-link <dev>` or `no route`.
    InetRoute(String),
    /// The MTU of the host's private leg; seen: the number.
    PrivateMtu,
}

/// One planned check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Index of the host (into the list given to [`plan`]) that runs it.
    pub host: usize,
    /// The check's name.
    pub name: String,
    /// What it should see.
    pub expected: String,
    /// How it runs.
    pub probe: Probe,
}

/// One check's outcome.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FleetCheck {
    /// The host's name.
    pub host: String,
    /// The check.
    pub check: String,
    /// What it should see.
    pub expected: String,
    /// What it saw.
    pub seen: String,
    /// Whether they agree.
    pub ok: bool,
}

fn from(ip: impl Into<IpAddr>) -> String {
    format!("from {}", ip.into())
}

/// The checks for `hosts` (`(name, network)`, host 1 first), in table order.
#[must_use]
pub fn plan(hosts: &[(String, HostNet)]) -> Vec<Plan> {
    let mut out = Vec::new();
    for (i, (_, h)) in hosts.iter().enumerate() {
        let mut add = |name: String, expected: String, probe: Probe| {
            out.push(Plan {
                host: i,
                name,
                expected,
                probe,
            });
        };
        let echo4 = SocketAddr::new(IpAddr::V4(ECHO_V4), ECHO_PORT);
        let echo6 = SocketAddr::new(IpAddr::V6(ECHO_V6), ECHO_PORT);
        add("internet ipv4".into(), from(h.uplink_v4), Probe::Tcp(echo4));
        add("internet ipv6".into(), from(h.uplink_v6), Probe::Tcp(echo6));
        for (kname, k) in hosts.iter().filter(|(_, k)| k.index != h.index) {
            let t4 = SocketAddr::new(IpAddr::V4(k.private_v4), ECHO_PORT);
            let t6 = SocketAddr::new(IpAddr::V6(k.private_v6), ECHO_PORT);
            add(
                format!("private ipv4 -> {kname}"),
                from(h.private_v4),
                Probe::Tcp(t4),
            );
            add(
                format!("private ipv6 -> {kname}"),
                from(h.private_v6),
                Probe::Tcp(t6),
            );
        }
        add(
            "private mtu".into(),
            PRIVATE_MTU.to_string(),
            Probe::PrivateMtu,
        );
        let (via4, via6) = match h.public_neighbors {
            PublicNeighbors::Routed => (
                format!("via {}", h.uplink_v4),
                format!("via {}", h.uplink_v6),
            ),
            PublicNeighbors::Proxy => (
                format!("on-link {}", h.inet_if),
                format!("on-link {}", h.inet_if),
            ),
        };
        let (b4, b6) = (h.public_v4.to_string(), h.public_v6.to_string());
        add(format!("public {b4}"), via4, Probe::InetRoute(b4));
        add(format!("public {b6}"), via6, Probe::InetRoute(b6));
    }
    out
}

/// What `ip route show <dst>` says about the next hop: `via <ip>`, `on-link <dev>` or
/// `no route`.
#[must_use]
pub fn route_seen(text: &str) -> String {
    let Some(line) = text.lines().find(|l| !l.trim().is_empty()) else {
        return "no route".into();
    };
    let words: Vec<&str> = line.split_whitespace().collect();
    let after = |key: &str| {
        words
            .iter()
            .position(|w| *w == key)
            .and_then(|p| words.get(p + 1))
    };
    match (after("via"), after("dev")) {
        (Some(via), _) => format!("via {via}"),
        (None, Some(dev)) => format!("on-link {dev}"),
        (None, None) => format!("unexpected: {line}"),
    }
}

fn seen_tcp(ns: &str, target: SocketAddr) -> String {
    match traffic::try_tcp_echo(ns, target, TIMEOUT) {
        Ok(Some(r)) => from(r.peer.ip()),
        Ok(None) => "no reach".into(),
        Err(e) => format!("error: {}", chain(&e)),
    }
}

fn seen_route(inet: &str, dst: &str) -> String {
    let family = if dst.contains(':') { "-6" } else { "-4" };
    match netns::ip(inet, &[family, "route", "show", dst]) {
        Ok(text) => route_seen(&text),
        Err(e) => format!("error: {}", chain(&e)),
    }
}

fn seen_mtu(ns: &str) -> String {
    match netns::ip(ns, &["link", "show", "dev", PRIVATE_IF]) {
        Ok(text) => text
            .split_whitespace()
            .skip_while(|w| *w != "mtu")
            .nth(1)
            .map_or_else(|| "no mtu".into(), str::to_owned),
        Err(e) => format!("error: {}", chain(&e)),
    }
}

/// Runs the checks of [`plan`]: starts a TCP/UDP echo service on each host's private
/// addresses, then runs each check from its host; the fake internet `inet` must be running its
/// echo service. Stops early (the remaining checks are not run) once `up` is interrupted.
///
/// # Errors
/// When an echo service cannot be started.
pub fn run(inet: &str, hosts: &[(String, HostNet)]) -> Result<Vec<FleetCheck>, SandboxError> {
    let mut services = Vec::new();
    for (_, h) in hosts {
        services.push(EchoService::start(
            &h.ns,
            &[
                SocketAddr::new(IpAddr::V4(h.private_v4), ECHO_PORT),
                SocketAddr::new(IpAddr::V6(h.private_v6), ECHO_PORT),
            ],
        )?);
    }
    let mut out = Vec::new();
    for p in plan(hosts) {
        if crate::state::stopping() {
            break;
        }
        let (name, h) = &hosts[p.host];
        let seen = match &p.probe {
            Probe::Tcp(t) => seen_tcp(&h.ns, *t),
            Probe::InetRoute(dst) => seen_route(inet, dst),
            Probe::PrivateMtu => seen_mtu(&h.ns),
        };
        out.push(FleetCheck {
            host: name.clone(),
            check: p.name,
            ok: seen == p.expected,
            expected: p.expected,
            seen,
        });
    }
    drop(services);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::host_net;

    fn hosts() -> Vec<(String, HostNet)> {
        vec![
            ("a".into(), host_net("fq", 1, PublicNeighbors::Routed)),
            ("b".into(), host_net("fq", 2, PublicNeighbors::Proxy)),
            ("c".into(), host_net("fq", 3, PublicNeighbors::Routed)),
        ]
    }

    fn find<'a>(plans: &'a [Plan], host: usize, name: &str) -> &'a Plan {
        plans
            .iter()
            .find(|p| p.host == host && p.name == name)
            .unwrap_or_else(|| panic!("no check {name} on host {host}: {plans:#?}"))
    }

    #[test]
    fn every_host_reaches_the_internet_and_every_other_host() {
        let plans = plan(&hosts());
        // Per host: 2 internet, 2 per other host, mtu, 2 public routes.
        assert_eq!(plans.len(), 3 * (2 + 2 * 2 + 1 + 2));
        let p = find(&plans, 0, "internet ipv4");
        assert_eq!(p.expected, "from 192.0.2.10");
        assert_eq!(p.probe, Probe::Tcp("198.51.100.10:7".parse().unwrap()));
        assert_eq!(
            find(&plans, 1, "internet ipv6").expected,
            "from 2001:db8:0:2::2"
        );
        let p = find(&plans, 0, "private ipv4 -> c");
        assert_eq!(p.expected, "from 10.10.0.1");
        assert_eq!(p.probe, Probe::Tcp("10.10.0.3:7".parse().unwrap()));
        let p = find(&plans, 2, "private ipv6 -> b");
        assert_eq!(p.expected, "from fd00:10::3");
        assert_eq!(p.probe, Probe::Tcp("[fd00:10::2]:7".parse().unwrap()));
        assert!(
            !plans
                .iter()
                .any(|p| p.host == 0 && p.name.ends_with("-> a"))
        );
        assert_eq!(find(&plans, 1, "private mtu").expected, "1500");
    }

    #[test]
    fn public_blocks_are_routed_or_on_link() {
        let plans = plan(&hosts());
        assert_eq!(
            find(&plans, 0, "public 203.0.113.64/28").expected,
            "via 192.0.2.10"
        );
        assert_eq!(
            find(&plans, 0, "public 2001:db8:1::/48").expected,
            "via 2001:db8:0:1::2"
        );
        assert_eq!(
            find(&plans, 1, "public 203.0.113.80/28").expected,
            "on-link up2"
        );
        assert_eq!(
            find(&plans, 1, "public 2001:db8:2::/48").expected,
            "on-link up2"
        );
    }

    #[test]
    fn route_lines_are_read_by_next_hop() {
        assert_eq!(
            route_seen("203.0.113.64/28 via 192.0.2.10 dev up1 \n"),
            "via 192.0.2.10"
        );
        assert_eq!(
            route_seen("2001:db8:2::/48 dev up2 metric 1024 pref medium\n"),
            "on-link up2"
        );
        assert_eq!(route_seen(""), "no route");
        assert_eq!(
            route_seen("blackhole 10.0.0.0/8"),
            "unexpected: blackhole 10.0.0.0/8"
        );
    }
}
