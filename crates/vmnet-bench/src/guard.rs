//! `vmnet-lab bench guard`: the throughput cost of the guest guard, on one VM measured with
//! and without it. One VM in a sandbox, planned and applied with the guard, its simulated guest
//! attached by one frame relay; iperf3 uploads from the guest to the fake internet (TCP from
//! the guest's mesh address: every frame the guest sends passes the guard). Each round measures
//! without, with, with, without (ABBA: a drift of the machine's load within the round cancels
//! out) and its ratio is the sum with over the sum without; the table shows each round (the
//! means of its two measurements) and the median ratio of the rounds (target ≥ 98 %).
//!
//! - Without: the VM's plan without the guard applied (its table loses the chain that drops
//!   unmarked packets) and the tap's clsact qdisc deleted (with the guard's filter): the state
//!   of a VM an agent started with `--no-guest-guard` creates.
//! - With: the plan with the guard applied again (the driver attaches the program and writes
//!   the chain back); the bench checks that the driver then finds no drift, and that it found
//!   the guard missing while without.
//!
//! Below the table, the program's own time per frame: the kernel runs it
//! (`BPF_PROG_TEST_RUN`, [`GuestGuard::test_run_in`]) on the VM's tap, in its netns, on an honest
//! 1380-byte TCP frame from the guest, checked to pass.
//!
//! Measuring one VM both ways keeps everything else equal: two VMs, each behind its own relay
//! (threads placed by the scheduler on this 2-core machine), differ by several percent
//! without any guard.
//!
//! # Limitations
//! The simulated guest is a namespace joined to the tap by the sandbox's userspace frame relay,
//! which bounds the throughput (not the kernel path): the ratio says what the guard costs at
//! that rate, not at line rate. The relay writes up to 64 KiB GSO frames (virtio-net framing),
//! so the program runs once per up to 64 KiB; the ratio swings by a few percent from round to
//! round with the load of the machine, hence the median of several rounds.
//!
//! # Cleanup
//! The sandbox guard deletes every namespace; the iperf3 server is killed by its pid.

use std::sync::Arc;
use std::time::Duration;

use vmnet_kernel::guard::GuestGuard;
use vmnet_kernel::ns::{NetlinkNsDriver, NsDriver};
use vmnet_model::Error;
use vmnet_model::vm::{VmConfig, parse_vm_config};
use vmnet_plan::ns::{HOST_LINK_LOCAL, NsSettings, VmPlan, plan_vm};
use vmnet_sandbox::guest::{GuestConfig, GuestRoute6, SimGuest};
use vmnet_sandbox::netns;
use vmnet_sandbox::sandbox::INET_UPLINK_V6;

use crate::iperf::Server;
use crate::mesh_cost;

/// Arguments of `vmnet-lab bench guard`.
#[derive(Debug, clap::Args)]
pub struct GuardBenchArgs {
    /// Rounds; each measures twice without and twice with the guard (without, with, with,
    /// without).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=20))]
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

/// The config of VM `uid`: a mesh address, the internet via the host.
fn config(uid: u32) -> Result<VmConfig, Error> {
    Ok(parse_vm_config(
        format!(
            r#"{{"id":"bench-{uid}","user_id":{uid},"tenant":1,"mesh_ipv6":"fdaa:1::{uid}","network":{{"routes":[{{"destination":"::/0","via":"host"}}]}}}}"#
        )
        .as_bytes(),
    )?)
}

/// Plans and applies VM `uid` with `driver` under `settings`, and attaches a simulated guest.
async fn vm(
    sb: &vmnet_sandbox::Sandbox,
    driver: &NetlinkNsDriver,
    settings: &NsSettings,
    uid: u32,
) -> Result<(VmPlan, SimGuest), Error> {
    let plan = plan_vm(&config(uid)?, settings)?;
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

/// The tap's clsact qdisc deleted, in the VM's netns (its filters go with it); a tap without one
/// is fine.
async fn delete_clsact(netns: &str, tap: &str) -> Result<(), Error> {
    let name = tap.to_owned();
    let index =
        vmnet_kernel::netns::run_in(netns, move || nix::net::if_::if_nametoindex(name.as_str()))
            .map_err(|e| internal("enter the VM's netns")(e.to_string()))?
            .map_err(|e| internal("find the tap")(format!("{netns}: {tap}: {e}")))?;
    let index = i32::try_from(index).unwrap_or(i32::MAX);
    let h =
        vmnet_kernel::netns::netlink_in(netns).map_err(|e| internal("netlink")(e.to_string()))?;
    let mut del = h.qdisc().del(index);
    let m = del.message_mut();
    m.header.parent = TC_H_CLSACT.into();
    m.header.handle = CLSACT_HANDLE.into();
    match del.execute().await {
        // No clsact qdisc (EINVAL, ENOENT): nothing to delete.
        Err(rtnetlink::Error::NetlinkError(e))
            if matches!(e.raw_code().abs(), libc::EINVAL | libc::ENOENT) =>
        {
            Ok(())
        }
        r => r.map_err(|e| internal("delete the clsact qdisc")(e.to_string())),
    }
}

/// `TC_H_CLSACT`: the parent of a clsact qdisc.
const TC_H_CLSACT: u32 = 0xffff_fff1;
/// The handle of a clsact qdisc (`ffff:`).
const CLSACT_HANDLE: u32 = 0xffff_0000;

/// Repetitions in one test run of the program, and test runs.
const COST_REPEAT: u32 = 100_000;
const COST_RUNS: usize = 11;

/// The program's time per frame: the median of [`COST_RUNS`] test runs in the VM's netns, on
/// its tap, of an honest 1380-byte TCP frame from the guest's mesh address (each checked to
/// pass).
fn program_cost(guard: &GuestGuard, plan: &VmPlan) -> Result<Duration, Error> {
    let mesh = plan
        .guest
        .mesh_ipv6
        .ok_or_else(|| internal("program cost")("the VM has no mesh address".into()))?;
    let frame = mesh_cost::ethernet(&mesh_cost::ipv6_tcp(mesh, INET_UPLINK_V6, 1380));
    let mut times = Vec::with_capacity(COST_RUNS);
    for _ in 0..COST_RUNS {
        let r = guard
            .test_run_in(&plan.netns, &plan.tap.name, &frame, COST_REPEAT)
            .map_err(|e| internal("program cost")(vmnet_model::error::chain(&e)))?;
        if r.verdict != TC_ACT_UNSPEC {
            return Err(internal("program cost")(format!(
                "the honest frame got verdict {} (expected {TC_ACT_UNSPEC}, passed)",
                r.verdict
            )));
        }
        times.push(r.per_frame);
    }
    times.sort_unstable();
    Ok(times[times.len() / 2])
}

/// The tc verdict of a frame the guard passes.
const TC_ACT_UNSPEC: i32 = -1;

/// The VM in the state of `guarded`: with the guard (its plan applied with it, then no drift
/// left) or without (its plan without the guard applied and the tap's clsact qdisc deleted,
/// then the guard's driver finds it missing).
async fn set_guard(
    with: &NetlinkNsDriver,
    without: &NetlinkNsDriver,
    plans: (&VmPlan, &VmPlan),
    guarded: bool,
) -> Result<(), Error> {
    let (on, off) = plans;
    let apply = |e: vmnet_kernel::ns::NsError| internal("apply")(e.to_string());
    let drift = |e: vmnet_kernel::ns::NsError| internal("drift")(e.to_string());
    if guarded {
        with.apply(on).await.map_err(apply)?;
        let left = with.drift(on).await.map_err(drift)?;
        if !left.is_empty() {
            return Err(internal("with the guard")(format!(
                "the driver still finds drift: {left:?}"
            )));
        }
    } else {
        without.apply(off).await.map_err(apply)?;
        delete_clsact(&off.netns, &off.tap.name).await?;
        if with.drift(on).await.map_err(drift)?.is_empty() {
            return Err(internal("without the guard")(
                "the guard's driver still finds the guard in place".into(),
            ));
        }
    }
    Ok(())
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
    let (on, guest) = vm(&sb, &with, &guarded, 1).await?;
    let off = plan_vm(&config(1)?, &base)?;
    if on.guard.is_none() || off.guard.is_some() || on.netns != off.netns {
        return Err(Error::internal(
            "bench guard: the plans differ in more than the guard",
        ));
    }
    // The fake internet's own uplink address serves.
    let _server = Server::start(&sb.inet(), INET_UPLINK_V6, PORT)?;
    let mut rows = Vec::new();
    for round in 1..=args.rounds {
        let (mut without_sum, mut with_sum) = (0.0, 0.0);
        for guarded in [false, true, true, false] {
            set_guard(&with, &without, (&on, &off), guarded).await?;
            let v = upload(guest.netns(), args.secs)?;
            if guarded {
                with_sum += v;
            } else {
                without_sum += v;
            }
        }
        rows.push((round, without_sum / 2.0, with_sum / 2.0));
    }
    // Leave the VM as planned (with the guard) for the sandbox's cleanup.
    set_guard(&with, &without, (&on, &off), true).await?;
    let per_frame = program_cost(&guard, &on)?;
    let drops = guard
        .drops(1)
        .map_err(|e| internal("counters")(e.to_string()))?
        .map(|d| d.values().sum::<u64>())
        .unwrap_or(0);
    println!(
        "vmnet-lab bench guard: iperf3 upload from a simulated guest to the fake internet, {} s per run",
        args.secs
    );
    println!(
        "  one VM, alternately without the guest guard (W/O) and with it (W/): without, with, with, without in each round"
    );
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
    let mut r: Vec<f64> = rows.iter().map(|r| ratio(r.1, r.2)).collect();
    let (ma, mb, mr) = (median(&mut a), median(&mut b), median(&mut r));
    println!(
        "{:<6} {ma:>12.1} {mb:>12.1} {mr:>7.1}%  (target ≥ 98 %; guard drops of the VM meanwhile: {drops})",
        "median",
    );
    println!(
        "  program: {} ns per frame (BPF_PROG_TEST_RUN on the VM's tap, an honest 1380-byte TCP frame; median of {COST_RUNS} runs of {COST_REPEAT})",
        per_frame.as_nanos()
    );
    drop(guest);
    Ok(())
}
