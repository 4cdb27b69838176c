//! `vmnet-lab bench mesh --case forwarding`: the mesh data plane's TCP throughput. Two throwaway
//! fleet hosts run `wireguard-go` over the shared private network with the BPF programs of
//! `vmnet_kernel::mesh` ([`MeshLab`]); one VM of tenant 1 on each. In the same run, alternately,
//! iperf3 measures host to host (mesh address to mesh address over wg0, no encapsulation) and VM
//! to VM across the hosts (encapsulated by the programs, the same wg0), `runs` times each for
//! `secs` seconds. The table shows the median of each, their ratio (the goal: at least 0.9) and
//! the UDP receive-buffer errors counted meanwhile in the receiving host's namespace, twice in
//! one run: with `wireguard-go`'s UDP sockets as it sets them (212,992 bytes here), then sized
//! as the agent sizes them (`--wg-socket-buffer-bytes`, [`vmnet_kernel::wg::sockbuf`]); then
//! the programs' cost per packet on the second lab ([`crate::mesh_cost`]).
//!
//! The VM path carries 40 bytes more per packet (1380-byte VM packets in 1420-byte outer
//! ones), so the ratio's ceiling from header overhead alone is 1320/1360 = 0.97 (TCP payload
//! per packet, IPv6 without options).
//!
//! # Cleanup
//! The lab's guard stops the `wireguard-go` processes, unmounts its bpffs and deletes the
//! namespaces; each iperf3 server is killed on drop.

use std::fmt::Write as _;
use std::net::Ipv6Addr;
use std::time::Duration;

use serde_json::Value;
use vmnet_model::Error;
use vmnet_sandbox::mesh_lab::{LabVm, MeshLab, VM_MTU};
use vmnet_sandbox::netns;

use crate::iperf::Server;

/// The goal: VM-to-VM throughput over host-to-host throughput.
pub const GOAL_RATIO: f64 = 0.9;

const PORT: u16 = 5201;

fn unavailable(what: &str) -> impl Fn(vmnet_sandbox::SandboxError) -> Error + '_ {
    move |e| Error::unavailable(format!("bench mesh forwarding: {what}: {e}"))
}

/// One iperf3 TCP run from `ns` to `addr`: the receiver's rate in MiB/s.
fn measure(ns: &str, addr: Ipv6Addr, secs: u32) -> Result<f64, Error> {
    let target = addr.to_string();
    let t = secs.to_string();
    let port = PORT.to_string();
    let args = ["-c", &target, "-p", &port, "-t", &t, "-O", "1", "-J"];
    let mut last = String::new();
    // The server may not listen yet on the first run.
    for _ in 0..20 {
        let out = netns::exec(
            ns,
            "iperf3",
            &args,
            Duration::from_secs(u64::from(secs) + 20),
        )
        .map_err(unavailable("iperf3 -c"))?;
        let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        if let Some(bps) = v["end"]["sum_received"]["bits_per_second"].as_f64()
            && v["error"].is_null()
        {
            return Ok(bps / 8.0 / 1_048_576.0);
        }
        last = format!(
            "{} {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    Err(Error::unavailable(format!(
        "bench mesh forwarding: iperf3 to {addr}: {last}"
    )))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// One lab's figures: medians, the runs, the receiving host's UDP buffer errors meanwhile.
struct Figures {
    host: Vec<f64>,
    vm: Vec<f64>,
    /// Receive-buffer errors on the receiving host (both families) during the host runs, the
    /// VM runs; and on the sending host (the ACKs) during all of them.
    rcvbuf_host: u64,
    rcvbuf_vm: u64,
    rcvbuf_sender: u64,
    /// The receiving `wireguard-go`'s UDP receive buffers (`SO_RCVBUF`), as read back.
    rcvbuf_bytes: Vec<usize>,
    encapsulated: u64,
}

fn counters(ns: &str) -> Result<vmnet_sandbox::udpstat::UdpErrors, Error> {
    vmnet_sandbox::udpstat::read(ns)
        .map_err(|e| Error::unavailable(format!("bench mesh forwarding: UDP counters: {e}")))
}

/// Builds a lab whose `wireguard-go` sockets get `socket_bytes` and measures it; the lab and
/// its VMs are handed back for the cost cases.
fn measure_lab(
    runs: u32,
    secs: u32,
    socket_bytes: Option<u32>,
) -> Result<(Figures, MeshLab, LabVm, LabVm), Error> {
    let lab = MeshLab::new_with(2, socket_bytes).map_err(unavailable("lab"))?;
    let mesh = |h: u16| Ipv6Addr::new(0xfdaa, h, 0, 0, 0, 0, 0, 1);
    let a = lab
        .add_vm(0, 1, 1, mesh(1), VM_MTU)
        .map_err(unavailable("vm a"))?;
    let c = lab
        .add_vm(1, 1, 1, mesh(2), VM_MTU)
        .map_err(unavailable("vm c"))?;
    for vm in [&a, &c] {
        lab.publish(vm).map_err(unavailable("publish"))?;
    }
    lab.wait_tunnels().map_err(unavailable("tunnels"))?;
    let (h0, h1) = (&lab.hosts[0], &lab.hosts[1]);
    let rcvbuf_bytes = h1
        .socket_buffers()
        .map_err(unavailable("socket buffers"))?
        .iter()
        .map(|s| s.rcvbuf)
        .collect();
    let figures = {
        let _hs = Server::start(&h1.net.ns, h1.mesh, PORT)?;
        let _vs = Server::start(&c.ns, c.mesh, PORT)?;
        let before = h0
            .plane
            .passes()
            .map_err(|e| Error::unavailable(format!("bench mesh forwarding: counters: {e}")))?;
        let sender0 = counters(&h0.net.ns)?;
        let (mut host, mut vm) = (Vec::new(), Vec::new());
        let (mut rcvbuf_host, mut rcvbuf_vm) = (0, 0);
        for _ in 0..runs {
            let r0 = counters(&h1.net.ns)?;
            host.push(measure(&h0.net.ns, h1.mesh, secs)?);
            let r1 = counters(&h1.net.ns)?;
            vm.push(measure(&a.ns, c.mesh, secs)?);
            let r2 = counters(&h1.net.ns)?;
            rcvbuf_host += r1.since(&r0).rcvbuf();
            rcvbuf_vm += r2.since(&r1).rcvbuf();
        }
        let after = h0
            .plane
            .passes()
            .map_err(|e| Error::unavailable(format!("bench mesh forwarding: counters: {e}")))?;
        Figures {
            host,
            vm,
            rcvbuf_host,
            rcvbuf_vm,
            rcvbuf_sender: counters(&h0.net.ns)?.since(&sender0).rcvbuf(),
            rcvbuf_bytes,
            encapsulated: after["encapsulated"] - before["encapsulated"],
        }
    };
    Ok((figures, lab, a, c))
}

/// Runs the bench and returns its table: first with `wireguard-go`'s sockets as it sets them,
/// then sized to `socket_bytes` as the agent sizes them, in the same run.
///
/// # Errors
/// `UNAVAILABLE` when the lab or iperf3 fails.
pub fn run(runs: u32, secs: u32, socket_bytes: u32) -> Result<String, Error> {
    let (before, lab, _, _) = measure_lab(runs, secs, None)?;
    drop(lab);
    let (after, lab, a, c) = measure_lab(runs, secs, Some(socket_bytes))?;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "mesh forwarding: TCP over wg0 (wireguard-go) between two fleet hosts, iperf3, {runs} runs of {secs} s each, alternating;\n\
         UDP receive-buffer errors counted in the receiving host's namespace (Udp + Udp6 RcvbufErrors)"
    );
    let _ = writeln!(
        out,
        "{:<34} {:>12} {:>26} {:>14}",
        "path", "median MiB/s", "runs MiB/s", "rcvbuf errors"
    );
    let fmt = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.1}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    for (name, mut f) in [
        ("as wireguard-go sets them", before),
        ("sized by vmnet", after),
    ] {
        let _ = writeln!(
            out,
            "wireguard-go's UDP sockets {name} (SO_RCVBUF on the receiver: {})",
            f.rcvbuf_bytes
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        );
        let (host_runs, vm_runs) = (fmt(&f.host), fmt(&f.vm));
        let (hm, vmm) = (median(&mut f.host), median(&mut f.vm));
        let ratio = if hm > 0.0 { vmm / hm } else { 0.0 };
        let _ = writeln!(
            out,
            "  {:<32} {hm:>12.1} {host_runs:>26} {:>14}",
            "host to host (mesh addresses)", f.rcvbuf_host
        );
        let _ = writeln!(
            out,
            "  {:<32} {vmm:>12.1} {vm_runs:>26} {:>14}",
            "VM to VM across hosts (BPF encap)", f.rcvbuf_vm
        );
        let _ = writeln!(
            out,
            "  ratio VM/host {ratio:.2} (goal >= {GOAL_RATIO}: {}); rcvbuf errors on the sender (ACKs) {}; packets encapsulated on the sender {}",
            if ratio >= GOAL_RATIO { "met" } else { "missed" },
            f.rcvbuf_sender,
            f.encapsulated
        );
    }
    let cost = crate::mesh_cost::run(&lab, &a, &c)?;
    write_cost(&mut out, &cost);
    Ok(out)
}

/// The per-packet table: each case with and without the source check, and the goal.
fn write_cost(out: &mut String, cost: &[crate::mesh_cost::CostRow]) {
    use crate::mesh_cost::{GOAL_NS, REPEAT, ROUNDS, SINGLES, goal_met};
    let _ = writeln!(
        out,
        "\nper-packet cost of the programs (BPF_PROG_TEST_RUN, 1380-byte packets), with and without \
         mesh_from_vm's source check, {ROUNDS} rounds each alternately: a round is the mean of \
         {REPEAT} repetitions, or the median of {SINGLES} single runs where the program rewrites \
         the packet; the median round shown"
    );
    let _ = writeln!(
        out,
        "{:<50} {:<13} {:<7} {:>10} {:>10} {:>8}",
        "decision", "program", "round", "check ns", "no check", "diff ns"
    );
    for r in cost {
        let (unchecked, diff) = match (r.unchecked, r.difference_ns()) {
            (Some(u), Some(d)) => (u.as_nanos().to_string(), format!("{d:+.0}")),
            _ => ("-".to_owned(), "-".to_owned()),
        };
        let _ = writeln!(
            out,
            "{:<50} {:<13} {:<7} {:>10} {:>10} {:>8}",
            r.case,
            r.program,
            r.method,
            r.checked.as_nanos(),
            unchecked,
            diff
        );
    }
    let _ = writeln!(
        out,
        "source check costs <= {GOAL_NS} ns per packet: {} (the spoofed source: the check's own drop; without the check it is encapsulated)",
        if goal_met(cost) { "met" } else { "MISSED" }
    );
}
