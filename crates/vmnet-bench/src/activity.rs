//! `vmnet bench activity`: the cost of the packet-activity program on a VM's path. iperf3
//! downloads from the sandbox's fake internet to a simulated guest (TCP to its mesh address,
//! through the host, the VM namespace and the tap, whose queued frames the program looks at),
//! alternately without and with the program attached, in the same run; the table shows each round and the
//! median ratio (target ≥ 98 %).
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
//! The sandbox guard deletes every namespace; the iperf3
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

/// Arguments of `vmnet bench activity`.
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

/// One iperf3 download into the guest, MiB/s of payload received.
fn download(inet: &str, secs: u32) -> Result<f64, Error> {
    let t = secs.to_string();
    let port = PORT.to_string();
    let mut last = String::new();
    for _ in 0..20 {
        let out = netns::exec(
            inet,
            "iperf3",
            &["-c", MESH, "-p", &port, "-t", &t, "-O", "1", "-J"],
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
            "vmnet bench activity must run as root (it creates network namespaces and loads BPF)",
        ));
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
    let inet = sb.inet();
    let mut rows = Vec::new();
    for round in 1..=args.rounds {
        rec.detach_link()
            .map_err(|e| internal("detach")(e.to_string()))?;
        let without = download(&inet, args.secs)?;
        rec.ensure_link()
            .map_err(|e| internal("attach")(e.to_string()))?;
        let before = rec.last_boot_ns(1).ok().flatten();
        let with = download(&inet, args.secs)?;
        let moved = rec.last_boot_ns(1).ok().flatten() > before;
        rows.push((round, without, with, moved));
    }
    println!(
        "vmnet bench activity: iperf3 fake internet → simulated guest (mesh address, TCP), {} s per run",
        args.secs
    );
    println!(
        "{:<6} {:>16} {:>16} {:>8} {:>16}",
        "ROUND", "WITHOUT MiB/s", "WITH MiB/s", "RATIO", "ACTIVITY MOVED"
    );
    for (r, wo, w, m) in &rows {
        println!(
            "{r:<6} {wo:>16.1} {w:>16.1} {:>7.1}% {:>16}",
            100.0 * w / wo.max(1e-9),
            if *m { "yes" } else { "no" }
        );
    }
    let mut wo: Vec<f64> = rows.iter().map(|r| r.1).collect();
    let mut w: Vec<f64> = rows.iter().map(|r| r.2).collect();
    let (mwo, mw) = (median(&mut wo), median(&mut w));
    println!(
        "median {:>16.1} {:>16.1} {:>7.1}%   (target ≥ 98 %)",
        mwo,
        mw,
        100.0 * mw / mwo.max(1e-9)
    );
    println!(
        "per-packet cost: not measured (run_time_ns needs the host-wide kernel.bpf_stats_enabled)"
    );
    drop(guest);
    Ok(())
}
