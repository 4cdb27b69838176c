//! The probes of the namespace-mode checks that read kernel state or run from the fake internet
//! (the same for simulated and real guests), and the simulated guest's MSS probe.

use std::net::{IpAddr, SocketAddr};

use vmnet_model::error::chain;

use super::checks::{GUEST_GW_V6, GuestInfo, KernelNames, NO_REACH, Probe, TIMEOUT, from};
use crate::{SandboxError, netns, traffic};

/// Runs a probe that needs no guest: `InetTcp` / `InetUdp` (from the fake internet), `NatRule`
/// and `VethMtu` (kernel state); what it saw. Other probes give `-`.
pub fn run_host_probe(v: &GuestInfo, probe: &Probe) -> String {
    match *probe {
        Probe::InetTcp(t) | Probe::InetUdp(t) => {
            let ns = v.public.as_ref().map_or("", |p| p.inet_ns.as_str());
            seen_reply(if matches!(probe, Probe::InetTcp(_)) {
                traffic::try_tcp_echo(ns, t, TIMEOUT)
            } else {
                traffic::try_udp_echo(ns, t, TIMEOUT)
            })
        }
        Probe::NatRule => v.kernel.as_ref().map_or_else(|| "-".into(), nat_rule),
        Probe::VethMtu => v.kernel.as_ref().map_or_else(|| "-".into(), veth_mtu),
        _ => "-".into(),
    }
}

pub(super) fn seen_reply(r: Result<Option<traffic::EchoReply>, SandboxError>) -> String {
    match r {
        Ok(Some(reply)) => from(reply.peer.ip()),
        Ok(None) => NO_REACH.into(),
        Err(e) => format!("error: {}", chain(&e)),
    }
}

pub(super) fn run_mss(guest_ns: &str, target: SocketAddr, advmss: u16) -> String {
    let (dst, gw, fam) = match target.ip() {
        IpAddr::V4(a) => (
            format!("{a}/32"),
            crate::guest::GATEWAY_V4.to_string(),
            "-4",
        ),
        IpAddr::V6(a) => (format!("{a}/128"), GUEST_GW_V6.to_string(), "-6"),
    };
    let adv = advmss.to_string();
    let add = [
        "route", "add", &dst, "via", &gw, "dev", "eth0", "advmss", &adv,
    ];
    if let Err(e) = netns::ip(guest_ns, &[&[fam][..], &add[..]].concat()) {
        return format!("error: {}", chain(&e));
    }
    let seen = match traffic::try_tcp_echo(guest_ns, target, TIMEOUT) {
        Ok(Some(r)) => r
            .syn_mss
            .map_or_else(|| "no mss option".into(), |m| format!("syn mss {m}")),
        Ok(None) => NO_REACH.into(),
        Err(e) => format!("error: {}", chain(&e)),
    };
    let _ = netns::ip(guest_ns, &[fam, "route", "del", &dst]);
    seen
}

fn nat_rule(k: &KernelNames) -> String {
    match netns::exec(
        &k.vm_ns,
        "nft",
        &["list", "table", "inet", &k.nft_table],
        TIMEOUT,
    ) {
        Ok(out) if out.status.success() => {
            let text = String::from_utf8_lossy(&out.stdout);
            if text.contains(" snat ") || text.contains("masquerade") {
                "snat".into()
            } else {
                "none".into()
            }
        }
        Ok(out) => format!("error: {}", String::from_utf8_lossy(&out.stderr).trim()),
        Err(e) => format!("error: {}", chain(&e)),
    }
}

fn veth_mtu(k: &KernelNames) -> String {
    let Some(veth) = &k.veth_host else {
        return "no veth".into();
    };
    match netns::ip(&k.host_ns, &["link", "show", "dev", veth]) {
        Ok(text) => text
            .split_whitespace()
            .skip_while(|w| *w != "mtu")
            .nth(1)
            .map_or_else(|| "no mtu".into(), str::to_owned),
        Err(e) => format!("error: {}", chain(&e)),
    }
}
