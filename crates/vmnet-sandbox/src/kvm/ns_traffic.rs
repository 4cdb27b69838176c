//! Bulk traffic from inside real namespace-mode guests: iperf3 in the guest against a server in
//! the fake internet, with the guest advertising MSS 1460 on the route to it (the namespace's
//! clamp must bring every segment down to the 1380-byte path).
//!
//! | check | expected |
//! |---|---|
//! | `large download through the mss clamp (iperf3 in the guest)` | `4 MiB received`: per VM with an IPv4 route via host and no firewall |
//! | `public limit download (iperf3 in the guest)` | `L MiB/s ±5 %`: 3 s after 1 s of slow start, per VM with a public limit `L` in force and no firewall |

use std::time::Duration;

use vmnet_model::vm::VmConfig;

use super::ns::NsGuest;
use crate::ns_job::checks::CheckResult;
use crate::ns_job::limits::{IPERF_PORT, iperf_server_once, limited, rate_check};
use crate::sandbox::ECHO_V4;

/// Bytes of the large download.
const LARGE_BYTES: u64 = 4 * 1_048_576;

/// Runs `iperf3 -c <echo v4> -R <args> -J` in guest `g` against a one-off server in `inet`,
/// retrying while the server is not up yet; the client's JSON report.
fn download(g: &mut NsGuest, inet: &str, args: &str) -> Result<serde_json::Value, String> {
    let mut server = iperf_server_once(inet)?;
    let script = format!(
        "ip route add {ECHO_V4}/32 via 172.16.0.1 dev eth0 advmss 1460 2>/dev/null\n\
         iperf3 -c {ECHO_V4} -p {IPERF_PORT} -R {args} -J --connect-timeout 2000\n\
         ip route del {ECHO_V4}/32 2>/dev/null"
    );
    let mut last = String::from("no result");
    let mut report = Err(String::new());
    for _ in 0..10 {
        let out = g.sh(&script, Duration::from_secs(60));
        let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
        if v["end"]["sum_received"]["bytes"].is_u64() {
            report = Ok(v);
            break;
        }
        last = v["error"]
            .as_str()
            .map_or_else(|| out.chars().take(200).collect(), str::to_owned);
        std::thread::sleep(Duration::from_millis(300));
    }
    let _ = server.kill();
    let _ = server.wait();
    report.map_err(|_| format!("iperf3: {last}"))
}

/// The checks of the module docs for `vms` (the spec's VMs) with guests `guests` (by VM id), from
/// the fake internet `inet`.
pub fn run(inet: &str, vms: &[VmConfig], guests: &mut [NsGuest]) -> Vec<CheckResult> {
    let open = |v: &VmConfig| {
        v.ipv4_via_host()
            && v.mesh_ipv6.is_some()
            && !v.firewall.as_ref().is_some_and(|f| f.enabled)
    };
    let lim = limited(vms);
    let mut out = Vec::new();
    for vm in vms.iter().filter(|v| open(v)) {
        let Some(g) = guests.iter_mut().find(|g| g.id == vm.id && g.ch.is_some()) else {
            continue;
        };
        let expected = format!("{} MiB received", LARGE_BYTES / 1_048_576);
        let seen = match download(g, inet, &format!("-n {LARGE_BYTES}")) {
            Ok(v) => {
                let got = v["end"]["sum_received"]["bytes"].as_u64().unwrap_or(0);
                if got >= LARGE_BYTES {
                    expected.clone()
                } else {
                    format!("{got} bytes received")
                }
            }
            Err(e) => e,
        };
        out.push(CheckResult {
            vm: vm.id.clone(),
            check: "large download through the mss clamp (iperf3 in the guest)".into(),
            ok: seen == expected,
            expected,
            seen,
        });
        if !lim.iter().any(|l| l.id == vm.id) {
            continue;
        }
        let measured = download(g, inet, "-t 3 -O 1").map(|v| {
            v["end"]["sum_received"]["bits_per_second"]
                .as_f64()
                .unwrap_or(0.0)
                / 8.0
                / 1_048_576.0
        });
        out.push(rate_check(
            vm,
            "public limit download (iperf3 in the guest)",
            measured,
        ));
    }
    out
}
