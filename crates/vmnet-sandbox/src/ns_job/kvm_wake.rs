//! Wake on packet with a real guest: one guest's qemu is put to sleep the way a platform does
//! it (its state saved to a file over QMP, qemu quit: the tap has no VMM), a client in the fake
//! internet connects to the guest's public IPv4 address (the guest's echo service), and on the
//! `vm_wake` event for that connection qemu is started again on the same tap and MAC, restoring
//! the saved state ([`crate::kvm::snapshot`]). The agent holds the SYN while qemu is down and
//! delivers it when qemu opens the tap; qemu reads it once the guest runs.
//!
//! | check | expected |
//! |---|---|
//! | `wake: the first SYN sent while qemu was down reaches the restored guest` | a `vm_wake` event; the state restored; held frames delivered when qemu opened the tap; the connection established and served |
//!
//! What it saw is in the check's `seen`: the save (time, size), the times from `connect()` to
//! the wake event, to qemu's start, to the guest running and to established, the frames
//! delivered and the client's SYN retransmissions. The sandbox's agent runs real guests with
//! `--wake-deliver first-frame` (qemu drops what reached the tap while it was starting up; a
//! restored guest announces itself at once), so the held SYN reaches the running guest and no
//! retransmission is needed; the count is reported, not checked (a loaded host may be slower
//! than the client's 1 s timer). A restore slower than the hold time (3 s) lets the held SYN
//! expire (counted), which is reported too.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use vmnet_agent::client::Client;
use vmnet_model::vm::VmConfig;

use super::checks::CheckResult;
use super::steps::VmRow;
use super::wake::{self, HOLD_SECS};
use crate::kvm::ns::NsGuest;
use crate::sandbox::ECHO_PORT;
use crate::state::{Paths, SandboxState};

/// The check's name.
pub const CHECK: &str = "wake: the first SYN sent while qemu was down reaches the restored guest";
const EXPECTED: &str =
    "vm_wake, state restored, held frames delivered when qemu opened the tap, established, served";
/// How long saving and loading the state may take (TCG on a loaded host).
const STATE_WAIT: Duration = Duration::from_secs(120);
/// How long the client's `connect()` may take (SYN retransmissions included).
const CONNECT_WAIT: Duration = Duration::from_secs(150);

/// The VM the check puts to sleep: the first with a public IPv4 address, an IPv4 route via
/// host and no firewall.
#[must_use]
pub fn pick(vms: &[VmConfig]) -> Option<usize> {
    vms.iter().position(|v| {
        v.public_ipv4.is_some()
            && v.ipv4_via_host()
            && !v.firewall.as_ref().is_some_and(|f| f.enabled)
    })
}

fn ms(d: Duration) -> u128 {
    d.as_millis()
}

/// Runs the check (see the module docs) and leaves the restored guest running, its new pid in
/// the state file and in `rows`, its command channel open again.
pub(super) async fn run(
    client: &Client,
    inet: &str,
    (paths, st): (&Paths, &mut SandboxState),
    vms: &[VmConfig],
    guests: &mut [NsGuest],
    rows: &mut [VmRow],
) -> Vec<CheckResult> {
    let Some(vm) = pick(vms).map(|i| &vms[i]) else {
        return Vec::new();
    };
    let (Some(g), Some(ip)) = (guests.iter_mut().find(|g| g.id == vm.id), vm.public_ipv4) else {
        return Vec::new();
    };
    let id = vm.id.clone();
    let began = Instant::now();
    let result = |seen: String, ok: bool| {
        eprintln!(
            "{id}: wake with a restored guest took {:.1} s",
            began.elapsed().as_secs_f64()
        );
        vec![CheckResult {
            vm: id.clone(),
            check: CHECK.into(),
            expected: EXPECTED.into(),
            seen,
            ok,
        }]
    };
    let file = paths.dir.join("vms").join(&id).join("saved-state");
    g.ch = None;
    let saved = match tokio::task::block_in_place(|| g.vm.save_and_quit(&file, STATE_WAIT)) {
        Ok(s) => s,
        Err(e) => return result(format!("save: {}", e.message), false),
    };
    // The tap's queue is deactivated as qemu closes it; give the agent a moment all the same.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let before = wake::wakes(client, &id, 0)
        .await
        .last()
        .copied()
        .unwrap_or(0);
    let was = wake::counters(client, &id).await.unwrap_or_default();
    let target = SocketAddr::new(IpAddr::V4(ip), ECHO_PORT);
    let inet_owned = inet.to_owned();
    let t0 = Instant::now();
    let conn =
        tokio::task::spawn_blocking(move || wake::connect(&inet_owned, target, CONNECT_WAIT));
    let woke = wake::wait_wake(client, &id, before, Duration::from_secs(10)).await;
    // Woken or not, the guest comes back (the sandbox stays up with it).
    let restored = tokio::task::block_in_place(|| g.vm.restore(&file, STATE_WAIT));
    let _ = std::fs::remove_file(&file);
    let conn = conn.await.map_err(|e| e.to_string()).and_then(|r| r);
    let now = wake::counters(client, &id).await.unwrap_or_default();
    let pid = g.vm.pid();
    if let Some(p) = st.procs.iter_mut().find(|p| p.role == format!("qemu {id}")) {
        p.pid = pid;
    }
    let _ = paths.save(st);
    if let Some(r) = rows.iter_mut().find(|r| r.vm == id) {
        r.guest_ns = format!("qemu {pid}");
    }
    let channel = tokio::task::block_in_place(|| g.vm.channel(STATE_WAIT));
    let mut seen = vec![format!(
        "saved in {} ms ({} MiB)",
        ms(saved.took),
        saved.bytes / 1_048_576
    )];
    seen.push(woke.map_or_else(
        || "no vm_wake within 10 s".to_owned(),
        |(_, at)| format!("vm_wake {} ms after connect()", ms(at.duration_since(t0))),
    ));
    let restored = match restored {
        Ok(r) => r,
        Err(e) => {
            seen.push(format!("restore: {}", e.message));
            return result(seen.join("; "), false);
        }
    };
    seen.push(format!(
        "qemu started {} ms after connect(), state loaded in {} ms, running {} ms after connect()",
        ms(restored.spawned.duration_since(t0)),
        ms(restored.loaded.duration_since(restored.spawned)),
        ms(restored.running.duration_since(t0)),
    ));
    let delivered = now.delivered.saturating_sub(was.delivered);
    let expired = now.dropped_expired.saturating_sub(was.dropped_expired);
    seen.push(format!("{delivered} held frames delivered"));
    if expired > 0 {
        seen.push(format!(
            "{expired} expired before qemu opened the tap (hold {HOLD_SECS} s)"
        ));
    }
    let ok = match conn {
        Ok(c) => {
            seen.push(format!(
                "established {} ms after connect() with {} SYN retransmissions; {}",
                ms(c.took),
                c.retrans,
                if c.served { "served" } else { "not served" }
            ));
            c.served
        }
        Err(e) => {
            seen.push(e);
            false
        }
    };
    if let Err(e) = &channel {
        seen.push(format!("command channel after the restore: {}", e.message));
    }
    match channel {
        Ok((ch, _)) => g.ch = Some(ch),
        Err(_) => g.ch = None,
    }
    let ok = ok && woke.is_some() && g.ch.is_some() && (delivered > 0 || expired > 0);
    result(seen.join("; "), ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_public_vm_of_the_kvm_example_sleeps() {
        let spec = include_str!("../../../../examples/ns-kvm.json");
        let vms = vmnet_agent::hostspec::HostSpec::parse("ns-kvm.json", spec)
            .expect("example spec")
            .vms;
        assert_eq!(pick(&vms).map(|i| vms[i].id.as_str()), Some("vm-gateway"));
    }
}
