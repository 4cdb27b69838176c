//! The connectivity checks of `vmnet-lab up --sandbox`: which checks a set of VMs calls for and what
//! each should see (pure, unit-tested), running them from the simulated guests, and the tables.
//!
//! Per VM (guest `g`), with the fake internet's echo service at 198.51.100.10 / 2001:db8:100::10:
//!
//! | check | expected |
//! |---|---|
//! | `ipv4 tcp echo` / `ipv4 udp echo` | `from <uplink>` (NAT to the host's uplink address, 203.0.113.2 in a single-host sandbox) with an IPv4 route via `host`, else `no reach` |
//! | `ipv4 mss clamp` | `syn mss 1340`: the guest advertises 1460 (a route with `advmss 1460`) and the VM namespace clamps it to the 1380 path |
//! | `ipv6 tcp echo` | `from <mesh>` with an IPv6 route via `host`, `no reach` without any route; skipped when a gateway VM carries it |
//! | `ipv6 mss clamp` | `syn mss 1320` (advertised 1440) with an IPv6 route via `host` |
//! | `mesh → <w>` | `from <mesh>`: TCP to the echo service on guest `w`'s mesh address |
//! | `gateway <dst> via <w>` | `at <w> from <mesh>, reply from <probe>`: UDP to a probe address inside `dst`, which gateway guest `w` owns, arrives there, and the echo's reply, from that internet address to the mesh address, arrives back through the gateway VM (whose guest guard lets a gateway VM forward replies from outside the mesh) |
//! | `nat rule` | `snat` in the VM namespace's nft table with an IPv4 route via `host`, else `none` |
//! | `veth mtu` | `1380` on the host end of the veth pair |
//!
//! A VM without a mesh address has no veth pair, so every check of it expects `no reach`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use super::probes;
use crate::echo::EchoService;
use crate::sandbox::{ECHO_PORT, ECHO_V4, ECHO_V6};
use crate::{SandboxError, netns, traffic};
use ipnet::IpNet;
use serde::Serialize;
use vmnet_agent::table::render as render_table;
use vmnet_model::vm::{Route, Via};

/// The guest's IPv6 gateway: the link-local address on every tap.
pub const GUEST_GW_V6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);
/// The preferred probe address for gateway routes (used when the destination contains it).
pub const PROBE_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 1);
/// What a check that must not connect expects.
pub const NO_REACH: &str = "no reach";

pub(super) const TIMEOUT: Duration = Duration::from_secs(2);

/// What the checks need to know about one VM and its simulated guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestInfo {
    /// The VM id.
    pub vm: String,
    /// The simulated guest's namespace.
    pub guest_ns: String,
    /// The mesh address, if any.
    pub mesh: Option<Ipv6Addr>,
    /// The VM's routes.
    pub routes: Vec<Route>,
    /// What the fake internet sees as the source of the guest's IPv4 after NAT: its host's
    /// uplink address.
    pub uplink_v4: Ipv4Addr,
    /// Kernel object names for the state checks (`nat rule`, `veth mtu`); `None` skips them.
    pub kernel: Option<KernelNames>,
    /// The public address checks ([`super::public`]); `None` without public addresses.
    pub public: Option<super::public::PublicCheck>,
}

/// Where a VM's kernel objects are, for the checks that read kernel state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelNames {
    /// The host namespace (the sandbox host).
    pub host_ns: String,
    /// The VM's namespace.
    pub vm_ns: String,
    /// The host end of the veth pair, if any.
    pub veth_host: Option<String>,
    /// The nft table (family inet) in the VM namespace.
    pub nft_table: String,
}

/// How a check is carried out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// TCP echo to `target`; seen: `from <ip>` or `no reach`.
    Tcp(SocketAddr),
    /// UDP echo to `target`; seen: `from <ip>` or `no reach`.
    Udp(SocketAddr),
    /// TCP echo to `target` after the guest routes it with `advmss`; seen: `syn mss <n>`.
    Mss {
        /// The echo service.
        target: SocketAddr,
        /// The MSS the guest advertises.
        advmss: u16,
    },
    /// UDP to `target`, owned by gateway guest `gateway` (index into the VM list); seen:
    /// `at <vm> from <ip>` when the gateway's guest received it, then `, reply from <ip>` when
    /// its echo came back (`, no reply` when not), else `no reach`.
    Gateway {
        /// The probe address and port.
        target: SocketAddr,
        /// Index of the gateway VM.
        gateway: usize,
    },
    /// Reads the VM namespace's nft table; seen: `snat` when it has an SNAT rule, else `none`.
    NatRule,
    /// Reads the host veth's MTU; seen: the number.
    VethMtu,
    /// TCP echo from the fake internet to `target`; seen: `from <ip>` or `no reach`.
    InetTcp(SocketAddr),
    /// UDP echo from the fake internet to `target`; seen: `from <ip>` or `no reach`.
    InetUdp(SocketAddr),
}

/// One planned check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckPlan {
    /// Index of the VM whose guest runs it.
    pub vm: usize,
    /// Its name in the table.
    pub name: String,
    /// What it should see.
    pub expected: String,
    /// How it runs.
    pub probe: Probe,
}

/// One check's outcome.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CheckResult {
    /// The VM id.
    pub vm: String,
    /// The check.
    pub check: String,
    /// What it should see.
    pub expected: String,
    /// What it saw.
    pub seen: String,
    /// Whether they agree.
    pub ok: bool,
}

impl CheckResult {
    /// The check `check` of VM `vm`: ok when `seen` is `expected`.
    #[must_use]
    pub fn new(vm: &str, check: &str, expected: String, seen: String) -> Self {
        Self {
            vm: vm.to_owned(),
            check: check.to_owned(),
            ok: seen == expected,
            expected,
            seen,
        }
    }
}

/// The route of `routes` that carries `dst` (longest prefix wins), if any.
#[must_use]
pub fn route_for(routes: &[Route], dst: IpAddr) -> Option<&Route> {
    routes
        .iter()
        .filter(|r| r.destination.contains(&dst))
        .max_by_key(|r| r.destination.prefix_len())
}

/// An address inside `dst` for a gateway probe: [`PROBE_V6`] if `dst` holds it, else the
/// network address + 1.
#[must_use]
pub fn probe_in(dst: &IpNet) -> Option<Ipv6Addr> {
    let IpNet::V6(net) = dst else { return None };
    if net.contains(&PROBE_V6) {
        return Some(PROBE_V6);
    }
    Some(Ipv6Addr::from(u128::from(net.network()).wrapping_add(1)))
}

pub(super) fn from(ip: impl Into<IpAddr>) -> String {
    format!("from {}", ip.into())
}

/// The checks for `vms`, in table order, and the probe addresses each gateway guest must own
/// (`(vm index, address)`).
#[must_use]
pub fn plan_checks(vms: &[GuestInfo]) -> (Vec<CheckPlan>, Vec<(usize, Ipv6Addr)>) {
    let echo4 = SocketAddr::new(IpAddr::V4(ECHO_V4), ECHO_PORT);
    let echo6 = SocketAddr::new(IpAddr::V6(ECHO_V6), ECHO_PORT);
    let mut out = Vec::new();
    let mut probes = Vec::new();
    for (i, v) in vms.iter().enumerate() {
        let mut add = |name: String, expected: String, probe: Probe| {
            out.push(CheckPlan {
                vm: i,
                name,
                expected,
                probe,
            });
        };
        let connected = v.mesh.is_some();
        let via4 = route_for(&v.routes, echo4.ip())
            .map(|r| &r.via)
            .filter(|_| connected);
        let reach4 = via4 == Some(&Via::Host);
        let public = v.public.as_ref();
        let exp4 = if reach4 {
            from(public.and_then(|p| p.ipv4).unwrap_or(v.uplink_v4))
        } else {
            NO_REACH.into()
        };
        if v.kernel.is_some() {
            let nat = if reach4 { "snat" } else { "none" };
            add("nat rule".into(), nat.into(), Probe::NatRule);
            if connected {
                add("veth mtu".into(), "1380".into(), Probe::VethMtu);
            }
        }
        add("ipv4 tcp echo".into(), exp4.clone(), Probe::Tcp(echo4));
        add("ipv4 udp echo".into(), exp4, Probe::Udp(echo4));
        if reach4 {
            add(
                "ipv4 mss clamp".into(),
                "syn mss 1340".into(),
                Probe::Mss {
                    target: echo4,
                    advmss: 1460,
                },
            );
        }
        let via6 = route_for(&v.routes, echo6.ip())
            .map(|r| &r.via)
            .filter(|_| connected);
        match (via6, v.mesh) {
            (Some(Via::Host), Some(mesh)) => {
                let src = public.and_then(|p| p.ipv6).unwrap_or(mesh);
                add("ipv6 tcp echo".into(), from(src), Probe::Tcp(echo6));
                add(
                    "ipv6 mss clamp".into(),
                    "syn mss 1320".into(),
                    Probe::Mss {
                        target: echo6,
                        advmss: 1440,
                    },
                );
            }
            (Some(Via::Mesh(_)), _) => {}
            _ => add("ipv6 tcp echo".into(), NO_REACH.into(), Probe::Tcp(echo6)),
        }
        for p in super::public::plan(i, v) {
            add(p.name, p.expected, p.probe);
        }
        let Some(mesh) = v.mesh else { continue };
        for (j, w) in vms.iter().enumerate() {
            if let (true, Some(wm)) = (i != j, w.mesh) {
                add(
                    format!("mesh -> {}", w.vm),
                    from(mesh),
                    Probe::Tcp(SocketAddr::new(IpAddr::V6(wm), ECHO_PORT)),
                );
            }
        }
        for r in &v.routes {
            let Via::Mesh(gw) = r.via else { continue };
            let Some(j) = vms.iter().position(|w| w.mesh == Some(gw)) else {
                continue;
            };
            let Some(addr) = probe_in(&r.destination) else {
                continue;
            };
            probes.push((j, addr));
            add(
                format!("gateway {} via {}", r.destination, vms[j].vm),
                format!("at {} {}, reply {}", vms[j].vm, from(mesh), from(addr)),
                Probe::Gateway {
                    target: SocketAddr::new(IpAddr::V6(addr), ECHO_PORT),
                    gateway: j,
                },
            );
        }
    }
    (out, probes)
}

/// Runs the planned checks from the guests: starts echo services on each guest's mesh address
/// and the gateway probes (which the gateway guests get on `lo`), then runs each check.
///
/// # Errors
/// When a guest's echo service or probe address cannot be set up.
pub fn run_checks(vms: &[GuestInfo]) -> Result<Vec<CheckResult>, SandboxError> {
    let (plans, probes) = plan_checks(vms);
    let mut services: Vec<Option<EchoService>> = Vec::new();
    for (i, v) in vms.iter().enumerate() {
        let mut addrs: Vec<SocketAddr> = v
            .mesh
            .iter()
            .map(|m| SocketAddr::new(IpAddr::V6(*m), ECHO_PORT))
            .collect();
        for (_, addr) in probes.iter().filter(|(j, _)| *j == i) {
            let cidr = format!("{addr}/128");
            netns::ip(
                &v.guest_ns,
                &["-6", "addr", "replace", &cidr, "dev", "lo", "nodad"],
            )?;
            addrs.push(SocketAddr::new(IpAddr::V6(*addr), ECHO_PORT));
        }
        addrs.extend(super::public::echo_addrs(v));
        addrs.dedup();
        services.push(if addrs.is_empty() {
            None
        } else {
            Some(EchoService::start(&v.guest_ns, &addrs)?)
        });
    }
    let mut results = Vec::new();
    for p in plans {
        let v = &vms[p.vm];
        let seen = match p.probe {
            Probe::Tcp(t) => {
                // On a loaded machine a path through a gateway VM's guest can take a few
                // seconds to settle (neighbour discovery, IPv6 address set-up): up to two
                // more tries where a reply is expected, none where silence is.
                let mut r = traffic::try_tcp_echo(&v.guest_ns, t, TIMEOUT);
                for _ in 0..2 {
                    if !(matches!(r, Ok(None)) && p.expected != NO_REACH) {
                        break;
                    }
                    r = traffic::try_tcp_echo(&v.guest_ns, t, TIMEOUT);
                }
                probes::seen_reply(r)
            }
            Probe::Udp(t) => probes::seen_reply(traffic::try_udp_echo(&v.guest_ns, t, TIMEOUT)),
            Probe::InetTcp(_) | Probe::InetUdp(_) | Probe::NatRule | Probe::VethMtu => {
                probes::run_host_probe(v, &p.probe)
            }
            Probe::Mss { target, advmss } => probes::run_mss(&v.guest_ns, target, advmss),
            Probe::Gateway { target, gateway } => {
                let reply = traffic::try_udp_echo(&v.guest_ns, target, TIMEOUT);
                let log = services[gateway]
                    .as_ref()
                    .map(EchoService::seen)
                    .unwrap_or_default();
                // The client's socket is connected to `target`: a reply it gets came from
                // there (the probe address, outside the mesh, through the gateway VM).
                let reply = match reply {
                    Ok(Some(_)) => format!("reply {}", from(target.ip())),
                    Ok(None) => "no reply".into(),
                    Err(e) => format!("reply error: {e}"),
                };
                log.iter()
                    .rev()
                    .find(|s| !s.tcp && s.local == target)
                    .map_or_else(
                        || NO_REACH.into(),
                        |s| format!("at {} {}, {reply}", vms[gateway].vm, from(s.peer.ip())),
                    )
            }
        };
        results.push(CheckResult {
            vm: v.vm.clone(),
            check: p.name,
            ok: seen == p.expected,
            expected: p.expected,
            seen,
        });
    }
    Ok(results)
}

/// The checks table.
#[must_use]
pub fn render_checks(results: &[CheckResult]) -> String {
    let rows: Vec<Vec<String>> = results
        .iter()
        .map(|r| {
            vec![
                r.vm.clone(),
                r.check.clone(),
                r.expected.clone(),
                r.seen.clone(),
                if r.ok { "ok" } else { "FAIL" }.into(),
            ]
        })
        .collect();
    render_table(&["VM", "CHECK", "EXPECTED", "SEEN", "RESULT"], &rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(d: &str, via: &str) -> Route {
        Route {
            destination: d.parse().expect("prefix"),
            via: via.parse().expect("via"),
        }
    }

    fn vm(id: &str, mesh: Option<&str>, routes: Vec<Route>) -> GuestInfo {
        GuestInfo {
            vm: id.into(),
            guest_ns: format!("g-{id}"),
            mesh: mesh.map(|m| m.parse().expect("mesh")),
            routes,
            uplink_v4: crate::sandbox::HOST_UPLINK_V4,
            kernel: Some(KernelNames {
                host_ns: "h".into(),
                vm_ns: format!("n-{id}"),
                veth_host: mesh.map(|_| format!("v-{id}")),
                nft_table: "p".into(),
            }),
            public: None,
        }
    }

    fn sample() -> Vec<GuestInfo> {
        vec![
            vm(
                "vm-a",
                Some("fdaa:1::a"),
                vec![route("0.0.0.0/0", "host"), route("::/0", "host")],
            ),
            vm("vm-b", Some("fdaa:1::b"), vec![]),
            vm(
                "vm-c",
                Some("fdaa:1::c"),
                vec![route("2000::/3", "fdaa:1::a")],
            ),
        ]
    }

    fn find<'a>(plans: &'a [CheckPlan], vm: usize, name: &str) -> Option<&'a CheckPlan> {
        plans.iter().find(|p| p.vm == vm && p.name == name)
    }

    #[test]
    fn host_routes_expect_nat_and_clamp() {
        let (plans, _) = plan_checks(&sample());
        assert_eq!(
            find(&plans, 0, "ipv4 tcp echo").expect("check").expected,
            "from 203.0.113.2"
        );
        assert_eq!(
            find(&plans, 0, "ipv4 udp echo").expect("check").expected,
            "from 203.0.113.2"
        );
        assert_eq!(
            find(&plans, 0, "ipv4 mss clamp").expect("check").expected,
            "syn mss 1340"
        );
        assert_eq!(
            find(&plans, 0, "ipv6 tcp echo").expect("check").expected,
            "from fdaa:1::a"
        );
        assert_eq!(
            find(&plans, 0, "ipv6 mss clamp").expect("check").expected,
            "syn mss 1320"
        );
    }

    #[test]
    fn no_routes_expect_no_reach_but_mesh() {
        let (plans, _) = plan_checks(&sample());
        assert_eq!(
            find(&plans, 1, "ipv4 tcp echo").expect("check").expected,
            NO_REACH
        );
        assert_eq!(
            find(&plans, 1, "ipv4 udp echo").expect("check").expected,
            NO_REACH
        );
        assert_eq!(
            find(&plans, 1, "ipv6 tcp echo").expect("check").expected,
            NO_REACH
        );
        assert!(find(&plans, 1, "ipv4 mss clamp").is_none());
        assert_eq!(find(&plans, 1, "nat rule").expect("check").expected, "none");
        assert_eq!(
            find(&plans, 1, "mesh -> vm-a").expect("check").expected,
            "from fdaa:1::b"
        );
        assert_eq!(
            find(&plans, 1, "mesh -> vm-c").expect("check").expected,
            "from fdaa:1::b"
        );
    }

    #[test]
    fn gateway_route_probes_the_gateway_guest() {
        let (plans, probes) = plan_checks(&sample());
        let g = find(&plans, 2, "gateway 2000::/3 via vm-a").expect("check");
        assert_eq!(
            g.expected,
            "at vm-a from fdaa:1::c, reply from 2001:db8:ffff::1"
        );
        assert_eq!(
            g.probe,
            Probe::Gateway {
                target: "[2001:db8:ffff::1]:7".parse().expect("addr"),
                gateway: 0
            }
        );
        assert_eq!(probes, vec![(0, PROBE_V6)]);
        // The gateway carries the internet IPv6 traffic: no separate ipv6 echo check for vm-c.
        assert!(find(&plans, 2, "ipv6 tcp echo").is_none());
        assert_eq!(
            find(&plans, 2, "ipv4 tcp echo").expect("check").expected,
            NO_REACH
        );
    }

    #[test]
    fn vm_without_mesh_reaches_nothing() {
        let vms = vec![vm("cap", None, vec![route("0.0.0.0/0", "host")])];
        let (plans, _) = plan_checks(&vms);
        assert!(
            plans
                .iter()
                .all(|p| p.expected == NO_REACH || p.name == "nat rule"),
            "{plans:?}"
        );
        assert_eq!(find(&plans, 0, "nat rule").expect("check").expected, "none");
        assert!(find(&plans, 0, "veth mtu").is_none());
    }

    #[test]
    fn longest_prefix_wins() {
        let routes = vec![route("::/0", "host"), route("2000::/3", "fdaa:1::a")];
        let r = route_for(&routes, "2001:db8::1".parse().expect("ip")).expect("route");
        assert_eq!(r.destination.to_string(), "2000::/3");
        assert!(route_for(&routes, "1.2.3.4".parse().expect("ip")).is_none());
        assert_eq!(
            probe_in(&"fd00::/8".parse().expect("net")),
            Some("fd00::1".parse().expect("ip"))
        );
        assert_eq!(probe_in(&"0.0.0.0/0".parse().expect("net")), None);
    }

    #[test]
    fn table_aligns_and_marks_failures() {
        let results = vec![
            CheckResult {
                vm: "vm-a".into(),
                check: "x".into(),
                expected: "1".into(),
                seen: "1".into(),
                ok: true,
            },
            CheckResult {
                vm: "b".into(),
                check: "longer".into(),
                expected: "2".into(),
                seen: "3".into(),
                ok: false,
            },
        ];
        let t = render_checks(&results);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "VM    CHECK   EXPECTED  SEEN  RESULT");
        assert_eq!(lines[1], "----  ------  --------  ----  ------");
        assert_eq!(lines[2], "vm-a  x       1         1     ok");
        assert_eq!(lines[3], "b     longer  2         3     FAIL");
    }
}
