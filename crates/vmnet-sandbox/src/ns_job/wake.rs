//! The wake-on-packet checks of `vmnet-lab up --sandbox`: a VM of its own (a copy of the first
//! VM the activity checks use, with its own id, user id and mesh address) whose simulated
//! guest's relay stands in for the VMM and is attached and detached at will; a client in the
//! fake internet connects to the guest's mesh address while the VM sleeps.
//!
//! | check | expected |
//! |---|---|
//! | `wake: the first SYN is held and delivered` | a `vm_wake` event for the connection; the relay attached 200 ms later; the connection established with no SYN retransmission, and served |
//! | `wake: held frames expire and a later SYN wakes again` | with the VMM away past the hold time (3 s): frames counted as expired, a second `vm_wake`, and the connection established once the relay attaches |

use std::fs::File;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use vmnet_agent::activity::VmActivity;
use vmnet_agent::client::{Client, segment};
use vmnet_agent::events::EventBody;
use vmnet_agent::status::VmView;
use vmnet_model::vm::VmConfig;

use super::checks::CheckResult;
use crate::echo::EchoService;
use crate::relay::Relay;
use crate::tap::Framing;
use crate::{netns, tap};

/// The hold time the sandbox's agent runs with (`--wake-hold-secs`).
pub const HOLD_SECS: u64 = 3;
/// The guest port the client connects to.
const PORT: u16 = 7002;
/// How long after the wake event the relay attaches.
const ATTACH_AFTER: Duration = Duration::from_millis(200);
const VM_ID: &str = "wake";

/// One connection from the fake internet: how long `connect()` took, the SYNs retransmitted,
/// and whether the echo answered.
#[derive(Debug)]
pub(super) struct Connected {
    /// From `connect()` to established.
    pub took: Duration,
    /// The client's retransmissions (`tcpi_total_retrans`): SYNs, before established.
    pub retrans: u32,
    /// Whether the service answered.
    pub served: bool,
}

/// Connects from `inet` to `to`, sends a line and reads the answer.
pub(super) fn connect(inet: &str, to: SocketAddr, timeout: Duration) -> Result<Connected, String> {
    netns::run_in(inet, move || -> std::io::Result<Connected> {
        let t = Instant::now();
        let mut s = TcpStream::connect_timeout(&to, timeout)?;
        let took = t.elapsed();
        let retrans = crate::traffic::retransmits(&s)?;
        s.set_read_timeout(Some(timeout))?;
        s.write_all(b"wake\n")?;
        let mut out = [0u8; 256];
        let served = s.read(&mut out).is_ok_and(|n| n > 0);
        Ok(Connected {
            took,
            retrans,
            served,
        })
    })
    .map_err(|e| e.to_string())?
    .map_err(|e| format!("connect to {to}: {e}"))
}

/// The `vm_wake` events of `vm` after sequence `after`, with their sequence numbers.
pub(super) async fn wakes(client: &Client, vm: &str, after: u64) -> Vec<u64> {
    client
        .recent_events(&format!("kind=vm_wake&vm={}", segment(vm)))
        .await
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e.seq > after && matches!(e.body, EventBody::VmWake { .. }))
        .map(|e| e.seq)
        .collect()
}

/// Waits up to `max` for a `vm_wake` of `vm` after `after`; its sequence number and when it
/// was seen.
pub(super) async fn wait_wake(
    client: &Client,
    vm: &str,
    after: u64,
    max: Duration,
) -> Option<(u64, Instant)> {
    let t = Instant::now();
    while t.elapsed() < max {
        if let Some(s) = wakes(client, vm, after).await.first() {
            return Some((*s, Instant::now()));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    None
}

/// The wake counters of `vm`.
pub(super) async fn counters(
    client: &Client,
    vm: &str,
) -> Option<vmnet_agent::wake::hold::Counters> {
    let a: VmActivity = client
        .get(&format!("/v1/vms/{}/activity", segment(vm)))
        .await
        .ok()?;
    a.wake
}

/// The VM's own guest: its namespace, the guest tap (kept open, so detaching the relay leaves
/// the guest configured) and the VM's tap in its namespace.
struct Guest {
    ns: String,
    eth0: File,
    vm_ns: String,
    vm_tap: String,
}

impl Guest {
    fn attach(&self) -> Result<Relay, String> {
        let vm = tap::open_existing_tap_with(&self.vm_ns, &self.vm_tap, Framing::VirtioNet)
            .map_err(|e| e.to_string())?;
        let g = self.eth0.try_clone().map_err(|e| e.to_string())?;
        Relay::between(vm, g).map_err(|e| e.to_string())
    }
}

async fn setup(
    client: &Client,
    prefix: &str,
    vms: &[VmConfig],
) -> Result<(Guest, Ipv6Addr), String> {
    let template = super::activity::checked(vms)
        .first()
        .map(|v| (*v).clone())
        .ok_or("no VM with a mesh address and an IPv6 route via host to copy")?;
    let mut cfg = template;
    let uid = vms.iter().map(|v| v.user_id).max().unwrap_or(0) + 1;
    let base = cfg.mesh_ipv6.ok_or("no mesh address")?.segments();
    let mesh = Ipv6Addr::new(
        base[0], base[1], base[2], base[3], base[4], base[5], 0xbeef, 0xfeed,
    );
    if vms.iter().any(|v| v.mesh_ipv6 == Some(mesh)) {
        return Err(format!("{mesh} is taken"));
    }
    cfg.id = VM_ID.to_owned();
    cfg.user_id = uid;
    cfg.mesh_ipv6 = Some(mesh);
    cfg.public_ipv4 = None;
    cfg.public_ipv6 = None;
    let view: VmView = client
        .put(&format!("/v1/vms/{VM_ID}"), &cfg)
        .await
        .map_err(|e| format!("PUT: {}", e.message))?;
    let ns = format!("{prefix}g{uid:04x}");
    netns::create(&ns).map_err(|e| e.to_string())?;
    let eth0 = tap::create_tap(&ns, crate::guest::GUEST_IF, Framing::VirtioNet)
        .map_err(|e| e.to_string())?;
    let gcfg = super::steps::guest_config(&view).map_err(|e| e.message)?;
    crate::guest::configure(&ns, crate::guest::GUEST_IF, &gcfg).map_err(|e| e.to_string())?;
    Ok((
        Guest {
            ns,
            eth0,
            vm_ns: view.status.netns.clone(),
            vm_tap: view.status.tap.clone(),
        },
        mesh,
    ))
}

/// Runs the checks (see the module docs).
pub async fn run(client: &Client, inet: &str, prefix: &str, vms: &[VmConfig]) -> Vec<CheckResult> {
    let result = |check: &str, expected: &str, seen: String, ok: bool| CheckResult {
        vm: VM_ID.into(),
        check: check.into(),
        expected: expected.into(),
        seen,
        ok,
    };
    const FIRST: &str = "wake: the first SYN is held and delivered";
    const FIRST_WANT: &str =
        "vm_wake, relay attached 200 ms later, established with 0 SYN retransmissions, served";
    const AGAIN: &str = "wake: held frames expire and a later SYN wakes again";
    const AGAIN_WANT: &str = "expired frames counted, a second vm_wake, established once attached";
    if super::activity::checked(vms).is_empty() {
        // Nothing to copy: the spec has no VM the fake internet reaches over the mesh.
        return Vec::new();
    }
    let (guest, mesh) = match setup(client, prefix, vms).await {
        Ok(g) => g,
        Err(e) => {
            let _ = client
                .delete::<serde_json::Value>(&format!("/v1/vms/{VM_ID}"))
                .await;
            return vec![result(FIRST, FIRST_WANT, format!("set-up: {e}"), false)];
        }
    };
    let target = SocketAddr::new(IpAddr::V6(mesh), PORT);
    let mut out = Vec::new();
    match EchoService::start(&guest.ns, &[target]) {
        Err(e) => out.push(result(FIRST, FIRST_WANT, format!("guest echo: {e}"), false)),
        Ok(svc) => {
            out.push(first(client, inet, &guest, target).await.map_or_else(
                |e| result(FIRST, FIRST_WANT, e, false),
                |(seen, ok)| result(FIRST, FIRST_WANT, seen, ok),
            ));
            out.push(again(client, inet, &guest, target).await.map_or_else(
                |e| result(AGAIN, AGAIN_WANT, e, false),
                |(seen, ok)| result(AGAIN, AGAIN_WANT, seen, ok),
            ));
            drop(svc);
        }
    }
    let ns = guest.ns.clone();
    drop(guest);
    let _ = netns::delete(&ns);
    let _ = client
        .delete::<serde_json::Value>(&format!("/v1/vms/{VM_ID}"))
        .await;
    out
}

async fn first(
    client: &Client,
    inet: &str,
    guest: &Guest,
    target: SocketAddr,
) -> Result<(String, bool), String> {
    let before = wakes(client, VM_ID, 0).await.last().copied().unwrap_or(0);
    let inet_owned = inet.to_owned();
    let t0 = Instant::now();
    let conn =
        tokio::task::spawn_blocking(move || connect(&inet_owned, target, Duration::from_secs(10)));
    let Some((_, seen_at)) = wait_wake(client, VM_ID, before, Duration::from_secs(5)).await else {
        let _relay = guest.attach();
        let _ = conn.await;
        return Err("no vm_wake within 5 s of connect()".into());
    };
    tokio::time::sleep(ATTACH_AFTER.saturating_sub(seen_at.elapsed())).await;
    let attached = Instant::now();
    let relay = guest.attach()?;
    let c = conn.await.map_err(|e| e.to_string())??;
    drop(relay);
    let wake_ms = seen_at.duration_since(t0).as_millis();
    let after_attach = c.took.saturating_sub(attached.duration_since(t0));
    let ok = c.retrans == 0 && c.served;
    Ok((
        format!(
            "vm_wake {wake_ms} ms after connect(); established {} ms after connect(), {} ms after the attach; {} SYN retransmissions; {}",
            c.took.as_millis(),
            after_attach.as_millis(),
            c.retrans,
            if c.served { "served" } else { "not served" }
        ),
        ok,
    ))
}

async fn again(
    client: &Client,
    inet: &str,
    guest: &Guest,
    target: SocketAddr,
) -> Result<(String, bool), String> {
    // The relay is detached: the VM sleeps. Let the carrier go.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let expired_before = counters(client, VM_ID)
        .await
        .map_or(0, |c| c.dropped_expired);
    let before = wakes(client, VM_ID, 0).await.last().copied().unwrap_or(0);
    let inet_owned = inet.to_owned();
    let conn =
        tokio::task::spawn_blocking(move || connect(&inet_owned, target, Duration::from_secs(15)));
    let Some((first, _)) = wait_wake(client, VM_ID, before, Duration::from_secs(5)).await else {
        let _relay = guest.attach();
        let _ = conn.await;
        return Err("no vm_wake within 5 s of connect()".into());
    };
    // Past the hold time, and until a retransmitted SYN woke the VM again.
    tokio::time::sleep(Duration::from_secs(HOLD_SECS) + Duration::from_millis(300)).await;
    let woke = wait_wake(client, VM_ID, first, Duration::from_secs(8)).await;
    let expired = counters(client, VM_ID)
        .await
        .map_or(0, |c| c.dropped_expired)
        - expired_before;
    let relay = guest.attach()?;
    let c = conn.await.map_err(|e| e.to_string())??;
    drop(relay);
    let ok = expired > 0 && woke.is_some() && c.served;
    Ok((
        format!(
            "{expired} held frames expired; {}; established after {} ms with {} SYN retransmissions; {}",
            if woke.is_some() {
                "a second vm_wake"
            } else {
                "no second vm_wake"
            },
            c.took.as_millis(),
            c.retrans,
            if c.served { "served" } else { "not served" }
        ),
        ok,
    ))
}
