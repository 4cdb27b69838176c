//! The packet-activity checks of `vmnet-lab up --sandbox`: per VM with a mesh address, an IPv6 route
//! via host and no enabled firewall, traffic from the fake internet to its simulated guest, with
//! `GET /v1/vms/{id}/activity` read before and after.
//!
//! | check | expected |
//! |---|---|
//! | `activity: ping and UDP from the internet` | `not moved`: ICMPv6 echoes (and the NDP they cause) and a UDP echo to the guest's mesh address leave `last_activity` as it was |
//! | `activity: TCP from the internet` | `moved`: a TCP echo to the guest's mesh address sets `last_activity` to a later time |
//!
//! No earlier check's traffic reaches the quiet window: before it, every TCP socket that is not
//! listening in the guest and in the fake internet is closed (`ss -K`), and the window opens only
//! once `last_activity` has stayed the same for [`SETTLE`] (a late segment of an earlier
//! connection, or the reset that closing it sends, lands before that).

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use vmnet_agent::activity::VmActivity;
use vmnet_agent::client::{Client, segment};
use vmnet_model::vm::VmConfig;

use super::checks::CheckResult;
use crate::echo::EchoService;
use crate::{netns, traffic};

/// The guest port of the echo service the checks connect to.
const PORT: u16 = 7001;
const WAIT: Duration = Duration::from_secs(5);
/// How long `last_activity` must stay the same before the quiet window opens.
pub const SETTLE: Duration = Duration::from_millis(1500);
/// How long the check waits for the activity to settle at most.
const SETTLE_MAX: Duration = Duration::from_secs(30);

/// The VMs the checks apply to.
#[must_use]
pub fn checked(vms: &[VmConfig]) -> Vec<&VmConfig> {
    vms.iter()
        .filter(|v| {
            v.mesh_ipv6.is_some()
                && v.ipv6_via_host()
                && !v.firewall.as_ref().is_some_and(|f| f.enabled)
        })
        .collect()
}

async fn last(client: &Client, id: &str) -> Result<Option<String>, String> {
    let a: VmActivity = client
        .get(&format!("/v1/vms/{}/activity", segment(id)))
        .await
        .map_err(|e| format!("GET activity: {}", e.message))?;
    Ok(a.last_activity)
}

/// Closes every TCP socket that is not listening in namespace `ns` (the kernel resets them), so
/// no earlier connection sends anything later.
fn close_connections(ns: &str) -> Result<(), String> {
    let out = netns::exec(ns, "ss", &["-K", "-t", "-n"], WAIT).map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ss -K in {ns}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Closes earlier connections to and from the guest, then waits until the VM's `last_activity`
/// has stayed the same for [`SETTLE`]; that value.
async fn settled(
    client: &Client,
    id: &str,
    inet: &str,
    guest_ns: &str,
) -> Result<Option<String>, String> {
    let (i, g) = (inet.to_owned(), guest_ns.to_owned());
    tokio::task::spawn_blocking(move || close_connections(&g).and_then(|()| close_connections(&i)))
        .await
        .map_err(|e| e.to_string())??;
    let start = tokio::time::Instant::now();
    let mut seen = last(client, id).await?;
    loop {
        tokio::time::sleep(SETTLE).await;
        let now = last(client, id).await?;
        if now == seen {
            return Ok(now);
        }
        if start.elapsed() > SETTLE_MAX {
            return Err(format!("last_activity still moving after {SETTLE_MAX:?}"));
        }
        seen = now;
    }
}

/// Runs the checks; `guests` maps a VM id to its guest namespace.
pub async fn run(
    client: &Client,
    inet: &str,
    vms: &[VmConfig],
    guests: &[(String, String)],
) -> Vec<CheckResult> {
    let mut out = Vec::new();
    for vm in checked(vms) {
        let (Some((_, guest_ns)), Some(mesh)) =
            (guests.iter().find(|(id, _)| *id == vm.id), vm.mesh_ipv6)
        else {
            continue;
        };
        let target = SocketAddr::new(IpAddr::V6(mesh), PORT);
        let result = |check: &str, expected: &str, seen: String, ok: bool| CheckResult {
            vm: vm.id.clone(),
            check: check.into(),
            expected: expected.into(),
            seen,
            ok,
        };
        let svc = match EchoService::start(guest_ns, &[target]) {
            Ok(s) => s,
            Err(e) => {
                out.push(result(
                    "activity: TCP from the internet",
                    "moved",
                    format!("guest echo: {e}"),
                    false,
                ));
                continue;
            }
        };
        let before = settled(client, &vm.id, inet, guest_ns).await;
        let inet_owned = inet.to_owned();
        let quiet = tokio::task::spawn_blocking(move || {
            let p =
                traffic::ping(&inet_owned, IpAddr::V6(mesh), 3, WAIT).map_err(|e| e.to_string())?;
            traffic::udp_echo(&inet_owned, target, WAIT).map_err(|e| e.to_string())?;
            Ok::<_, String>(p.received)
        })
        .await
        .unwrap_or_else(|e| Err(e.to_string()));
        let after_quiet = last(client, &vm.id).await;
        out.push(match (&before, &quiet, &after_quiet) {
            (Ok(b), Ok(pongs), Ok(a)) => result(
                "activity: ping and UDP from the internet",
                "not moved",
                format!(
                    "{} ({pongs}/3 pings answered, UDP echoed)",
                    if a == b { "not moved" } else { "moved" }
                ),
                a == b && *pongs > 0,
            ),
            (b, q, a) => result(
                "activity: ping and UDP from the internet",
                "not moved",
                format!("{b:?} / {q:?} / {a:?}"),
                false,
            ),
        });
        let inet_owned = inet.to_owned();
        let tcp = tokio::task::spawn_blocking(move || {
            traffic::tcp_echo(&inet_owned, target, WAIT).map_err(|e| e.to_string())
        })
        .await
        .unwrap_or_else(|e| Err(e.to_string()));
        let after_tcp = last(client, &vm.id).await;
        out.push(match (&after_quiet, &tcp, &after_tcp) {
            (Ok(b), Ok(_), Ok(a)) => {
                let moved = a.is_some() && a > b;
                result(
                    "activity: TCP from the internet",
                    "moved",
                    format!(
                        "{} (last_activity {})",
                        if moved { "moved" } else { "not moved" },
                        a.as_deref().unwrap_or("null")
                    ),
                    moved,
                )
            }
            (b, t, a) => result(
                "activity: TCP from the internet",
                "moved",
                format!("{b:?} / {:?} / {a:?}", t.as_ref().map(|_| "echoed")),
                false,
            ),
        });
        drop(svc);
    }
    out
}
