//! The throughput-limit check of `vmnet-lab up --sandbox`: per VM whose public limit is in force
//! (a public limit and an IPv4 route via host), a short iperf3 download from the fake internet
//! to the simulated guest, compared with the limit; and the agent's counters of that class.
//!
//! | check | expected |
//! |---|---|
//! | `public limit download` | `L MiB/s ±5 %`: TCP payload the guest receives in 3 s (after 1 s of slow start), for a limit of `L` |
//! | `public limit counters` | `bytes > 0`: `GET /v1/vms/{id}` reports the public download class's bytes |
//!
//! A busy machine can starve the sender, so a rate below the band is not by itself a fault of the
//! shaper: the check downloads up to three times and keeps the best rate, and when even that is
//! below the band it measures the same path with the limit lifted (a `PUT` without the limit,
//! then the VM's own configuration again). It fails when a rate is above the band, or when it is
//! below the band while the unshaped path carried more than the limit in the same run; when the
//! unshaped path is slower than the limit too, the machine could not carry the limit at that
//! moment and the check says so without failing ([`judge`]).

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use vmnet_agent::client::{Client, segment};
use vmnet_agent::status::VmView;
use vmnet_model::vm::VmConfig;

use super::checks::CheckResult;
use crate::netns;
use crate::sandbox::ECHO_V4;

/// The iperf3 port in the fake internet.
pub const IPERF_PORT: u16 = 5201;
/// Shaped downloads a check makes at most while the rate is below the band.
const SHAPED_TRIES: usize = 3;
/// The band around the limit a shaped rate must fall in.
const BAND: f64 = 0.05;

/// The VMs the check applies to: a public limit with an IPv4 route via host.
#[must_use]
pub fn limited(vms: &[VmConfig]) -> Vec<&VmConfig> {
    vms.iter()
        .filter(|v| {
            v.public_network_throughput_mibps > 0 && v.ipv4_via_host() && v.mesh_ipv6.is_some()
        })
        .collect()
}

/// Starts a one-off iperf3 server (`-s -1`) at [`ECHO_V4`]:[`IPERF_PORT`] in the fake internet
/// `inet`; the caller kills it when done.
///
/// # Errors
/// Why `iperf3 -s` could not start.
pub fn iperf_server_once(inet: &str) -> Result<Child, String> {
    let (port, addr) = (IPERF_PORT.to_string(), ECHO_V4.to_string());
    Command::new("ip")
        .args([
            "netns", "exec", inet, "iperf3", "-s", "-1", "-B", &addr, "-p", &port,
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("iperf3 -s: {e}"))
}

/// Receives from an iperf3 server at [`ECHO_V4`] in `inet` for 3 s in `guest_ns`; the payload
/// rate in MiB/s, or why it could not be measured.
pub fn download_mibps(inet: &str, guest_ns: &str) -> Result<f64, String> {
    let port = IPERF_PORT.to_string();
    let addr = ECHO_V4.to_string();
    let mut server = iperf_server_once(inet)?;
    let mut last = String::new();
    let mut result = Err(String::new());
    for _ in 0..20 {
        let out = netns::exec(
            guest_ns,
            "iperf3",
            &["-c", &addr, "-p", &port, "-t", "3", "-O", "1", "-R", "-J"],
            Duration::from_secs(30),
        )
        .map_err(|e| e.to_string())?;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        if let Some(bps) = v["end"]["sum_received"]["bits_per_second"].as_f64() {
            result = Ok(bps / 8.0 / 1_048_576.0);
            break;
        }
        last = v["error"].as_str().unwrap_or("no result").to_owned();
        std::thread::sleep(Duration::from_millis(200));
    }
    let _ = server.kill();
    let _ = server.wait();
    result.map_err(|_| format!("iperf3: {last}"))
}

/// The verdict on a public limit of `limit` MiB/s from the rates of one run: every shaped
/// download (MiB/s, in order) and, when the best of them is below the band, the same path's
/// rate with the limit lifted (or why it could not be measured). What the check shows and
/// whether it passes.
#[must_use]
pub fn judge(limit: f64, shaped: &[f64], unshaped: Option<&Result<f64, String>>) -> (String, bool) {
    let best = shaped.iter().copied().fold(f64::NAN, f64::max);
    let (low, high) = (limit * (1.0 - BAND), limit * (1.0 + BAND));
    if best.is_nan() {
        return ("no download measured".into(), false);
    }
    if best > high {
        return (format!("{best:.2} MiB/s: above the limit"), false);
    }
    if best >= low {
        return (format!("{best:.2} MiB/s"), true);
    }
    match unshaped {
        Some(Ok(u)) if *u > high => (
            format!("{best:.2} MiB/s while the same path unshaped carried {u:.2} MiB/s"),
            false,
        ),
        Some(Ok(u)) => (
            format!(
                "{best:.2} MiB/s, not judged: the same path unshaped carried only {u:.2} MiB/s (a busy machine)"
            ),
            true,
        ),
        Some(Err(e)) => (
            format!("{best:.2} MiB/s; the same path unshaped could not be measured: {e}"),
            false,
        ),
        None => (format!("{best:.2} MiB/s"), false),
    }
}

/// The check `name` of VM `vm`: one `measured` download rate (MiB/s, or why there is none)
/// against its public limit, ±5 %.
#[must_use]
pub fn rate_check(vm: &VmConfig, name: &str, measured: Result<f64, String>) -> CheckResult {
    let limit = f64::from(vm.public_network_throughput_mibps);
    let (seen, ok) = match measured {
        Ok(m) => judge(limit, &[m], None),
        Err(e) => (e, false),
    };
    CheckResult {
        vm: vm.id.clone(),
        check: name.into(),
        expected: format!("{limit} MiB/s ±5 %"),
        seen,
        ok,
    }
}

/// One download from the fake internet `inet` to the guest in `guest_ns`, off the runtime.
async fn download(inet: &str, guest_ns: &str) -> Result<f64, String> {
    let (inet, ns) = (inet.to_owned(), guest_ns.to_owned());
    tokio::task::spawn_blocking(move || download_mibps(&inet, &ns))
        .await
        .unwrap_or_else(|e| Err(e.to_string()))
}

/// The rate of `vm`'s public path with its limit lifted: `PUT` without the limit, one download,
/// then `PUT` of the VM's own configuration again (also when the download failed).
async fn unshaped(
    client: &Client,
    inet: &str,
    vm: &VmConfig,
    guest_ns: &str,
) -> Result<f64, String> {
    let path = format!("/v1/vms/{}", segment(&vm.id));
    let mut open = vm.clone();
    open.public_network_throughput_mibps = 0;
    client
        .put::<VmView>(&path, &open)
        .await
        .map_err(|e| format!("PUT without the limit: {}", e.message))?;
    let rate = download(inet, guest_ns).await;
    client
        .put::<VmView>(&path, vm)
        .await
        .map_err(|e| format!("PUT with the limit again: {}", e.message))?;
    rate
}

/// The counters check of `vm`: its public download class has counted bytes.
async fn counters_check(client: &Client, vm: &VmConfig) -> CheckResult {
    let bytes = client
        .get::<VmView>(&format!("/v1/vms/{}", segment(&vm.id)))
        .await
        .ok()
        .and_then(|v| {
            v.status.limits.iter().find_map(|l| {
                (l.class == vmnet_plan::ns::limits::TrafficClass::Public
                    && l.direction == vmnet_plan::ns::limits::Direction::Download)
                    .then_some(l.bytes)
                    .flatten()
            })
        });
    CheckResult {
        vm: vm.id.clone(),
        check: "public limit counters".into(),
        expected: "bytes > 0".into(),
        seen: bytes.map_or_else(|| "none".into(), |b| format!("bytes {b}")),
        ok: bytes.is_some_and(|b| b > 0),
    }
}

/// The download check of `vm` (the module docs say how a busy machine is told apart), then its
/// counters check, read before a `PUT` that lifts the limit can renew the class.
async fn limit_checks(
    client: &Client,
    inet: &str,
    vm: &VmConfig,
    guest_ns: &str,
) -> [CheckResult; 2] {
    let limit = f64::from(vm.public_network_throughput_mibps);
    let mut shaped = Vec::new();
    let mut failure = None;
    for _ in 0..SHAPED_TRIES {
        match download(inet, guest_ns).await {
            Ok(m) => {
                shaped.push(m);
                if m >= limit * (1.0 - BAND) {
                    break;
                }
            }
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
    }
    let counters = counters_check(client, vm).await;
    let (seen, ok) = match failure {
        Some(e) => (e, false),
        None => {
            let best = shaped.iter().copied().fold(0.0, f64::max);
            let lifted = if best < limit * (1.0 - BAND) {
                Some(unshaped(client, inet, vm, guest_ns).await)
            } else {
                None
            };
            judge(limit, &shaped, lifted.as_ref())
        }
    };
    let download = CheckResult {
        vm: vm.id.clone(),
        check: "public limit download".into(),
        expected: format!("{limit} MiB/s ±5 %"),
        seen,
        ok,
    };
    [download, counters]
}

/// Runs the checks for every limited VM; `guests` maps a VM id to its guest namespace.
pub async fn run(
    client: &Client,
    inet: &str,
    vms: &[VmConfig],
    guests: &[(String, String)],
) -> Vec<CheckResult> {
    let mut out = Vec::new();
    for vm in limited(vms) {
        let Some((_, guest_ns)) = guests.iter().find(|(id, _)| *id == vm.id) else {
            continue;
        };
        out.extend(limit_checks(client, inet, vm, guest_ns).await);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::judge;

    #[test]
    fn a_rate_in_the_band_passes_and_above_it_fails_whatever_else_was_seen() {
        assert_eq!(judge(10.0, &[9.6], None), ("9.60 MiB/s".into(), true));
        assert!(judge(10.0, &[7.0, 10.4], None).1);
        let (seen, ok) = judge(10.0, &[10.6], None);
        assert!(!ok && seen.contains("above the limit"), "{seen}");
        assert!(!judge(10.0, &[7.0, 11.0], Some(&Ok(5.0))).1);
    }

    #[test]
    fn a_rate_below_the_band_fails_only_when_the_unshaped_path_was_faster() {
        let (seen, ok) = judge(10.0, &[5.0, 5.1, 4.9], Some(&Ok(400.0)));
        assert!(!ok && seen.contains("unshaped carried 400.00"), "{seen}");
        let (seen, ok) = judge(10.0, &[7.4, 7.0, 6.0], Some(&Ok(8.0)));
        assert!(ok && seen.contains("not judged"), "{seen}");
        assert!(!judge(10.0, &[7.4], Some(&Err("iperf3: refused".into()))).1);
        assert!(!judge(10.0, &[7.4], None).1);
        assert!(!judge(10.0, &[], None).1);
    }
}
