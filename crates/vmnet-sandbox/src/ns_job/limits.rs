//! The throughput-limit check of `vmnet-lab up --sandbox`: per VM whose public limit is in force
//! (a public limit and an IPv4 route via host), a short iperf3 download from the fake internet
//! to the simulated guest, compared with the limit; and the agent's counters of that class.
//!
//! | check | expected |
//! |---|---|
//! | `public limit download` | `L MiB/s ±5 %`: TCP payload the guest receives in 3 s (after 1 s of slow start), for a limit of `L` |
//! | `public limit counters` | `bytes > 0`: `GET /v1/vms/{id}` reports the public download class's bytes |

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use vmnet_agent::client::Client;
use vmnet_model::vm::VmConfig;

use super::checks::CheckResult;
use crate::netns;
use crate::sandbox::ECHO_V4;

/// The iperf3 port in the fake internet.
pub const IPERF_PORT: u16 = 5201;

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

/// The check `name` of VM `vm`: a `measured` download rate (MiB/s, or why there is none)
/// against its public limit, ±5 %.
#[must_use]
pub fn rate_check(vm: &VmConfig, name: &str, measured: Result<f64, String>) -> CheckResult {
    let limit = f64::from(vm.public_network_throughput_mibps);
    let (seen, ok) = match measured {
        Ok(m) => (
            format!("{m:.2} MiB/s"),
            (0.95..=1.05).contains(&(m / limit)),
        ),
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
        let (inet, ns) = (inet.to_owned(), guest_ns.clone());
        let measured = tokio::task::spawn_blocking(move || download_mibps(&inet, &ns))
            .await
            .unwrap_or_else(|e| Err(e.to_string()));
        out.push(rate_check(vm, "public limit download", measured));
        let bytes = client
            .get::<vmnet_agent::status::VmView>(&format!("/v1/vms/{}", vm.id))
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
        out.push(CheckResult {
            vm: vm.id.clone(),
            check: "public limit counters".into(),
            expected: "bytes > 0".into(),
            seen: bytes.map_or_else(|| "none".into(), |b| format!("bytes {b}")),
            ok: bytes.is_some_and(|b| b > 0),
        });
    }
    out
}
