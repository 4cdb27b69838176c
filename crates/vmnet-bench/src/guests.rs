//! `vmnet-lab bench guests`: real guests (the image of `scripts/guest-image.sh`, under KVM, or TCG
//! with a warning) on throwaway sandbox hosts with the agent (`vmnet serve`) in them.
//!
//! - **Boot to network-ready, namespace mode**, `boots` times, one guest at a time on the same
//!   VM's tap: from qemu's start until the guest has the mesh address `vmnet-guest` applied from
//!   the metadata service (so the whole chain: boot, networkd, the metadata service, the
//!   drop-in) — median, min and max.
//! - **Boot to network-ready, pool mode**, `boots` times on one pool-mode instance's tap: from
//!   qemu's start until cloud-init configured the lease and the default route on `eth0`
//!   ([`crate::guests_pool`]) — median, min and max.
//! - **Throughput, no limits**: iperf3 in the guest downloading from the fake internet through
//!   vmnet's whole path (tap, VM namespace with its nft table, NAT, veth, host routes), against
//!   the same image's guest on a bare tap in a bare namespace (iperf3 server on the tap's
//!   address), `runs` times each, alternately, in the same run; medians and their ratio (the
//!   goal: at least 0.9).
//! - **With a limit**: the VM's public download limit set by `PUT` to `limit_mibps`, then the same
//!   download; the median rate against the limit.
//!
//! # Cleanup
//! Each guest is stopped by pid on drop (the qemu process group), the agent by its guard, the
//! iperf3 servers on drop, and the sandbox guard deletes every namespace with its taps.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::{Value, json};
use vmnet_agent::api::types::VmView;
use vmnet_agent::client::Client;
use vmnet_model::Error;

use crate::iperf::Server;
use vmnet_sandbox::agent::AgentOptions;
use vmnet_sandbox::kvm::ns::{self as kns, NsGuest};
use vmnet_sandbox::kvm::{self, Accel, GuestImage, Vm, VmConfig};
use vmnet_sandbox::netns;
use vmnet_sandbox::sandbox::ECHO_V4;

/// Arguments of `vmnet-lab bench guests`.
#[derive(Debug, clap::Args)]
pub struct GuestsBenchArgs {
    /// Boots measured per mode (one at a time).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=50))]
    pub boots: u32,
    /// iperf3 runs per path.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub runs: u32,
    /// Seconds per iperf3 run (after one second of slow start).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=60))]
    pub secs: u32,
    /// The public download limit of the limited measurement, MiB/s.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub limit_mibps: u32,
}

/// The goal: the guest's throughput through vmnet over that on a bare tap.
pub const GOAL_RATIO: f64 = 0.9;

const PORT: u16 = 5201;
const MESH: &str = "fdaa:1::7";
const BARE_GW: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 1);
const BOOT_WAIT: Duration = Duration::from_secs(600);

fn unavailable(what: &str) -> impl Fn(String) -> Error + '_ {
    move |e| Error::unavailable(format!("bench guests: {what}: {e}"))
}

fn vm_config(limit: u32) -> Value {
    json!({
        "id": "bench-guest",
        "user_id": 7,
        "tenant": 1,
        "mesh_ipv6": MESH,
        "public_network_throughput_mibps": limit,
        "network": {"routes": [{"destination": "0.0.0.0/0", "via": "host"}]},
    })
}

fn boot(
    name: &str,
    netns: &str,
    tap: &str,
    mac: &str,
    (image, accel, dir): (&GuestImage, Accel, &std::path::Path),
) -> Result<NsGuest, Error> {
    let cfg = VmConfig {
        name: name.to_owned(),
        netns: netns.to_owned(),
        nic_args: kns::nic_args(tap, mac),
        seed_iso: None,
        cmdline_extra: kns::CMDLINE.into(),
        disks: Vec::new(),
        cpus: 1,
        memory_mib: 384,
    };
    Ok(NsGuest {
        id: name.to_owned(),
        vm: Vm::start(&cfg, image, accel, dir)?,
        ch: None,
        mesh: None,
        host_routes6: Vec::new(),
        ready_secs: None,
    })
}

/// Waits for `g`'s channel and `want` (`addr/len`, family `-4` / `-6`) on its `eth0`; the
/// seconds since its qemu started.
fn ready(g: &mut NsGuest, want: &str, family: &str) -> Result<f64, Error> {
    let (ch, _) = g.vm.channel(BOOT_WAIT)?;
    g.ch = Some(ch);
    let left = BOOT_WAIT.saturating_sub(g.vm.started.elapsed());
    let seen = g.wait_addresses(want, family, left);
    if seen != want {
        return Err(Error::internal(format!(
            "bench guests: {}: eth0 has {seen:?}, not {want}",
            g.id
        )));
    }
    Ok(g.vm.started.elapsed().as_secs_f64())
}

/// One iperf3 download in guest `g` from `server`; MiB/s received.
fn download(g: &mut NsGuest, server: Ipv4Addr, secs: u32) -> Result<f64, Error> {
    let script =
        format!("iperf3 -c {server} -p {PORT} -R -t {secs} -O 1 -J --connect-timeout 2000");
    let mut last = String::new();
    for _ in 0..10 {
        let out = g.sh(&script, Duration::from_secs(u64::from(secs) + 30));
        let v: Value = serde_json::from_str(&out).unwrap_or_default();
        if let Some(bps) = v["end"]["sum_received"]["bits_per_second"].as_f64() {
            return Ok(bps / 8.0 / 1_048_576.0);
        }
        last = v["error"]
            .as_str()
            .map_or_else(|| out.chars().take(200).collect(), str::to_owned);
        std::thread::sleep(Duration::from_millis(300));
    }
    Err(Error::internal(format!(
        "bench guests: iperf3 in {}: {last}",
        g.id
    )))
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => f64::midpoint(v[n / 2 - 1], v[n / 2]),
    }
}

/// A bare namespace with a tap `tap0` at 172.16.0.1/30 (MTU 1380, as vmnet's), nothing else.
fn bare_tap(sb: &vmnet_sandbox::Sandbox) -> Result<String, Error> {
    let ns = sb
        .add_netns("b")
        .map_err(|e| unavailable("bare namespace")(e.to_string()))?;
    for args in [
        &["tuntap", "add", "dev", "tap0", "mode", "tap"][..],
        &["addr", "add", "172.16.0.1/30", "dev", "tap0"],
        &["link", "set", "tap0", "mtu", "1380", "up"],
    ] {
        netns::ip(&ns, args).map_err(|e| unavailable("bare tap")(e.to_string()))?;
    }
    Ok(ns)
}

async fn put(c: &Client, limit: u32) -> Result<VmView, Error> {
    c.put::<VmView>("/v1/vms/bench-guest", &vm_config(limit))
        .await
}

/// Runs the command and prints its table.
///
/// # Errors
/// `INVALID_INPUT` when not root; `UNAVAILABLE` when a sandbox, the image, qemu, iperf3 or the
/// pool-mode seed cannot be set up; `INTERNAL` when a guest does not get ready.
pub async fn run(a: GuestsBenchArgs) -> Result<(), Error> {
    if !nix::unistd::geteuid().is_root() {
        return Err(Error::invalid(
            "vmnet-lab bench guests must run as root (it creates network namespaces and boots qemu)",
        ));
    }
    let (image, accel) = kvm::setup()?;
    let sb =
        vmnet_sandbox::Sandbox::new("bg").map_err(|e| unavailable("sandbox")(e.to_string()))?;
    let dir = std::env::temp_dir().join(format!("vmnet-bench-guests.{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| unavailable("state directory")(e.to_string()))?;
    let _dir = DirGuard(dir.clone());
    let exe = vmnet_sandbox::exe::vmnet()?;
    let agent = AgentOptions::new(sb.host(), sb.agent_prefix(), &dir)
        .exe(exe)
        .rust_log("warn")
        .start(Duration::from_secs(30))
        .await?;
    let c = agent.client();
    let v = put(c, 0).await?;
    let (ns, tap, mac) = (
        v.status.netns.clone(),
        v.status.tap.clone(),
        v.status.guest_mac.clone(),
    );
    let img = (&image, accel, dir.as_path());
    let want_mesh = format!("{MESH}/128");

    let mut boots = Vec::new();
    for i in 0..a.boots {
        let mut g = boot(&format!("boot{i}"), &ns, &tap, &mac, img)?;
        let s = tokio::task::block_in_place(|| ready(&mut g, &want_mesh, "-6"))?;
        eprintln!("namespace-mode boot {}: network ready in {s:.1} s", i + 1);
        boots.push(s);
    }

    let bare_ns = bare_tap(&sb)?;
    let mut vg = boot("vmnet", &ns, &tap, &mac, img)?;
    let mut bg = boot("bare", &bare_ns, "tap0", &mac, img)?;
    let s1 = Server::start(&sb.inet(), ECHO_V4, PORT)?;
    let s2 = Server::start(&bare_ns, BARE_GW, PORT)?;
    let (mut via, mut bare) = (Vec::new(), Vec::new());
    tokio::task::block_in_place(|| -> Result<(), Error> {
        ready(&mut vg, &want_mesh, "-6")?;
        ready(&mut bg, kns::GUEST_CIDR, "-4")?;
        for _ in 0..a.runs {
            via.push(download(&mut vg, ECHO_V4, a.secs)?);
            bare.push(download(&mut bg, BARE_GW, a.secs)?);
        }
        Ok(())
    })?;
    drop(bg);
    put(c, a.limit_mibps).await?;
    let limited = tokio::task::block_in_place(|| -> Result<Vec<f64>, Error> {
        (0..a.runs)
            .map(|_| download(&mut vg, ECHO_V4, a.secs))
            .collect()
    })?;
    drop((vg, s1, s2, agent, sb));
    let pool_boots = crate::guests_pool::boots(a.boots, img, BOOT_WAIT).await?;

    let accel_s = match accel {
        Accel::Kvm => "KVM",
        Accel::Tcg => "TCG (emulated: figures are the emulator's, not the network's)",
    };
    println!("vmnet-lab bench guests: real guests under {accel_s}");
    let rows = [
        Row {
            name: format!(
                "boot to network-ready, namespace mode: qemu start to the mesh address from metadata on eth0 ({} boots)",
                a.boots
            ),
            values: boots,
            unit: "s",
        },
        Row {
            name: format!(
                "boot to network-ready, pool mode: qemu start to cloud-init's lease address and default route on eth0 ({} boots)",
                a.boots
            ),
            values: pool_boots,
            unit: "s",
        },
        Row {
            name: "iperf3 download, vmnet's path, no limit".into(),
            values: via.clone(),
            unit: "MiB/s",
        },
        Row {
            name: "iperf3 download, bare tap in a bare namespace".into(),
            values: bare.clone(),
            unit: "MiB/s",
        },
        Row {
            name: format!("iperf3 download, public limit {} MiB/s", a.limit_mibps),
            values: limited.clone(),
            unit: "MiB/s",
        },
    ];
    print!("{}", table(&rows));
    let ratio = median(&via) / median(&bare).max(1e-9);
    println!(
        "vmnet / bare: {ratio:.2} (goal ≥ {GOAL_RATIO}: {}); limited / limit: {:.2}",
        if ratio >= GOAL_RATIO { "met" } else { "missed" },
        median(&limited) / f64::from(a.limit_mibps)
    );
    Ok(())
}

/// One row of the table: a figure's name, its samples and their unit (`s`, `MiB/s`).
pub struct Row {
    /// What was measured.
    pub name: String,
    /// The samples (at least one).
    pub values: Vec<f64>,
    /// Their unit.
    pub unit: &'static str,
}

/// The table `vmnet-lab bench guests` prints: a header and one line per row with the median, min
/// and max to one decimal with the unit; the first column as wide as the longest name.
#[must_use]
pub fn table(rows: &[Row]) -> String {
    let w = rows
        .iter()
        .map(|r| r.name.chars().count())
        .chain(std::iter::once(6))
        .max()
        .unwrap_or(6);
    let mut out = format!(
        "{:<w$} {:>12} {:>12} {:>12}\n",
        "FIGURE", "MEDIAN", "MIN", "MAX"
    );
    for r in rows {
        let min = r.values.iter().copied().fold(f64::INFINITY, f64::min);
        let max = r.values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let u = r.unit;
        out.push_str(&format!(
            "{:<w$} {:>12} {:>12} {:>12}\n",
            r.name,
            format!("{:.1} {u}", median(&r.values)),
            format!("{min:.1} {u}"),
            format!("{max:.1} {u}")
        ));
    }
    out
}

/// Removes the bench's state directory (the guests' overlays and consoles) on drop.
struct DirGuard(PathBuf);

impl Drop for DirGuard {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_even_and_none() {
        assert!((median(&[3.0, 1.0, 2.0]) - 2.0).abs() < 1e-9);
        assert!((median(&[4.0, 1.0, 2.0, 3.0]) - 2.5).abs() < 1e-9);
        assert!(median(&[]).abs() < 1e-9);
    }

    #[test]
    fn table_has_a_row_per_mode_with_median_min_max() {
        let rows = [
            Row {
                name: "boot to network-ready, namespace mode (3 boots)".into(),
                values: vec![47.0, 43.04, 62.7],
                unit: "s",
            },
            Row {
                name: "boot to network-ready, pool mode (3 boots)".into(),
                values: vec![80.0, 75.5, 90.26],
                unit: "s",
            },
        ];
        let t = table(&rows);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3);
        let w = rows[0].name.len();
        assert_eq!(
            lines[0],
            format!(
                "{:<w$} {:>12} {:>12} {:>12}",
                "FIGURE", "MEDIAN", "MIN", "MAX"
            )
        );
        assert_eq!(
            lines[1],
            format!(
                "{:<w$} {:>12} {:>12} {:>12}",
                rows[0].name, "47.0 s", "43.0 s", "62.7 s"
            )
        );
        assert!(lines[2].starts_with("boot to network-ready, pool mode (3 boots)   "));
        assert!(lines[2].ends_with("      80.0 s       75.5 s       90.3 s"));
    }
}
