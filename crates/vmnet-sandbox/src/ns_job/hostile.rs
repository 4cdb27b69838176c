//! The hostile-guest checks of `vmnet-lab up --sandbox`: from one simulated guest (the first VM with
//! a mesh address and IPv4 and IPv6 routes via host: `vm-gateway` in `examples/host.json`; they
//! run when the spec has a second VM with a mesh address, the mesh spoof's victim),
//! raw frames a guest root in its VM could send, each looked for where it would arrive
//! ([`crate::hostile`]) beside honest frames that must arrive, and the guest guard's drop
//! counters (`GET /v1/vms/{id}`, `guard_drops`) read before and after.
//!
//! | check | expected |
//! |---|---|
//! | `hostile: honest IPv4 to the internet` / `honest IPv6 …` / `honest mesh …` | `arrives` (at the fake internet's uplink, at the other guest) |
//! | `hostile: IPv4 foreign source`, `… another VM's public IPv4` | `dropped`: not at the fake internet |
//! | `hostile: IPv6 foreign source`, `… another VM's public IPv6` | `dropped`: not at the fake internet |
//! | `hostile: another VM's mesh address to <vm>` | `dropped`: not at that VM's guest |
//! | `hostile: foreign source MAC` | `dropped`: not at the fake internet |
//! | `hostile: forged ARP for the gateway`, `… for the guest's address` | `dropped`: the namespace's neighbour table keeps no entry with the forged MAC |
//! | `hostile: router advertisement into the namespace` | `dropped`: no address or route from its prefix, no default route via the guest |
//! | `hostile: redirect into the namespace` | `dropped`: the namespace still routes the redirected destination to the host |
//! | `hostile: guard drops <kind>` | `+n`: the VM's counter of that kind moved by the number of such spoofs |

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, Ipv6Addr};

use vmnet_agent::api::types::VmView;
use vmnet_agent::client::{Client, segment};
use vmnet_model::nic::MacAddr;
use vmnet_model::vm::VmConfig;

use super::checks::CheckResult;
use crate::hostile::{self, Case};
use crate::probe::{
    ALL_NODES_MAC, Capture, arp_reply_frame, icmp6_message, redirect, router_advertisement,
    udp4_frame, udp6_frame,
};
use crate::sandbox::{ECHO_V4, ECHO_V6, INET_UPLINK_IF};
use crate::{guest, netns};

const GUEST_MAC: MacAddr = MacAddr([0x06, 0x00, 0xac, 0x10, 0x00, 0x02]);
const FOREIGN_MAC: MacAddr = MacAddr([0x02, 0xde, 0xad, 0xbe, 0xef, 0x01]);
const GATEWAY_LL: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);
/// A source no VM owns.
const FOREIGN_V4: Ipv4Addr = Ipv4Addr::new(10, 66, 0, 5);
const FOREIGN_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xbad, 0, 0, 0, 0, 5);
/// The prefix of the forged router advertisement.
const RA_PREFIX: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xbad, 1, 0, 0, 0, 0);
const PORTS: (u16, u16) = (40000, 9);

/// The guest that attacks: the first VM with a mesh address and IPv4 and IPv6 routes via host.
#[must_use]
pub fn attacker(vms: &[VmConfig]) -> Option<&VmConfig> {
    let a = vms
        .iter()
        .find(|v| v.mesh_ipv6.is_some() && v.ipv4_via_host() && v.default_v6_via_host())?;
    // The mesh spoof needs a victim: another VM with a mesh address. Without one (a spec of a
    // single VM) the checks do not run.
    vms.iter()
        .any(|v| v.id != a.id && v.mesh_ipv6.is_some())
        .then_some(a)
}

async fn view(client: &Client, id: &str) -> Result<VmView, String> {
    client
        .get(&format!("/v1/vms/{}", segment(id)))
        .await
        .map_err(|e| format!("GET vm {id}: {}", e.message))
}

fn drops(v: &VmView) -> Result<BTreeMap<String, u64>, String> {
    v.status.guard_drops.clone().ok_or_else(|| {
        format!(
            "vm {}: no guard_drops (is the guest guard on?)",
            v.config.id
        )
    })
}

/// The MAC of `dev` in namespace `ns`.
fn mac_of(ns: &str, dev: &str) -> Result<MacAddr, String> {
    let out = netns::ip(ns, &["-j", "link", "show", "dev", dev]).map_err(|e| e.to_string())?;
    let v: serde_json::Value = serde_json::from_str(&out).map_err(|e| e.to_string())?;
    v[0]["address"]
        .as_str()
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| format!("{dev} in {ns}: no MAC in {out}"))
}

/// What the namespace's neighbour table holds for `ip` with the forged MAC, if anything.
fn forged_neighbour(ns: &str, ip: &str) -> Option<String> {
    let out = netns::ip(ns, &["neigh", "show", ip]).unwrap_or_default();
    out.contains(&FOREIGN_MAC.to_string())
        .then(|| format!("neighbour {}", out.trim()))
}

/// What the forged router advertisement left in the namespace, if anything.
fn ra_effect(ns: &str) -> Option<String> {
    let prefix = "2001:db8:bad:1:";
    let addrs = netns::ip(ns, &["-6", "addr", "show"]).unwrap_or_default();
    let routes = netns::ip(ns, &["-6", "route", "show"]).unwrap_or_default();
    let guest_ll = GUEST_MAC.link_local_v6().to_string();
    if addrs.contains(prefix) {
        return Some(format!("address from {prefix}:/64"));
    }
    routes
        .lines()
        .find(|l| l.contains(prefix) || (l.starts_with("default") && l.contains(&guest_ll)))
        .map(|l| format!("route {l}"))
}

/// What the forged redirect changed for `dst` in the namespace, if anything.
fn redirect_effect(ns: &str, dst: Ipv6Addr, tap: &str) -> Option<String> {
    let out = netns::ip(ns, &["-6", "route", "get", &dst.to_string()]).unwrap_or_default();
    out.contains(&format!("dev {tap}"))
        .then(|| format!("route {}", out.trim()))
}

/// Runs the checks; `guests` maps a VM id to its guest namespace.
pub async fn run(
    client: &Client,
    inet: &str,
    vms: &[VmConfig],
    guests: &[(String, String)],
) -> Vec<CheckResult> {
    let Some(a) = attacker(vms) else {
        return Vec::new();
    };
    let fail = |what: String| vec![CheckResult::new(&a.id, "hostile guest", "run".into(), what)];
    match checks(client, inet, vms, guests, a).await {
        Ok(r) => r,
        Err(e) => fail(e),
    }
}

async fn checks(
    client: &Client,
    inet: &str,
    vms: &[VmConfig],
    guests: &[(String, String)],
    a: &VmConfig,
) -> Result<Vec<CheckResult>, String> {
    let guest_of = |id: &str| guests.iter().find(|(v, _)| v == id).map(|(_, g)| g.clone());
    let a_ns = guest_of(&a.id).ok_or("no guest of the attacking VM")?;
    let mesh = a.mesh_ipv6.ok_or("no mesh address")?;
    let victim = vms
        .iter()
        .find(|v| v.id != a.id && v.mesh_ipv6.is_some() && guest_of(&v.id).is_some())
        .ok_or("no second VM with a mesh address")?;
    let victim_mesh = victim.mesh_ipv6.ok_or("no mesh address")?;
    let others: Vec<&VmConfig> = vms.iter().filter(|v| v.id != a.id).collect();
    let other_v4 = others
        .iter()
        .find_map(|v| v.public_ipv4)
        .unwrap_or(Ipv4Addr::new(203, 0, 113, 99));
    let other_v6 = others
        .iter()
        .find_map(|v| v.public_ipv6_mapped())
        .unwrap_or(Ipv6Addr::new(0x2001, 0xdb8, 0, 1, 0, 0, 0, 0x99));
    let other_mesh = others
        .iter()
        .filter_map(|v| v.mesh_ipv6)
        .find(|m| *m != victim_mesh)
        .unwrap_or(victim_mesh);

    let before = view(client, &a.id).await?;
    let (vm_ns, tap) = (before.status.netns.clone(), before.status.tap.clone());
    let before = drops(&before)?;
    let tap_mac = mac_of(&vm_ns, &tap)?;
    let ll = GUEST_MAC.link_local_v6();
    let g4 = guest::GUEST_V4;
    let gw4 = guest::GATEWAY_V4;

    let victim_ns = guest_of(&victim.id).ok_or("no guest of the victim")?;
    let caps = [
        Capture::start(inet, INET_UPLINK_IF)
            .map_err(|e| format!("capture at the internet: {e}"))?,
        Capture::start(&victim_ns, guest::GUEST_IF)
            .map_err(|e| format!("capture at {}: {e}", victim.id))?,
    ];
    let (ns1, ns2, ns3, ns4, tap2) = (
        vm_ns.clone(),
        vm_ns.clone(),
        vm_ns.clone(),
        vm_ns.clone(),
        tap.clone(),
    );
    let cases = vec![
        Case::honest("honest IPv4 to the internet", 0, move |m| {
            udp4_frame(tap_mac, GUEST_MAC, g4, ECHO_V4, PORTS, m)
        }),
        Case::honest("honest IPv6 to the internet", 0, move |m| {
            udp6_frame(tap_mac, GUEST_MAC, mesh, ECHO_V6, PORTS, m)
        }),
        Case::honest(&format!("honest mesh to {}", victim.id), 1, move |m| {
            udp6_frame(tap_mac, GUEST_MAC, mesh, victim_mesh, PORTS, m)
        }),
        Case::spoof(&format!("IPv4 foreign source {FOREIGN_V4}"), 0, move |m| {
            udp4_frame(tap_mac, GUEST_MAC, FOREIGN_V4, ECHO_V4, PORTS, m)
        }),
        Case::spoof(
            &format!("another VM's public IPv4 {other_v4}"),
            0,
            move |m| udp4_frame(tap_mac, GUEST_MAC, other_v4, ECHO_V4, PORTS, m),
        ),
        Case::spoof(&format!("IPv6 foreign source {FOREIGN_V6}"), 0, move |m| {
            udp6_frame(tap_mac, GUEST_MAC, FOREIGN_V6, ECHO_V6, PORTS, m)
        }),
        Case::spoof(
            &format!("another VM's public IPv6 {other_v6}"),
            0,
            move |m| udp6_frame(tap_mac, GUEST_MAC, other_v6, ECHO_V6, PORTS, m),
        ),
        Case::spoof(
            &format!("another VM's mesh address {other_mesh} to {}", victim.id),
            1,
            move |m| udp6_frame(tap_mac, GUEST_MAC, other_mesh, victim_mesh, PORTS, m),
        ),
        Case::spoof("foreign source MAC", 0, move |m| {
            udp4_frame(tap_mac, FOREIGN_MAC, g4, ECHO_V4, PORTS, m)
        }),
        Case::spoof_state(
            "forged ARP for the gateway",
            move || forged_neighbour(&ns1, &gw4.to_string()),
            move |m| arp_reply_frame(tap_mac, GUEST_MAC, (FOREIGN_MAC, gw4), (tap_mac, gw4), m),
        ),
        Case::spoof_state(
            "forged ARP for the guest's address",
            move || forged_neighbour(&ns2, &g4.to_string()),
            move |m| arp_reply_frame(tap_mac, GUEST_MAC, (FOREIGN_MAC, g4), (tap_mac, gw4), m),
        ),
        Case::spoof_state(
            "router advertisement into the namespace",
            move || ra_effect(&ns3),
            move |m| {
                let all_nodes = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);
                icmp6_message(
                    ALL_NODES_MAC,
                    GUEST_MAC,
                    ll,
                    all_nodes,
                    &router_advertisement(RA_PREFIX, m),
                )
            },
        ),
        Case::spoof_state(
            "redirect into the namespace",
            move || redirect_effect(&ns4, ECHO_V6, &tap2),
            move |m| {
                icmp6_message(
                    tap_mac,
                    GUEST_MAC,
                    ll,
                    GATEWAY_LL,
                    &redirect(ll, ECHO_V6, m),
                )
            },
        ),
    ];
    let outcomes = tokio::task::spawn_blocking(move || {
        let r = hostile::run(&a_ns, guest::GUEST_IF, &caps, &cases, "ns");
        drop(caps);
        r
    })
    .await
    .map_err(|e| e.to_string())?;
    let after = drops(&view(client, &a.id).await?)?;
    let mut out: Vec<CheckResult> = outcomes
        .into_iter()
        .map(|o| CheckResult::new(&a.id, &format!("hostile: {}", o.name), o.expected, o.seen))
        .collect();
    let expected = [
        ("mac", 1),
        ("arp", 2),
        ("ipv4_source", 2),
        ("ipv6_source", 2),
        ("mesh_source", 1),
        ("server_message", 2),
    ];
    for (kind, want, seen) in hostile::counter_moves(&before, &after, &expected) {
        out.push(CheckResult::new(
            &a.id,
            &format!("hostile: guard drops {kind}"),
            want,
            seen,
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vm(id: &str, uid: u32, mesh: Option<&str>) -> VmConfig {
        let mut v = serde_json::json!({"id": id, "user_id": uid, "tenant": 1});
        if let Some(m) = mesh {
            v["mesh_ipv6"] = m.into();
            v["network"] = serde_json::json!({"routes": [
                {"destination": "0.0.0.0/0", "via": "host"}, {"destination": "::/0", "via": "host"}]});
        }
        serde_json::from_value(v).expect("config")
    }

    #[test]
    fn the_checks_run_only_with_a_victim_on_the_mesh() {
        let a = vm("a", 1, Some("fdaa:1::1"));
        assert!(attacker(std::slice::from_ref(&a)).is_none(), "one VM");
        let no_mesh = vm("b", 2, None);
        assert!(attacker(&[a.clone(), no_mesh]).is_none());
        let b = vm("b", 2, Some("fdaa:1::2"));
        assert_eq!(attacker(&[a, b]).map(|v| v.id.as_str()), Some("a"));
    }
}
