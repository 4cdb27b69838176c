//! The firewall checks of `vmnet-lab up --sandbox`: for each VM whose firewall is enabled and that
//! has public addresses, real packets from the fake internet and from a mesh peer (another VM's
//! guest) at ports the rules allow and at a port they do not (the guest listens on both, so a
//! refused connection shows the filter, not a closed port), and from the guest outwards.
//!
//! | check | expected |
//! |---|---|
//! | `firewall tcp <p> from internet` (IPv4 and the /128) | `from <client>` for port 7 (allowed), `no reach` for 8 |
//! | `firewall udp 8 from internet` | `no reach` (udp is allowed on port 7 only) |
//! | `firewall icmp from internet` | `reply` to the /128 (ICMPv6 allowed), `no reply` to the IPv4 |
//! | `firewall tcp <p> from mesh peer` | `from <peer mesh>` for 7, `no reach` for 8 |
//! | `firewall ipv6 udp echo out` | `no reach`: outbound UDP is allowed to the IPv4 echo only |
//!
//! The allowed checks of the other tables (`ipv4 tcp echo`, `public … from internet`, `mesh → …`)
//! run through the firewall too: its rules let exactly those through.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use vmnet_model::vm::VmConfig;

use super::checks::{CheckResult, NO_REACH};
use crate::echo::EchoService;
use crate::guest::GUEST_V4;
use crate::sandbox::{ECHO_PORT, ECHO_V6, INET_UPLINK_V4, INET_UPLINK_V6};
use crate::traffic;

/// The port the rules do not allow (the guest listens on it).
pub const BLOCKED_PORT: u16 = 8;

const TIMEOUT: Duration = Duration::from_secs(2);

/// The VMs the checks apply to: an enabled firewall, a mesh address and public addresses.
#[must_use]
pub fn filtered(vms: &[VmConfig]) -> Vec<&VmConfig> {
    vms.iter()
        .filter(|v| {
            v.firewall.as_ref().is_some_and(|f| f.enabled)
                && v.mesh_ipv6.is_some()
                && (v.public_ipv4.is_some() || v.public_ipv6_mapped().is_some())
        })
        .collect()
}

/// A TCP echo from netns `ns` to `to`: `from <peer address>`, `no reach`, or the error.
pub(super) fn tcp(ns: &str, to: SocketAddr) -> String {
    match traffic::try_tcp_echo(ns, to, TIMEOUT) {
        Ok(Some(r)) => format!("from {}", r.peer.ip()),
        Ok(None) => NO_REACH.to_owned(),
        Err(e) => format!("error: {e}"),
    }
}

fn udp(ns: &str, to: SocketAddr) -> String {
    match traffic::try_udp_echo(ns, to, TIMEOUT) {
        Ok(Some(r)) => format!("from {}", r.peer.ip()),
        Ok(None) => NO_REACH.to_owned(),
        Err(e) => format!("error: {e}"),
    }
}

fn ping(ns: &str, to: IpAddr) -> String {
    match traffic::ping(ns, to, 2, Duration::from_millis(500)) {
        Ok(r) if r.received > 0 => "reply".to_owned(),
        Ok(_) => "no reply".to_owned(),
        Err(e) => format!("error: {e}"),
    }
}

/// Runs the checks of every filtered VM; `guest_ns` maps VM ids to their guests' namespaces.
/// Blocking (real packets with timeouts).
#[must_use]
pub fn run(inet: &str, vms: &[VmConfig], guest_ns: &[(String, String)]) -> Vec<CheckResult> {
    let ns_of = |id: &str| {
        guest_ns
            .iter()
            .find(|(v, _)| v == id)
            .map(|(_, n)| n.clone())
    };
    let mut out = Vec::new();
    for vm in filtered(vms) {
        let Some(g) = ns_of(&vm.id) else { continue };
        let mesh = IpAddr::V6(vm.mesh_ipv6.expect("filtered VMs have a mesh address"));
        let mut addrs = vec![SocketAddr::new(mesh, BLOCKED_PORT)];
        addrs.push(SocketAddr::new(IpAddr::V4(GUEST_V4), BLOCKED_PORT));
        addrs.push(SocketAddr::new(IpAddr::V4(GUEST_V4), ECHO_PORT));
        addrs.push(SocketAddr::new(mesh, ECHO_PORT));
        let svc = match EchoService::start(&g, &addrs) {
            Ok(s) => s,
            Err(e) => {
                out.push(result(
                    &vm.id,
                    "firewall guest echo",
                    "running",
                    &e.to_string(),
                ));
                continue;
            }
        };
        let mut check = |name: String, expected: String, seen: String| {
            out.push(result(&vm.id, &name, &expected, &seen));
        };
        let public: Vec<(IpAddr, IpAddr)> = vm
            .public_ipv4
            .map(|a| (IpAddr::V4(a), IpAddr::V4(INET_UPLINK_V4)))
            .into_iter()
            .chain(
                vm.public_ipv6_mapped()
                    .map(|a| (IpAddr::V6(a), IpAddr::V6(INET_UPLINK_V6))),
            )
            .collect();
        for (addr, client) in &public {
            for (port, expected) in [
                (ECHO_PORT, format!("from {client}")),
                (BLOCKED_PORT, NO_REACH.into()),
            ] {
                let to = SocketAddr::new(*addr, port);
                check(
                    format!("firewall tcp {port} from internet to {addr}"),
                    expected,
                    tcp(inet, to),
                );
            }
            let (name, want) = if addr.is_ipv4() {
                ("no reply", "icmp")
            } else {
                ("reply", "icmpv6")
            };
            check(
                format!("firewall {want} from internet to {addr}"),
                name.into(),
                ping(inet, *addr),
            );
        }
        if let Some((a, _)) = public.iter().find(|(a, _)| a.is_ipv4()) {
            let to = SocketAddr::new(*a, BLOCKED_PORT);
            check(
                format!("firewall udp {BLOCKED_PORT} from internet to {a}"),
                NO_REACH.into(),
                udp(inet, to),
            );
        }
        // A mesh peer: the first other VM with a mesh address.
        if let Some(peer) = vms.iter().find(|v| v.id != vm.id && v.mesh_ipv6.is_some())
            && let Some(pg) = ns_of(&peer.id)
        {
            let from = IpAddr::V6(peer.mesh_ipv6.expect("checked"));
            for (port, expected) in [
                (ECHO_PORT, format!("from {from}")),
                (BLOCKED_PORT, NO_REACH.into()),
            ] {
                check(
                    format!("firewall tcp {port} from mesh peer {}", peer.id),
                    expected,
                    tcp(&pg, SocketAddr::new(mesh, port)),
                );
            }
        }
        check(
            "firewall ipv6 udp echo out".into(),
            NO_REACH.into(),
            udp(&g, SocketAddr::new(IpAddr::V6(ECHO_V6), ECHO_PORT)),
        );
        drop(svc);
    }
    out
}

fn result(vm: &str, check: &str, expected: &str, seen: &str) -> CheckResult {
    CheckResult {
        vm: vm.to_owned(),
        check: check.to_owned(),
        expected: expected.to_owned(),
        seen: seen.to_owned(),
        ok: expected == seen,
    }
}
