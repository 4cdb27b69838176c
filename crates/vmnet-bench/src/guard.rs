//! `vmnet-lab bench guard`: the throughput cost of the guest guard. Two VMs in one sandbox, the same
//! in everything but the guard: one planned and applied with it (the program on its tap, the
//! mark check in its namespace's table), one without. Alternately, in the same run, iperf3
//! uploads from each VM's simulated guest to the fake internet (TCP from the guest's mesh
//! address: every frame the guest sends passes the guard), `rounds` times each. The table shows
//! each round and the median ratio (target ≥ 98 %).
//!
//! # Limitations
//! The simulated guest is a namespace joined to the tap by the sandbox's userspace frame relay,
//! which bounds the throughput (not the kernel path): the ratio says the guard costs nothing
//! measurable at that rate, not what it costs at line rate. Its cost per frame is three kernel
//! reads, a hash lookup and the header checks.
//!
//! # Cleanup
//! The sandbox guard deletes every namespace; the iperf3 server is killed by its pid.

use std::sync::Arc;
use std::time::Duration;

use vmnet_kernel::guard::GuestGuard;
use vmnet_kernel::ns::{NetlinkNsDriver, NsDriver};
use vmnet_model::Error;
use vmnet_model::vm::parse_vm_config;
use vmnet_plan::ns::{HOST_LINK_LOCAL, NsSettings, VmPlan, plan_vm};
use vmnet_sandbox::guest::{GuestConfig, GuestRoute6, SimGuest};
use vmnet_sandbox::netns;
use vmnet_sandbox::sandbox::INET_UPLINK_V6;

use crate::iperf::Server;

/// Arguments of `vmnet-lab bench guard`.
#[derive(Debug, clap::Args)]
pub struct GuardBenchArgs {
    /// Rounds; each measures once without and once with the guard.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub rounds: u32,
    /// Seconds per measurement (after one second of slow start).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=60))]
    pub secs: u32,
}

const PORT: u16 = 5201;

fn internal(what: &'static str) -> impl Fn(String) -> Error {
    move |e| Error::internal(format!("bench guard: {what}: {e}"))
}

/// One iperf3 upload from `guest` to the fake internet's server, MiB/s received.
fn upload(guest: &str, secs: u32) -> Result<f64, Error> {
    let t = secs.to_string();
    let port = PORT.to_string();
    let server = INET_UPLINK_V6.to_string();
    let mut last = String::new();
    for _ in 0..20 {
        let out = netns::exec(
            guest,
            "iperf3",
            &["-c", &server, "-p", &port, "-t", &t, "-O", "1", "-J"],
            Duration::from_secs(u64::from(secs) + 30),
        )
        .map_err(|e| internal("iperf3 -c")(e.to_string()))?;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        if let Some(bps) = v["end"]["sum_received"]["bits_per_second"].as_f64() {
            return Ok(bps / 8.0 / 1_048_576.0);
        }
        last = v["error"].as_str().unwrap_or("no result").to_owned();
        std::thread::sleep(Duration::from_millis(200));
    }
    Err(internal("iperf3")(last))
}

/// Plans and applies VM `uid` with `driver` under `settings`, and attaches a simulated guest.
async fn vm(
    sb: &vmnet_sandbox::Sandbox,
    driver: &NetlinkNsDriver,
    settings: &NsSettings,
    uid: u32,
) -> Result<(VmPlan, SimGuest), Error> {
    let cfg = parse_vm_config(
        format!(
            r#"{{"id":"bench-{uid}","user_id":{uid},"tenant":1,"mesh_ipv6":"fdaa:1::{uid}","network":{{"routes":[{{"destination":"::/0","via":"host"}}]}}}}"#
        )
        .as_bytes(),
    )?;
    let plan = plan_vm(&cfg, settings)?;
    driver
        .apply(&plan)
        .await
        .map_err(|e| internal("apply")(e.to_string()))?;
    let guest_cfg = GuestConfig {
        mesh_ipv6: plan.guest.mesh_ipv6,
        routes_v6: vec![GuestRoute6 {
            destination: "::/0".into(),
            via: Some(HOST_LINK_LOCAL),
        }],
        ..GuestConfig::default()
    };
    let guest = SimGuest::attach(
        sb,
        &format!("g{uid}"),
        &plan.netns,
        &plan.tap.name,
        &guest_cfg,
    )
    .map_err(|e| internal("guest")(e.to_string()))?;
    Ok((plan, guest))
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
/// `INVALID_INPUT` when not root; `INTERNAL` when the sandbox, the guard or iperf3 fails.
pub async fn run(args: GuardBenchArgs) -> Result<(), Error> {
    if !nix::unistd::geteuid().is_root() {
        return Err(Error::invalid(
            "vmnet-lab bench guard must run as root (it creates network namespaces and loads BPF)",
        ));
    }
    let sb = vmnet_sandbox::Sandbox::new("bg").map_err(|e| internal("sandbox")(e.to_string()))?;
    let guard = Arc::new(GuestGuard::load().map_err(|e| internal("load")(e.to_string()))?);
    let base = NsSettings {
        name_prefix: sb.agent_prefix(),
        ..NsSettings::default()
    };
    let guarded = NsSettings {
        guard: true,
        ..base.clone()
    };
    let with = NetlinkNsDriver::new(guarded.clone(), Some(sb.host()))
        .map_err(|e| internal("driver")(e.to_string()))?
        .with_guard(Arc::clone(&guard));
    let without = NetlinkNsDriver::new(base.clone(), Some(sb.host()))
        .map_err(|e| internal("driver")(e.to_string()))?;
    let (p1, g1) = vm(&sb, &with, &guarded, 1).await?;
    let (p2, g2) = vm(&sb, &without, &base, 2).await?;
    if p1.guard.is_none() || p2.guard.is_some() {
        return Err(Error::internal(
            "bench guard: the plans do not differ in the guard",
        ));
    }
    // The fake internet's own uplink address serves.
    let _server = Server::start(&sb.inet(), INET_UPLINK_V6, PORT)?;
    let mut rows = Vec::new();
    for round in 1..=args.rounds {
        let without = upload(g2.netns(), args.secs)?;
        let with = upload(g1.netns(), args.secs)?;
        rows.push((round, without, with));
    }
    let drops = guard
        .drops(1)
        .map_err(|e| internal("counters")(e.to_string()))?
        .map(|d| d.values().sum::<u64>())
        .unwrap_or(0);
    println!(
        "vmnet-lab bench guard: iperf3 upload from a simulated guest to the fake internet, {} s per run",
        args.secs
    );
    println!("  W/O: a VM without the guest guard; W/: a VM with it (same sandbox, alternately)");
    println!(
        "{:<6} {:>12} {:>12} {:>8}",
        "ROUND", "W/O MiB/s", "W/ MiB/s", "RATIO"
    );
    let ratio = |a: f64, b: f64| 100.0 * b / a.max(1e-9);
    for (round, a, b) in &rows {
        println!("{round:<6} {a:>12.1} {b:>12.1} {:>7.1}%", ratio(*a, *b));
    }
    let mut a: Vec<f64> = rows.iter().map(|r| r.1).collect();
    let mut b: Vec<f64> = rows.iter().map(|r| r.2).collect();
    let (ma, mb) = (median(&mut a), median(&mut b));
    println!(
        "{:<6} {ma:>12.1} {mb:>12.1} {:>7.1}%  (target ≥ 98 %; guard drops of the VM meanwhile: {drops})",
        "median",
        ratio(ma, mb)
    );
    drop((g1, g2));
    Ok(())
}
