//! The drift checks of `vmnet-lab up --sandbox`: two hand edits that cut a VM off, each repaired
//! in place by the agent, which hears of them from the kernel's change notifications (the
//! reconcile pass is the backstop for a change the kernel does not tell). They run for the first
//! VM with a mesh address, an IPv6 route via host and no enabled firewall (the packet-activity
//! checks' VM, [`super::activity::checked`]). Each repair is read back from the agent's event
//! stream (`GET /v1/events?vm=…&kind=drift_repaired`, what `vmnet events` prints): the event
//! names what was repaired, where, and whether a notification or a pass found it; the status
//! counters must have moved too.
//!
//! | check | expected |
//! |---|---|
//! | `drift: IPv6 off on the host veth end` | `repaired, pings answered`: after a stray `sysctl -w net.ipv6.conf.<end>.disable_ipv6=1` on the VM's host veth end (it cuts the VM's IPv6 off without touching a link, an address or an nft table), within two reconcile intervals the sysctl is back at 0, `drift_repairs_total` has moved and a `drift_repaired` event names the VM, and pings from the fake internet to the guest's mesh address are answered; what was seen says whether a notification or a pass repaired it and how long that took |
//! | `drift: guest guard deleted by hand` | `repaired, echo answered`: after the guard's filter is deleted from the tap, within two reconcile intervals the tap's filter runs the guard again (a `drift_repaired` event names the VM) and the guest's IPv4 UDP echo to the fake internet is answered (that the namespace drops what the guard did not mark while the filter is gone is shown by the kernel tests: repaired on its notification, the gap is too short to probe here) |

use std::net::IpAddr;
use std::time::{Duration, Instant};

use vmnet_agent::api::types::AgentStatus;
use vmnet_agent::client::{Client, segment};
use vmnet_agent::events::{Event, EventBody, Trigger};
use vmnet_model::vm::VmConfig;

use super::checks::CheckResult;
use super::steps::VmRow;
use crate::{netns, traffic};

const CHECK: &str = "drift: IPv6 off on the host veth end";
const EXPECTED: &str = "repaired, pings answered";
const GUARD_CHECK: &str = "drift: guest guard deleted by hand";
const GUARD_EXPECTED: &str = "repaired, echo answered";

/// How often a check looks whether its edit was repaired.
const POLL: Duration = Duration::from_millis(25);

/// The agent's repair counters, and the last drift event of the checked VM.
struct Counters {
    drift: u64,
    interval: u64,
    /// The sequence number of the VM's last `drift_repaired` event (0: none kept).
    seq: u64,
}

/// The VM's `drift_repaired` events after sequence number `since`.
async fn drift_events(client: &Client, vm: &str, since: u64) -> Result<Vec<Event>, String> {
    let q = format!("kind=drift_repaired&vm={}&since={since}", segment(vm));
    client
        .recent_events(&q)
        .await
        .map_err(|e| format!("GET events: {}", e.message))
}

async fn counters(client: &Client, vm: &str) -> Result<Counters, String> {
    let seq = drift_events(client, vm, 0)
        .await?
        .last()
        .map_or(0, |e| e.seq);
    let s: AgentStatus = client
        .get("/v1/status")
        .await
        .map_err(|e| format!("GET status: {}", e.message))?;
    Ok(Counters {
        drift: s.reconcile.drift_repairs_total,
        interval: s.reconcile_interval_secs,
        seq,
    })
}

/// Waits until `done` says the edit is undone, `drift_repairs_total` has moved past
/// `before`'s and a `drift_repaired` event of VM `vm` came after `before`'s; how long that
/// took and what repaired it (a notification or a pass, with the event), or why not within two
/// reconcile intervals.
async fn repaired(
    client: &Client,
    vm: &str,
    before: &Counters,
    mut done: impl FnMut() -> Result<bool, String>,
) -> Result<(Duration, String), String> {
    let start = Instant::now();
    let limit = Duration::from_secs(2 * before.interval + 5);
    loop {
        if done()? {
            let now = counters(client, vm).await?;
            let events = drift_events(client, vm, before.seq).await?;
            if now.drift > before.drift
                && let Some(e) = events.first()
            {
                let by = match &e.body {
                    EventBody::DriftRepaired {
                        objects,
                        netns,
                        trigger,
                        ..
                    } => {
                        let by = if *trigger == Trigger::Notification {
                            "its notification"
                        } else {
                            "a pass"
                        };
                        format!("{by} (event {}: {} in {netns})", e.seq, objects.join(", "))
                    }
                    _ => "an event of another kind".to_owned(),
                };
                return Ok((start.elapsed(), by));
            }
        }
        if start.elapsed() > limit {
            return Err(format!("not repaired within {} s", limit.as_secs()));
        }
        tokio::time::sleep(POLL).await;
    }
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

/// Runs the checks; `rows` give each VM's veth names (`host/ns`), `host_ns` is the sandbox host.
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
    let result = |check: &str, expected: &str, seen: Result<String, String>| CheckResult {
        vm: vm.id.clone(),
        check: check.into(),
        expected: expected.into(),
        ok: seen.is_ok(),
        seen: seen.unwrap_or_else(|e| e),
    };
    let seen = ipv6_off(client, &vm.id, inet, host_ns, IpAddr::V6(mesh), &host_end).await;
    let mut out = vec![result(CHECK, EXPECTED, seen)];
    if vm.ipv4_via_host() {
        let guard = Guard {
            vm: vm.id.clone(),
            vm_ns: row.netns.clone(),
            tap: row.tap.clone(),
            guest_ns: row.guest_ns.clone(),
        };
        out.push(result(
            GUARD_CHECK,
            GUARD_EXPECTED,
            guard.check(client).await,
        ));
    }
    out
}

/// The IPv6 edit and its repair; what was seen, or what went wrong.
async fn ipv6_off(
    client: &Client,
    vm: &str,
    inet: &str,
    host_ns: &str,
    mesh: IpAddr,
    host_end: &str,
) -> Result<String, String> {
    let key = format!("net/ipv6/conf/{host_end}/disable_ipv6");
    if pongs(inet, mesh, 1).await? == 0 {
        return Err("the guest's mesh address answered no ping before the edit".into());
    }
    let before = counters(client, vm).await?;
    netns::sysctl(host_ns, &key, "1").map_err(|e| e.to_string())?;
    let read = || {
        netns::sysctl_get(host_ns, &key)
            .map(|v| v == "0")
            .map_err(|e| e.to_string())
    };
    let (took, by) = repaired(client, vm, &before, read).await?;
    let answered = pongs(inet, mesh, 3).await?;
    if answered == 0 {
        return Err(format!(
            "disable_ipv6 back at 0 by {by}, but 0/3 pings answered"
        ));
    }
    Ok(format!(
        "repaired by {by} in {} ms, {answered}/3 pings answered",
        took.as_millis()
    ))
}

/// The VM whose guest guard is deleted by hand.
struct Guard {
    vm: String,
    vm_ns: String,
    tap: String,
    guest_ns: String,
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

    /// Deletes the filter by hand, waits for its repair, then sends the guest's echo.
    async fn check(&self, client: &Client) -> Result<String, String> {
        if !self.echo().await? {
            return Err("the guest's echo was not answered before the edit".into());
        }
        let before = counters(client, &self.vm).await?;
        let (ns, tap) = (self.vm_ns.clone(), self.tap.clone());
        vmnet_kernel::netns::run_in(&ns, move || vmnet_kernel::guard::detach_here(&tap))
            .map_err(|e| e.to_string())
            .and_then(|r| r.map_err(|e| e.to_string()))
            .map_err(|e| format!("deleting the guard's filter: {e}"))?;
        let (took, by) = repaired(client, &self.vm, &before, || self.listed()).await?;
        if !self.echo().await? {
            return Err(format!(
                "the guard's filter is back by {by}, but the guest's echo is unanswered"
            ));
        }
        Ok(format!(
            "repaired by {by} in {} ms, echo answered",
            took.as_millis()
        ))
    }
}
