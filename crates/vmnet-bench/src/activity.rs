//! `vmnet-lab bench activity`: the cost of the packet-activity program. The program runs for every
//! frame queued on the host, so two paths are measured, alternately without and with the
//! program attached, in the same run:
//! - a VM's: iperf3 downloads from the sandbox's fake internet to a simulated guest (TCP to its
//!   mesh address, through the host, the VM namespace and the tap, whose queued frames the
//!   program records);
//! - traffic that is not a VM's: iperf3 from the fake internet to a namespace routed behind the
//!   sandbox host over a veth pair (kernel only), forwarded by the host, so the program does its
//!   lookup for each frame and finds nothing.
//!
//! The table shows each round and the median ratios (target ≥ 98 %).
//!
//! The per-packet cost of the program itself is not measured: `bpftool prog show`'s
//! `run_time_ns` needs `kernel.bpf_stats_enabled`, a host-wide sysctl this bench does not touch.
//!
//! # Limitations
//! The simulated guest is a namespace joined to the tap by the sandbox's userspace frame relay,
//! which bounds the throughput (not the kernel path): the ratio says the program costs nothing
//! measurable at that rate, not what it costs at line rate.
//!
//! # Cleanup
//! The sandbox guard deletes every namespace (the forwarding path's veth pair with them); the iperf3
//! server is killed by its pid; the pin root is unpinned, unmounted and removed.

use std::sync::Arc;
use std::time::Duration;

use vmnet_kernel::activity::ActivityRecorder;
use vmnet_kernel::ns::{NetlinkNsDriver, NsDriver};
use vmnet_model::Error;
use vmnet_model::vm::parse_vm_config;
use vmnet_plan::ns::{HOST_LINK_LOCAL, NsSettings, plan_vm};
use vmnet_sandbox::guest::{GuestConfig, GuestRoute6, SimGuest};
use vmnet_sandbox::netns;

use crate::iperf::Server;

/// Arguments of `vmnet-lab bench activity`.
#[derive(Debug, clap::Args)]
pub struct ActivityBenchArgs {
    /// Rounds; each measures once without and once with the program.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub rounds: u32,
    /// Seconds per measurement (after one second of slow start).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=60))]
    pub secs: u32,
}

const MESH: &str = "fdaa:1::1";
const PORT: u16 = 5201;
/// The address of the namespace behind the sandbox host (documentation range).
const BEHIND: &str = "2001:db8:0:2::2";
/// The sandbox host's address towards it.
const BEHIND_GW: &str = "2001:db8:0:2::1";
/// The sandbox host's uplink address, the fake internet's route to [`BEHIND`].
const UPLINK: &str = "2001:db8:0:1::2";

/// Unpins, unmounts and removes the pin root on drop.
struct PinRoot(std::path::PathBuf);

impl Drop for PinRoot {
    fn drop(&mut self) {
        let _ = vmnet_kernel::activity::remove_root(&self.0);
    }
}

fn internal(what: &str) -> impl Fn(String) -> Error + '_ {
    move |e| Error::internal(format!("{what}: {e}"))
}

/// One iperf3 download from `inet` to `to` (a server on `port`), MiB/s of payload received.
pub(crate) fn download(inet: &str, to: &str, port: u16, secs: u32) -> Result<f64, Error> {
    let t = secs.to_string();
    let port = port.to_string();
    let mut last = String::new();
    for _ in 0..20 {
        let out = netns::exec(
            inet,
            "iperf3",
            &["-c", to, "-p", &port, "-t", &t, "-O", "1", "-J"],
            Duration::from_secs(u64::from(secs) + 30),
        )
        .map_err(|e| Error::internal(format!("iperf3 -c: {e}")))?;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        if let Some(bps) = v["end"]["sum_received"]["bits_per_second"].as_f64() {
            return Ok(bps / 8.0 / 1_048_576.0);
        }
        last = v["error"].as_str().unwrap_or("no result").to_owned();
        std::thread::sleep(Duration::from_millis(200));
    }
    Err(Error::internal(format!("iperf3: {last}")))
}

/// A namespace routed behind the sandbox host over a veth pair, [`BEHIND`] on its end; the fake
/// internet routes to it through the host. Returns its name.
fn behind_host(sb: &vmnet_sandbox::Sandbox) -> Result<String, Error> {
    let sandbox = |e: vmnet_sandbox::SandboxError| Error::internal(format!("forwarding path: {e}"));
    let behind = sb.add_netns("fwd").map_err(sandbox)?;
    let host = sb.host();
    netns::ip(
        &host,
        &[
            "link", "add", "fwd", "type", "veth", "peer", "name", "eth0", "netns", &behind,
        ],
    )
    .map_err(sandbox)?;
    for (ns, addr, dev) in [(&host, BEHIND_GW, "fwd"), (&behind, BEHIND, "eth0")] {
        netns::ip(
            ns,
            &["addr", "add", &format!("{addr}/64"), "dev", dev, "nodad"],
        )
        .map_err(sandbox)?;
        netns::ip(ns, &["link", "set", dev, "up"]).map_err(sandbox)?;
    }
    netns::ip(&behind, &["route", "add", "::/0", "via", BEHIND_GW]).map_err(sandbox)?;
    netns::ip(
        &sb.inet(),
        &["route", "add", "2001:db8:0:2::/64", "via", UPLINK],
    )
    .map_err(sandbox)?;
    Ok(behind)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        f64::midpoint(v[n / 2 - 1], v[n / 2])
    }
}

/// Runs the command.
///
/// # Errors
/// `INVALID_INPUT` when not root; `INTERNAL` when the sandbox, the program or iperf3 fails.
pub async fn run(args: ActivityBenchArgs) -> Result<(), Error> {
    if !nix::unistd::geteuid().is_root() {
        return Err(Error::invalid(
            "vmnet-lab bench activity must run as root (it creates network namespaces and loads BPF)",
        ));
    }
    for root in vmnet_sandbox::sandbox::sweep_stale_pin_roots() {
        eprintln!(
            "removed {}, the pin root of a bench or test that was killed",
            root.display()
        );
    }
    let sb = vmnet_sandbox::Sandbox::new("bt")
        .map_err(|e| Error::internal(format!("bench sandbox: {e}")))?;
    let root = PinRoot(std::env::temp_dir().join(format!("{}-bpf", sb.agent_prefix())));
    let rec = Arc::new(
        ActivityRecorder::open(&root.0)
            .map_err(|e| Error::internal(format!("load the activity program: {e}")))?,
    );
    let settings = NsSettings {
        name_prefix: sb.agent_prefix(),
        activity: true,
        ..NsSettings::default()
    };
    let driver = NetlinkNsDriver::new(settings.clone(), Some(sb.host()))
        .map_err(|e| Error::internal(format!("driver: {e}")))?
        .with_activity(Arc::clone(&rec));
    let cfg = parse_vm_config(
        format!(
            r#"{{"id":"bench","user_id":1,"tenant":1,"mesh_ipv6":"{MESH}","network":{{"routes":[{{"destination":"::/0","via":"host"}}]}}}}"#
        )
        .as_bytes(),
    )?;
    let plan = plan_vm(&cfg, &settings)?;
    driver
        .apply(&plan)
        .await
        .map_err(|e| Error::internal(format!("apply: {e}")))?;
    if plan.activity.is_none() {
        return Err(Error::internal("the plan has no activity entry"));
    }
    let guest_cfg = GuestConfig {
        mesh_ipv6: plan.guest.mesh_ipv6,
        routes_v6: vec![GuestRoute6 {
            destination: "::/0".into(),
            via: Some(HOST_LINK_LOCAL),
        }],
        ..GuestConfig::default()
    };
    let guest = SimGuest::attach(&sb, "g", &plan.netns, &plan.tap.name, &guest_cfg)
        .map_err(|e| Error::internal(format!("guest: {e}")))?;
    let mesh: std::net::Ipv6Addr = MESH
        .parse()
        .map_err(|e| Error::internal(format!("{MESH}: {e}")))?;
    let _server = Server::start(guest.netns(), mesh, PORT)?;
    let behind = behind_host(&sb)?;
    let behind_addr: std::net::Ipv6Addr = BEHIND
        .parse()
        .map_err(|e| Error::internal(format!("{BEHIND}: {e}")))?;
    let _fwd_server = Server::start(&behind, behind_addr, PORT)?;
    let inet = sb.inet();
    let mut rows = Vec::new();
    for round in 1..=args.rounds {
        rec.detach_link()
            .map_err(|e| internal("detach")(e.to_string()))?;
        let vm_without = download(&inet, MESH, PORT, args.secs)?;
        let fwd_without = download(&inet, BEHIND, PORT, args.secs)?;
        rec.ensure_link()
            .map_err(|e| internal("attach")(e.to_string()))?;
        let before = rec.last_boot_ns(1).ok().flatten();
        let vm_with = download(&inet, MESH, PORT, args.secs)?;
        let moved = rec.last_boot_ns(1).ok().flatten() > before;
        let fwd_with = download(&inet, BEHIND, PORT, args.secs)?;
        rows.push(Row {
            round,
            vm: (vm_without, vm_with),
            fwd: (fwd_without, fwd_with),
            moved,
        });
    }
    print_table(&rows, args.secs);
    drop(guest);
    Ok(())
}

/// One round: MiB/s without and with the program, for the VM's path and the forwarded one.
struct Row {
    round: u32,
    vm: (f64, f64),
    fwd: (f64, f64),
    moved: bool,
}

fn ratio(without: f64, with: f64) -> f64 {
    100.0 * with / without.max(1e-9)
}

fn print_table(rows: &[Row], secs: u32) {
    println!(
        "vmnet-lab bench activity: iperf3 from the fake internet, {secs} s per run, without / with the program attached"
    );
    println!(
        "  VM:  to a simulated guest's mesh address (TCP through the tap; userspace frame relay)"
    );
    println!(
        "  FWD: to a namespace behind the sandbox host over a veth pair (not a VM's, kernel only)"
    );
    println!(
        "{:<6} {:>12} {:>12} {:>8} {:>12} {:>12} {:>8} {:>15}",
        "ROUND",
        "VM W/O MiB/s",
        "VM W/ MiB/s",
        "RATIO",
        "FWD W/O",
        "FWD W/",
        "RATIO",
        "ACTIVITY MOVED"
    );
    for r in rows {
        println!(
            "{:<6} {:>12.1} {:>12.1} {:>7.1}% {:>12.1} {:>12.1} {:>7.1}% {:>15}",
            r.round,
            r.vm.0,
            r.vm.1,
            ratio(r.vm.0, r.vm.1),
            r.fwd.0,
            r.fwd.1,
            ratio(r.fwd.0, r.fwd.1),
            if r.moved { "yes" } else { "no" }
        );
    }
    let col = |f: fn(&Row) -> f64| median(&mut rows.iter().map(f).collect::<Vec<_>>());
    let (vwo, vw) = (col(|r| r.vm.0), col(|r| r.vm.1));
    let (fwo, fw) = (col(|r| r.fwd.0), col(|r| r.fwd.1));
    println!(
        "median {vwo:>12.1} {vw:>12.1} {:>7.1}% {fwo:>12.1} {fw:>12.1} {:>7.1}%   (target ≥ 98 %)",
        ratio(vwo, vw),
        ratio(fwo, fw)
    );
    println!(
        "per-packet cost: not measured (run_time_ns needs the host-wide kernel.bpf_stats_enabled)"
    );
}
