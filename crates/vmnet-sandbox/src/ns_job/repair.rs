//! The drift check of `vmnet-lab up --sandbox`: IPv6 turned off by hand on a VM's host veth end (a
//! stray `sysctl -w net.ipv6.conf.<end>.disable_ipv6=1`), which cuts the VM's IPv6 off without
//! touching a link, an address or an nft table, and the agent's next full reconcile pass
//! repairing it in place. It runs for the first VM with a mesh address, an IPv6 route via host
//! and no enabled firewall (the packet-activity checks' VM, [`super::activity::checked`]).
//!
//! | check | expected |
//! |---|---|
//! | `drift: IPv6 off on the host veth end` | `cut off, then repaired by a pass`: pings from the fake internet to the guest's mesh address go unanswered after the edit; within two reconcile intervals `drift_repairs_total` goes up, the sysctl is back at 0 and the pings are answered again |

use std::net::IpAddr;
use std::time::{Duration, Instant};

use vmnet_agent::api::types::AgentStatus;
use vmnet_agent::client::Client;
use vmnet_model::vm::VmConfig;

use super::checks::CheckResult;
use super::steps::VmRow;
use crate::{netns, traffic};

const CHECK: &str = "drift: IPv6 off on the host veth end";
const EXPECTED: &str = "cut off, then repaired by a pass";

async fn repairs(client: &Client) -> Result<(u64, u64), String> {
    let s: AgentStatus = client
        .get("/v1/status")
        .await
        .map_err(|e| format!("GET status: {}", e.message))?;
    Ok((s.reconcile.drift_repairs_total, s.reconcile_interval_secs))
}

async fn pongs(inet: &str, to: IpAddr, count: u32) -> Result<u32, String> {
    let inet = inet.to_owned();
    tokio::task::spawn_blocking(move || {
        traffic::ping(&inet, to, count, Duration::from_secs(2))
            .map(|p| p.received)
            .map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| e.to_string())?
}

/// Runs the check; `rows` give each VM's veth names (`host/ns`), `host_ns` is the sandbox host.
pub async fn run(
    client: &Client,
    inet: &str,
    host_ns: &str,
    vms: &[VmConfig],
    rows: &[VmRow],
) -> Vec<CheckResult> {
    let Some((vm, mesh, host_end)) = super::activity::checked(vms).into_iter().find_map(|vm| {
        let row = rows.iter().find(|r| r.vm == vm.id)?;
        let host_end = row.veth.split_once('/')?.0.to_owned();
        Some((vm, vm.mesh_ipv6?, host_end))
    }) else {
        return Vec::new();
    };
    let seen = check(client, inet, host_ns, IpAddr::V6(mesh), &host_end).await;
    let ok = seen.is_ok();
    vec![CheckResult {
        vm: vm.id.clone(),
        check: CHECK.into(),
        expected: EXPECTED.into(),
        seen: seen.unwrap_or_else(|e| e),
        ok,
    }]
}

/// The edit, the cut and the repair; `Ok` with what was seen, or `Err` with what went wrong.
async fn check(
    client: &Client,
    inet: &str,
    host_ns: &str,
    mesh: IpAddr,
    host_end: &str,
) -> Result<String, String> {
    let key = format!("net/ipv6/conf/{host_end}/disable_ipv6");
    let (before, interval) = repairs(client).await?;
    if pongs(inet, mesh, 1).await? == 0 {
        return Err("the guest's mesh address answered no ping before the edit".into());
    }
    netns::sysctl(host_ns, &key, "1").map_err(|e| e.to_string())?;
    let cut = pongs(inet, mesh, 2).await?;
    if cut > 0 {
        return Err(format!(
            "{cut}/2 pings answered with IPv6 off on {host_end}"
        ));
    }
    let deadline = Instant::now() + Duration::from_secs(2 * interval + 5);
    let mut after = before;
    while after == before && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        after = repairs(client).await?.0;
    }
    if after == before {
        return Err(format!(
            "no repair counted within {} s (drift_repairs_total {before})",
            2 * interval + 5
        ));
    }
    let value = netns::sysctl_get(host_ns, &key).map_err(|e| e.to_string())?;
    let answered = pongs(inet, mesh, 3).await?;
    if value != "0" || answered == 0 {
        return Err(format!(
            "repairs {before} → {after}, disable_ipv6 {value}, {answered}/3 pings answered"
        ));
    }
    Ok(format!(
        "cut off (0/2 pings), then repaired by a pass (drift_repairs_total {before} → {after}, {answered}/3 pings)"
    ))
}
