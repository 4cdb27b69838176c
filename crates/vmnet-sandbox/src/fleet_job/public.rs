//! The public address checks across hosts: a VM reaches another host's VM at its public
//! addresses and is seen there with its own (the SNAT tests the connection's original
//! destination; the reply returns through both hosts' conntrack).
//!
//! | check | expected |
//! |---|---|
//! | `public <a> -> <b> ipv4` / `… ipv6` | `from <a's public address>`: TCP echo from `a`'s guest to `b`'s public IPv4 or /128, for VMs on different hosts |

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use vmnet_model::error::chain;

use super::checks::FleetCheck;
use crate::echo::EchoService;
use crate::guest::GUEST_V4;
use crate::sandbox::ECHO_PORT;
use crate::{SandboxError, traffic};

const TIMEOUT: Duration = Duration::from_secs(2);

/// A VM with public addresses and its simulated guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicGuest {
    /// The host's name.
    pub host: String,
    /// The VM id.
    pub vm: String,
    /// The guest's namespace.
    pub guest_ns: String,
    /// The VM's mesh address (where the /128 arrives).
    pub mesh: Ipv6Addr,
    /// The public IPv4.
    pub ipv4: Option<Ipv4Addr>,
    /// The mapped public IPv6.
    pub ipv6: Option<Ipv6Addr>,
}

/// One planned check: from guest `from` to `target`, expecting `expected`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicPlan {
    /// Index of the source guest.
    pub from: usize,
    /// The check's name.
    pub name: String,
    /// What it should see.
    pub expected: String,
    /// The target's public address and port.
    pub target: SocketAddr,
}

/// The checks between VMs on different hosts, in order.
#[must_use]
pub fn plan(guests: &[PublicGuest]) -> Vec<PublicPlan> {
    let mut out = Vec::new();
    for (i, a) in guests.iter().enumerate() {
        for b in guests.iter().filter(|b| b.host != a.host) {
            let pairs = [
                ("ipv4", a.ipv4.map(IpAddr::V4), b.ipv4.map(IpAddr::V4)),
                ("ipv6", a.ipv6.map(IpAddr::V6), b.ipv6.map(IpAddr::V6)),
            ];
            for (fam, src, dst) in pairs {
                if let (Some(src), Some(dst)) = (src, dst) {
                    out.push(PublicPlan {
                        from: i,
                        name: format!("public {} -> {} {fam}", a.vm, b.vm),
                        expected: format!("from {src}"),
                        target: SocketAddr::new(dst, ECHO_PORT),
                    });
                }
            }
        }
    }
    out
}

/// Runs [`plan`]: echo services on every guest's IPv4 and mesh address, then each check.
///
/// # Errors
/// When an echo service cannot start.
pub fn run(guests: &[PublicGuest]) -> Result<Vec<FleetCheck>, SandboxError> {
    let mut services = Vec::new();
    for g in guests {
        services.push(EchoService::start(
            &g.guest_ns,
            &[
                SocketAddr::new(IpAddr::V4(GUEST_V4), ECHO_PORT),
                SocketAddr::new(IpAddr::V6(g.mesh), ECHO_PORT),
            ],
        )?);
    }
    let mut out = Vec::new();
    for p in plan(guests) {
        let g = &guests[p.from];
        let seen = match traffic::try_tcp_echo(&g.guest_ns, p.target, TIMEOUT) {
            Ok(Some(r)) => format!("from {}", r.peer.ip()),
            Ok(None) => "no reach".into(),
            Err(e) => format!("error: {}", chain(&e)),
        };
        out.push(FleetCheck {
            host: g.host.clone(),
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

    fn g(host: &str, vm: &str, v4: Option<&str>, v6: Option<&str>) -> PublicGuest {
        PublicGuest {
            host: host.into(),
            vm: vm.into(),
            guest_ns: format!("g-{vm}"),
            mesh: "fdaa::1".parse().unwrap(),
            ipv4: v4.map(|a| a.parse().unwrap()),
            ipv6: v6.map(|a| a.parse().unwrap()),
        }
    }

    #[test]
    fn only_pairs_across_hosts_with_both_addresses() {
        let gs = [
            g("h1", "a", Some("203.0.113.70"), Some("2001:db8:1::70")),
            g("h1", "x", Some("203.0.113.71"), None),
            g("h2", "b", Some("203.0.113.85"), None),
        ];
        let names: Vec<(String, String)> = plan(&gs)
            .into_iter()
            .map(|p| (p.name, p.expected))
            .collect();
        assert_eq!(
            names,
            [
                (
                    "public a -> b ipv4".to_owned(),
                    "from 203.0.113.70".to_owned()
                ),
                ("public x -> b ipv4".into(), "from 203.0.113.71".into()),
                ("public b -> a ipv4".into(), "from 203.0.113.85".into()),
                ("public b -> x ipv4".into(), "from 203.0.113.85".into()),
            ]
        );
    }
}
