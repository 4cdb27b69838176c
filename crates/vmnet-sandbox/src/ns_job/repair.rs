//! The drift check of `vmnet-lab up --sandbox`: IPv6 turned off by hand on a VM's host veth end (a
//! stray `sysctl -w net.ipv6.conf.<end>.disable_ipv6=1`), which cuts the VM's IPv6 off without
//! touching a link, an address or an nft table, and the agent's next full reconcile pass
//! repairing it in place. It runs for the first VM with a mesh address, an IPv6 route via host
//! and no enabled firewall (the packet-activity checks' VM, [`super::activity::checked`]).
//!
//! In the same pass window, the VM's guest guard is deleted from its tap by hand.
//!
//! | check | expected |
//! |---|---|
//! | `drift: IPv6 off on the host veth end` | `cut off, then repaired by a pass`: pings from the fake internet to the guest's mesh address go unanswered after the edit; within two reconcile intervals `drift_repairs_total` goes up, the sysctl is back at 0 and the pings are answered again |
//! | `drift: guest guard deleted by hand` | `fails closed, then repaired by a pass`: without the guard the guest's IPv4 UDP echo gets no reply (the namespace drops what the guard did not mark); after the pass the tap's filter runs the guard again and the echo is answered |

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
const GUARD_CHECK: &str = "drift: guest guard deleted by hand";
const GUARD_EXPECTED: &str = "fails closed, then repaired by a pass";

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
    let Some((vm, mesh, host_end, row)) =
        super::activity::checked(vms).into_iter().find_map(|vm| {
            let row = rows.iter().find(|r| r.vm == vm.id)?;
            let host_end = row.veth.split_once('/')?.0.to_owned();
            Some((vm, vm.mesh_ipv6?, host_end, row))
        })
    else {
        return Vec::new();
    };
    let guard = Guard {
        vm_ns: row.netns.clone(),
        tap: row.tap.clone(),
        guest_ns: row.guest_ns.clone(),
        v4: vm.ipv4_via_host(),
        cut: None,
    };
    let (seen, guard_seen) = check(client, inet, host_ns, IpAddr::V6(mesh), &host_end, guard).await;
    let result = |check: &str, expected: &str, seen: Result<String, String>| CheckResult {
        vm: vm.id.clone(),
        check: check.into(),
        expected: expected.into(),
        ok: seen.is_ok(),
        seen: seen.unwrap_or_else(|e| e),
    };
    let mut out = vec![result(CHECK, EXPECTED, seen)];
    if let Some(g) = guard_seen {
        out.push(result(GUARD_CHECK, GUARD_EXPECTED, g));
    }
    out
}

/// The VM whose guest guard is deleted by hand meanwhile, and what was seen without it.
struct Guard {
    vm_ns: String,
    tap: String,
    guest_ns: String,
    /// Whether the VM has an IPv4 route via host (the echo the check sends needs one).
    v4: bool,
    /// What was seen while it was gone: `Ok` when the guest's echo went unanswered.
    cut: Option<Result<(), String>>,
}

impl Guard {
    /// Whether the guest's IPv4 UDP echo to the fake internet is answered.
    async fn echo(&self) -> Result<bool, String> {
        let ns = self.guest_ns.clone();
        tokio::task::spawn_blocking(move || {
            let to = std::net::SocketAddr::new(
                crate::sandbox::ECHO_V4.into(),
                crate::sandbox::ECHO_PORT,
            );
            traffic::try_udp_echo(&ns, to, Duration::from_secs(1))
                .map(|r| r.is_some())
                .map_err(|e| e.to_string())
        })
        .await
        .map_err(|e| e.to_string())?
    }

    /// Whether the tap's filter runs the guard.
    fn listed(&self) -> Result<bool, String> {
        let out = netns::exec(
            &self.vm_ns,
            "tc",
            &["filter", "show", "dev", &self.tap, "ingress"],
            Duration::from_secs(5),
        )
        .map_err(|e| e.to_string())?;
        Ok(String::from_utf8_lossy(&out.stdout).contains(vmnet_plan::ns::guard::PROGRAM))
    }

    /// Deletes the filter by hand, then checks the guest's echo goes unanswered. A reconcile
    /// pass may put the filter back meanwhile (the echo is then answered with the guard on):
    /// up to three tries.
    async fn delete(&mut self) {
        let mut seen = Err("not tried".to_owned());
        for _ in 0..3 {
            let (ns, tap) = (self.vm_ns.clone(), self.tap.clone());
            let deleted =
                vmnet_kernel::netns::run_in(&ns, move || vmnet_kernel::guard::detach_here(&tap))
                    .map_err(|e| e.to_string())
                    .and_then(|r| r.map_err(|e| e.to_string()));
            if let Err(e) = deleted {
                seen = Err(format!("deleting the guard's filter: {e}"));
                break;
            }
            seen = match (self.echo().await, self.listed()) {
                (Ok(false), _) => Ok(()),
                (Ok(true), Ok(true)) => continue, // repaired meanwhile: try again
                (Ok(true), Ok(false)) => {
                    Err("the guest's echo was answered without the guard".into())
                }
                (Err(e), _) | (_, Err(e)) => Err(e),
            };
            break;
        }
        self.cut = Some(seen);
    }

    /// After the pass: the tap's filter runs the guard and the echo is answered again.
    async fn repaired(&self) -> Result<String, String> {
        self.cut.clone().unwrap_or(Err("not deleted".into()))?;
        let listed = self.listed()?;
        let answered = self.echo().await?;
        if !(listed && answered) {
            return Err(format!(
                "after the pass: guard filter {}, echo {}",
                if listed { "back" } else { "missing" },
                if answered { "answered" } else { "unanswered" }
            ));
        }
        Ok(
            "fails closed (echo unanswered), then repaired by a pass (filter back, echo answered)"
                .into(),
        )
    }
}

/// The edit, the cut and the repair; `Ok` with what was seen, or `Err` with what went wrong.
/// The IPv6 check's outcome and, for a VM with an IPv4 route via host, the guard's.
type Outcomes = (Result<String, String>, Option<Result<String, String>>);

async fn check(
    client: &Client,
    inet: &str,
    host_ns: &str,
    mesh: IpAddr,
    host_end: &str,
    mut guard: Guard,
) -> Outcomes {
    let with_guard = guard.v4;
    let seen = check_ipv6(client, inet, host_ns, mesh, host_end, &mut guard).await;
    let guard_seen = match &seen {
        Ok(_) => guard.repaired().await,
        Err(_) => Err("the pass did not run (see the IPv6 check)".into()),
    };
    (seen, with_guard.then_some(guard_seen))
}

async fn check_ipv6(
    client: &Client,
    inet: &str,
    host_ns: &str,
    mesh: IpAddr,
    host_end: &str,
    guard: &mut Guard,
) -> Result<String, String> {
    let key = format!("net/ipv6/conf/{host_end}/disable_ipv6");
    let read = || netns::sysctl_get(host_ns, &key).map_err(|e| e.to_string());
    if pongs(inet, mesh, 1).await? == 0 {
        return Err("the guest's mesh address answered no ping before the edit".into());
    }
    // The guard goes too (its own check): a pass may repair it before the IPv6 edit, so the
    // repair below waits for the sysctl itself, not only for the counter.
    if guard.v4 {
        guard.delete().await;
    }
    // A pass that runs between the edit and the pings repairs it before they are sent: an
    // answered ping counts against vmnet only while the sysctl is still off; otherwise the
    // edit is made again (up to three tries).
    let mut tries = 0;
    let (before, interval) = loop {
        tries += 1;
        let (before, interval) = repairs(client).await?;
        netns::sysctl(host_ns, &key, "1").map_err(|e| e.to_string())?;
        let cut = pongs(inet, mesh, 2).await?;
        if cut == 0 {
            break (before, interval);
        }
        if read()? != "0" {
            return Err(format!(
                "{cut}/2 pings answered with IPv6 off on {host_end}"
            ));
        }
        if tries == 3 {
            return Err(format!(
                "a pass repaired {host_end} before the pings in each of {tries} tries"
            ));
        }
    };
    let deadline = Instant::now() + Duration::from_secs(2 * interval + 5);
    let (mut after, mut value) = (before, read()?);
    while (after == before || value != "0") && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        after = repairs(client).await?.0;
        value = read()?;
    }
    if after == before || value != "0" {
        return Err(format!(
            "not repaired within {} s (drift_repairs_total {before} → {after}, disable_ipv6 {value})",
            2 * interval + 5
        ));
    }
    let answered = pongs(inet, mesh, 3).await?;
    if answered == 0 {
        return Err(format!(
            "repairs {before} → {after}, disable_ipv6 {value}, {answered}/3 pings answered"
        ));
    }
    Ok(format!(
        "cut off (0/2 pings), then repaired by a pass (drift_repairs_total {before} → {after}, {answered}/3 pings)"
    ))
}
