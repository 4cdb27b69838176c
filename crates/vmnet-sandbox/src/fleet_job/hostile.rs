//! The impersonation check across hosts: a guest sends to a VM on another host with the mesh
//! address of a third VM of its own host (registered there, of the target's tenant: the
//! receiving host's checks alone would accept it). It runs three times:
//!
//! | check | expected |
//! |---|---|
//! | `impersonation: honest mesh <a> -> <b>` | `arrives` at `b`'s guest |
//! | `impersonation: <m> (another VM's mesh address) -> <b>` | `dropped`: not at `b`'s guest |
//! | `impersonation: guard drops mesh_source` | `+1` on `a`'s VM |
//! | `… with the guard and the namespace's table removed by hand` | `dropped` all the same: the mesh program on `a`'s host veth end checks the source (`GET /v1/mesh` `spoofed_source` `+1`); `a`'s agent is held with `SIGSTOP` meanwhile, or it would put both back on their notifications first |
//! | `… after a re-apply` | `dropped`, guard drops `mesh_source` `+1`: the apply attached the guard again |

use std::collections::BTreeMap;
use std::net::Ipv6Addr;

use vmnet_agent::api::types::VmView;
use vmnet_agent::client::{Client, segment};
use vmnet_agent::mesh::view::MeshView;
use vmnet_model::nic::MacAddr;

use super::HostReport;
use super::checks::FleetCheck;
use super::mesh::MeshGuest;
use crate::hostile::{self, Case};
use crate::probe::{Capture, udp6_frame};
use crate::{guest, netns};

const GUEST_MAC: MacAddr = MacAddr([0x06, 0x00, 0xac, 0x10, 0x00, 0x02]);
const PORTS: (u16, u16) = (40001, 9);

/// The attacker `a`, the target `b` (another host, same tenant) and the impersonated `m` (on
/// `a`'s host, `b`'s tenant), by index into `guests`.
#[must_use]
pub fn pick(guests: &[MeshGuest]) -> Option<(usize, usize, usize)> {
    for (a, ga) in guests.iter().enumerate() {
        for (b, gb) in guests.iter().enumerate() {
            if gb.host == ga.host || gb.tenant != ga.tenant {
                continue;
            }
            if let Some(m) = guests
                .iter()
                .position(|gm| gm.host == ga.host && gm.vm != ga.vm && gm.tenant == gb.tenant)
            {
                return Some((a, b, m));
            }
        }
    }
    None
}

struct Side {
    client: Client,
    vm_ns: String,
    tap: String,
    tap_mac: MacAddr,
}

async fn view(client: &Client, id: &str) -> Result<VmView, String> {
    client
        .get(&format!("/v1/vms/{}", segment(id)))
        .await
        .map_err(|e| format!("GET vm {id}: {}", e.message))
}

async fn guard_drop(client: &Client, id: &str) -> Result<u64, String> {
    let v = view(client, id).await?;
    let d: BTreeMap<String, u64> = v.status.guard_drops.unwrap_or_default();
    Ok(d.get("mesh_source").copied().unwrap_or(0))
}

async fn mesh_drop(client: &Client) -> Result<u64, String> {
    let m: MeshView = client
        .get("/v1/mesh")
        .await
        .map_err(|e| format!("GET mesh: {}", e.message))?;
    Ok(m.data_plane
        .and_then(|d| d.drops.get("spoofed_source").copied())
        .unwrap_or(0))
}

/// Runs the checks across `hosts`.
pub async fn run(hosts: &[HostReport]) -> Vec<FleetCheck> {
    let guests: Vec<MeshGuest> = hosts
        .iter()
        .flat_map(|h| h.mesh_guests.iter().cloned())
        .collect();
    let Some((a, b, m)) = pick(&guests) else {
        return Vec::new();
    };
    let (ga, gb, gm) = (guests[a].clone(), guests[b].clone(), guests[m].clone());
    match checks(hosts, &ga, &gb, gm.mesh).await {
        Ok(c) => c,
        Err(e) => vec![FleetCheck {
            host: ga.host.clone(),
            check: "impersonation".into(),
            expected: "run".into(),
            seen: e,
            ok: false,
        }],
    }
}

/// Sends the honest frame and the impersonation, returns (honest, spoof) outcomes.
async fn send(
    tap_mac: MacAddr,
    a: &MeshGuest,
    b: &MeshGuest,
    m: Ipv6Addr,
    tag: &str,
) -> Result<(String, String), String> {
    let (from, to) = (a.mesh, b.mesh);
    let ns = a.guest_ns.clone();
    let target_ns = b.guest_ns.clone();
    let tag = tag.to_owned();
    tokio::task::spawn_blocking(move || {
        let cap = Capture::start(&target_ns, guest::GUEST_IF).map_err(|e| e.to_string())?;
        let cases = vec![
            Case::honest("honest", 0, move |mk| {
                udp6_frame(tap_mac, GUEST_MAC, from, to, PORTS, mk)
            }),
            Case::spoof("spoof", 0, move |mk| {
                udp6_frame(tap_mac, GUEST_MAC, m, to, PORTS, mk)
            }),
        ];
        let r = hostile::run(&ns, guest::GUEST_IF, &[cap], &cases, &tag);
        Ok::<_, String>((r[0].seen.clone(), r[1].seen.clone()))
    })
    .await
    .map_err(|e| e.to_string())?
}

/// Deletes the guest guard's filter from `side`'s tap and the VM namespace's table `table`.
fn remove_guard_and_table(side: &Side, table: &str) -> Result<(), String> {
    let tap = side.tap.clone();
    vmnet_kernel::netns::run_in(&side.vm_ns, move || vmnet_kernel::guard::detach_here(&tap))
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    netns::exec(
        &side.vm_ns,
        "nft",
        &["delete", "table", "inet", table],
        std::time::Duration::from_secs(5),
    )
    .map_err(|e| e.to_string())?;
    Ok(())
}

async fn checks(
    hosts: &[HostReport],
    a: &MeshGuest,
    b: &MeshGuest,
    m: Ipv6Addr,
) -> Result<Vec<FleetCheck>, String> {
    let host_a = hosts
        .iter()
        .find(|h| h.name == a.host)
        .ok_or("no attacking host")?;
    let client = Client::new(&host_a.socket);
    let v = view(&client, &a.vm).await?;
    let side = Side {
        tap_mac: {
            let out = netns::ip(
                &v.status.netns,
                &["-j", "link", "show", "dev", &v.status.tap],
            )
            .map_err(|e| e.to_string())?;
            let j: serde_json::Value = serde_json::from_str(&out).map_err(|e| e.to_string())?;
            j[0]["address"]
                .as_str()
                .and_then(|s| s.parse().ok())
                .ok_or("no tap MAC")?
        },
        vm_ns: v.status.netns.clone(),
        tap: v.status.tap.clone(),
        client,
    };
    let mut out = Vec::new();
    let mut check = |name: String, expected: String, seen: String| {
        out.push(FleetCheck {
            host: a.host.clone(),
            ok: seen == expected,
            check: name,
            expected,
            seen,
        });
    };
    let spoof_name = format!(
        "impersonation: {m} (another VM's mesh address) -> {} on {}",
        b.vm, b.host
    );

    // 1. Everything in place.
    let g0 = guard_drop(&side.client, &a.vm).await?;
    let (honest, spoof) = send(side.tap_mac, a, b, m, "fleet1").await?;
    let g1 = guard_drop(&side.client, &a.vm).await?;
    check(
        format!("impersonation: honest mesh {} -> {}", a.vm, b.vm),
        "arrives".into(),
        honest,
    );
    check(spoof_name.clone(), "dropped".into(), spoof);
    check(
        "impersonation: guard drops mesh_source".into(),
        "+1".into(),
        format!("+{}", g1.saturating_sub(g0)),
    );

    // 2. The guard and the namespace's table removed by hand: the mesh program still drops it.
    // The attacking host's agent is held (SIGSTOP) meanwhile: it would put both back on their
    // notifications before the frame is sent.
    let s0 = mesh_drop(&side.client).await?;
    let agent = nix::unistd::Pid::from_raw(i32::try_from(host_a.agent_pid).unwrap_or(0));
    nix::sys::signal::kill(agent, nix::sys::signal::Signal::SIGSTOP)
        .map_err(|e| format!("holding the agent: {e}"))?;
    let removed = remove_guard_and_table(&side, &host_a.agent_prefix);
    let sent = match removed {
        Ok(()) => send(side.tap_mac, a, b, m, "fleet2").await,
        Err(e) => Err(e),
    };
    nix::sys::signal::kill(agent, nix::sys::signal::Signal::SIGCONT)
        .map_err(|e| format!("letting the agent run again: {e}"))?;
    let (_, spoof) = sent?;
    let s1 = mesh_drop(&side.client).await?;
    check(
        format!("{spoof_name}, with the guard and the namespace's table removed by hand"),
        "dropped, mesh spoofed_source +1".into(),
        format!("{spoof}, mesh spoofed_source +{}", s1.saturating_sub(s0)),
    );

    // 3. A re-apply (what a reconcile pass does) puts both back.
    let _: VmView = side
        .client
        .put(&format!("/v1/vms/{}", segment(&a.vm)), &v.config)
        .await
        .map_err(|e| format!("PUT vm {}: {}", a.vm, e.message))?;
    let g2 = guard_drop(&side.client, &a.vm).await?;
    let (_, spoof) = send(side.tap_mac, a, b, m, "fleet3").await?;
    let g3 = guard_drop(&side.client, &a.vm).await?;
    check(
        format!("{spoof_name}, after a re-apply"),
        "dropped, guard mesh_source +1".into(),
        format!("{spoof}, guard mesh_source +{}", g3.saturating_sub(g2)),
    );
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(host: &str, vm: &str, mesh: &str, tenant: u32) -> MeshGuest {
        MeshGuest {
            host: host.into(),
            vm: vm.into(),
            guest_ns: format!("g-{vm}"),
            mesh: mesh.parse().unwrap(),
            tenant,
        }
    }

    #[test]
    fn the_impersonated_vm_is_on_the_attackers_host_and_of_the_targets_tenant() {
        let guests = vec![
            g("h1", "web-1", "fdaa:1::7", 1),
            g("h1", "db-1", "fdaa:1::8", 1),
            g("h2", "web-2", "fdaa:2::7", 2),
            g("h2", "app-2", "fdaa:2::9", 2),
            g("h3", "web-3", "fdaa:3::7", 2),
        ];
        assert_eq!(pick(&guests), Some((2, 4, 3)));
        assert_eq!(pick(&guests[..3]), None);
    }
}
