//! `vmnet-lab up --sandbox examples/pool.json`: pool mode end to end in throwaway namespaces, through
//! the real agent.
//!
//! 1. A sandbox host namespace (uplink to a fake internet, [`crate::Sandbox`]) with the
//!    bridge holding the range's gateway.
//! 2. The agent (`vmnet serve --netns <host> --host-id <host> --bridge <bridge>`, this
//!    executable) with its SQLite database, socket and state in a temporary directory: it starts
//!    its root helper, loads the bcd tables and the tap guard.
//! 3. Over its API, as an operator would: the range (the /29 of the spec's walk-through), the
//!    host, and the instances in order — each takes the lowest free address and is realised
//!    (rules, tap, guard, seed) before the answer; the sixth of a /29 fails with
//!    `CAPACITY_UNAVAILABLE`. Per realised instance a simulated guest is relayed to its tap and
//!    configured from the `network-config` the agent wrote.
//! 4. The checks ([`checks`]): placement, seeds, reachability by policy, the spoof attempts, the
//!    drift gap (the agent held with `SIGSTOP`, the ruleset flushed, the guard alone; then the
//!    agent's own audit repairs it), and the teardown through the API leaving no tap and no set
//!    element. Two tables are printed: instances (lease, tap, MAC, seed address, policy) and
//!    checks.
//!
//! The sandbox (agent, namespaces, taps, database) is removed before the command returns. Exit
//! status non-zero when any check saw something other than expected.

pub mod agent;
pub mod checks;
mod checks6;
mod report;
mod spec;

use std::path::Path;
use std::time::Duration;

use crate::kvm::pool::KvmGuest;
use crate::kvm::{self, GuestKind, Vm, VmConfig};
use crate::netns as tk;
use crate::relay::Relay;
use crate::sandbox::{HOST_UPLINK_V4, Sandbox};
use crate::sim_guest;
use vmnet_agent::api::types::InstanceNics;
use vmnet_agent::client::segment;
use vmnet_model::Error;
use vmnet_model::error::chain;
use vmnet_model::nic::{IfName, MacAddr};

use self::agent::PoolAgent;
use self::checks::GuestInfo;
use self::report::{InstanceRow, PoolReport, print};
pub use self::spec::{PoolSpec, PoolSpecHost, PoolSpecInstance, is_pool_spec};
use crate::state::{Paths, Proc, SandboxState};

fn internal(what: &str) -> impl Fn(String) -> Error + '_ {
    move |m| Error::internal(format!("{what}: {m}"))
}

/// Runs `vmnet-lab up --sandbox FILE` for a pool-mode spec (see the module docs).
///
/// # Errors
/// `INVALID_INPUT` for a bad spec or name; `CONFLICT` when a sandbox of this name (under `root`
/// or by its namespaces) exists or its name and `name` are prefixes of one another;
/// `UNAVAILABLE`/`INTERNAL` when the sandbox cannot be built; `INTERNAL` when a check fails.
pub async fn up_pool(
    json: bool,
    path: &Path,
    name: &str,
    root: &Path,
    timeout: Duration,
    (guests, agent_args): (GuestKind, &[String]),
    mut interrupts: crate::state::Interrupts,
) -> Result<(), Error> {
    if !nix::unistd::geteuid().is_root() {
        return Err(Error::invalid(
            "vmnet-lab up --sandbox must run as root (it creates network namespaces)",
        ));
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::invalid(format!("pool spec {}: {e}", path.display())))?;
    let spec = PoolSpec::parse(&path.display().to_string(), &text)?;
    let bridge: IfName = spec.bridge.parse()?;
    let paths = crate::state::claim(root, name)?;
    // An interrupt (SIGINT, SIGTERM) drops the run: its guards stop the agent and delete the
    // namespaces before this returns.
    // The checks look at `stopping()` and end early, so the interrupt is seen within a check.
    let result = tokio::select! {
        biased;
        why = interrupts.wait() => Err(crate::state::interrupted_error(why, name)),
        r = run(&spec, &bridge, name, &paths, (timeout, agent_args), guests) => r,
    };
    let _ = std::fs::remove_dir_all(&paths.dir);
    let report = result?;
    match json {
        true => {
            println!(
                "{}",
                serde_json::to_string_pretty(&report)
                    .map_err(|e| Error::internal(e.to_string()))?
            );
        }
        false => print(&report),
    }
    let failed = report.checks.iter().filter(|c| !c.ok).count();
    if failed > 0 {
        return Err(Error::internal(format!(
            "{failed} of {} pool sandbox checks failed",
            report.checks.len()
        )));
    }
    Ok(())
}

/// Makes the pool bridge `bridge` in `sb`'s host with the range's gateway on it (`range` the
/// range's network), and routes the range from the fake internet via the host's uplink.
///
/// # Errors
/// `INTERNAL` naming the `ip` command that failed.
pub fn host_bridge(
    sb: &Sandbox,
    spec: &PoolSpec,
    bridge: &IfName,
    range: &ipnet::Ipv4Net,
) -> Result<(), Error> {
    let host = sb.host();
    let gw_cidr = format!("{}/{}", spec.pool.gateway, range.prefix_len());
    let br = bridge.as_str();
    let ipf = internal("sandbox bridge");
    tk::ip(&host, &["link", "add", br, "type", "bridge"]).map_err(|e| ipf(chain(&e)))?;
    tk::ip(&host, &["addr", "add", &gw_cidr, "dev", br]).map_err(|e| ipf(chain(&e)))?;
    tk::ip(&host, &["link", "set", br, "up"]).map_err(|e| ipf(chain(&e)))?;
    tk::ip(
        &sb.inet(),
        &[
            "route",
            "add",
            &range.trunc().to_string(),
            "via",
            &HOST_UPLINK_V4.to_string(),
        ],
    )
    .map_err(|e| ipf(chain(&e)))?;
    // A dual-stack pool: the IPv6 gateway on the bridge too, its range routed back likewise.
    if let Some(r6) = spec.range6() {
        let gw6 = format!("{}/{}", r6.gateway, r6.cidr.prefix_len());
        tk::ip(&host, &["-6", "addr", "add", &gw6, "dev", br, "nodad"])
            .map_err(|e| ipf(chain(&e)))?;
        tk::ip(
            &sb.inet(),
            &[
                "-6",
                "route",
                "add",
                &r6.cidr.trunc().to_string(),
                "via",
                &crate::sandbox::HOST_UPLINK_V6.to_string(),
            ],
        )
        .map_err(|e| ipf(chain(&e)))?;
    }
    Ok(())
}

/// How the real guest of instance `id` boots in namespace `host_ns`: `nics`' qemu arguments
/// (`GET /v1/instances/{id}/nics`) and the NoCloud `seed.iso` the agent wrote, 384 MiB.
///
/// # Errors
/// `UNAVAILABLE` when there is no `seed.iso` (genisoimage missing on the host).
pub fn kvm_config(id: &str, host_ns: &str, nics: &InstanceNics) -> Result<VmConfig, Error> {
    let seed_iso = nics
        .seed_dir
        .as_deref()
        .map(|d| Path::new(d).join("seed.iso"))
        .filter(|p| p.is_file())
        .ok_or_else(|| {
            Error::unavailable(format!("instance {id}: no seed.iso (genisoimage missing?)"))
        })?;
    Ok(VmConfig {
        name: id.to_owned(),
        netns: host_ns.to_owned(),
        nic_args: nics.runtime.qemu_args.clone(),
        seed_iso: Some(seed_iso),
        cmdline_extra: String::new(),
        disks: Vec::new(),
        cpus: 1,
        memory_mib: 384,
    })
}

async fn run(
    spec: &PoolSpec,
    bridge: &IfName,
    name: &str,
    paths: &Paths,
    (timeout, agent_args): (Duration, &[String]),
    kind: GuestKind,
) -> Result<PoolReport, Error> {
    let dir = &paths.dir;
    let kvm = match kind {
        GuestKind::Kvm => Some(kvm::setup()?),
        GuestKind::Sim => None,
    };
    let mut vms: Vec<KvmGuest> = Vec::new();
    let range_net: ipnet::Ipv4Net = spec
        .pool
        .cidr
        .parse()
        .map_err(|e| Error::invalid(format!("pool {}: cidr: {e}", spec.pool.pool_id)))?;
    let sb = Sandbox::with_prefix(name).map_err(|e| {
        Error::conflict(format!(
            "{}: run `vmnet-lab down --sandbox --name {name}` first",
            chain(&e)
        ))
    })?;
    let host = sb.host();
    let mut st = SandboxState {
        name: name.to_owned(),
        host_ns: host.clone(),
        inet_ns: sb.inet(),
        ..SandboxState::default()
    };
    paths.save(&st)?;
    host_bridge(&sb, spec, bridge, &range_net)?;

    let agent = PoolAgent::start(spec, &host, name, dir, (agent_args, timeout)).await?;
    eprintln!(
        "agent pid {}, log {} (removed with the sandbox)\nagent command: {}",
        agent.pid(),
        dir.join("agent.log").display(),
        crate::agent_args::shell_line(agent.command())
    );
    // Recorded so `vmnet-lab down --sandbox` can stop it should this process die without cleaning up.
    st.procs.push(Proc {
        role: "agent".into(),
        pid: agent.pid(),
        log: Some(dir.join("agent.log")),
        command: agent.command().to_vec(),
    });
    paths.save(&st)?;
    let mut rows = Vec::new();
    let mut guests = Vec::new();
    let mut relays = Vec::new();
    let mut created = Vec::new();
    let mut placement = Vec::new();
    let mut range = None;
    let range6 = spec.range6();
    let outcome: Result<(), Error> = async {
        agent.set_up_pool(spec).await?;
        for i in &spec.instances {
            let row = |lease: String, tap: &str, mac: &str, seed_address: &str| InstanceRow {
                instance: i.instance_id.clone(),
                policy: format!("{:?}", i.policy).to_lowercase(),
                lease,
                lease6: "-".to_owned(),
                tap: tap.into(),
                mac: mac.into(),
                seed_address: seed_address.into(),
            };
            let inst = match agent.create_instance(spec, i).await {
                Ok(inst) => inst,
                Err(e) => {
                    placement.push((i.instance_id.clone(), Err(e.code)));
                    rows.push(row(format!("{}: {}", e.code, e.message), "-", "-", "-"));
                    continue;
                }
            };
            created.push(i.instance_id.clone());
            let addr = inst.address.ok_or_else(|| {
                Error::internal(format!(
                    "instance {}: created without a lease",
                    i.instance_id
                ))
            })?;
            placement.push((i.instance_id.clone(), Ok((addr, inst.address6))));
            let lease6 = inst
                .address6
                .map_or_else(|| "-".to_owned(), |a| a.to_string());
            let nics: InstanceNics = agent
                .client
                .get(&format!("/v1/instances/{}/nics", segment(&i.instance_id)))
                .await?;
            let nic = nics.nics.first().filter(|_| nics.realised).ok_or_else(|| {
                Error::internal(format!(
                    "instance {}: not realised on the host; {}",
                    i.instance_id,
                    agent.log_tail()
                ))
            })?;
            let seed_file = agent.seeds.join(&i.instance_id).join("network-config");
            let network_config = std::fs::read_to_string(&seed_file)
                .map_err(|e| Error::internal(format!("{}: {e}", seed_file.display())))?;
            let mac: MacAddr = nic.mac.parse()?;
            if let Some((image, accel)) = &kvm {
                let cfg = kvm_config(&i.instance_id, &host, &nics)?;
                let vm = Vm::start(&cfg, image, *accel, dir)?;
                st.procs.push(Proc {
                    role: format!("qemu {}", i.instance_id),
                    pid: vm.pid(),
                    ..Proc::default()
                });
                paths.save(&st)?;
                rows.push(InstanceRow {
                    lease6,
                    ..row(addr.to_string(), &nic.tap, &nic.mac, "cloud-init")
                });
                vms.push(KvmGuest {
                    id: i.instance_id.clone(),
                    vm,
                    ch: None,
                    mac,
                    ip4: addr,
                    ip6: inst.address6,
                    policy: i.policy,
                    ready_secs: None,
                });
                continue;
            }
            let ns = sb
                .add_netns(&format!("g{}", guests.len()))
                .map_err(|e| Error::unavailable(chain(&e)))?;
            for k in ["all", "default"] {
                tk::sysctl(&ns, &format!("net/ipv6/conf/{k}/accept_dad"), "0")
                    .map_err(|e| Error::unavailable(chain(&e)))?;
            }
            relays.push(
                Relay::start(&host, &nic.tap, &ns, "eth0")
                    .map_err(|e| Error::unavailable(chain(&e)))?,
            );
            let net = sim_guest::configure(&ns, "eth0", mac, Some(&network_config))
                .map_err(internal("simulated guest"))?;
            rows.push(InstanceRow {
                lease6,
                ..row(
                    addr.to_string(),
                    &nic.tap,
                    &nic.mac,
                    &net.addresses.join(","),
                )
            });
            guests.push(GuestInfo {
                id: i.instance_id.clone(),
                ns,
                mac,
                ip4: addr,
                ip6: inst.address6,
                policy: i.policy,
                seed_addresses: net.addresses,
                seed_routes: net.routes,
            });
        }
        let pool: vmnet_model::pool::Pool = agent
            .client
            .get(&format!("/v1/pools/{}", segment(&spec.pool.pool_id)))
            .await?;
        range = pool.range;
        std::thread::sleep(Duration::from_millis(500));
        Ok(())
    }
    .await;
    let mut checks = Vec::new();
    if let (Ok(()), Some(r), Some(_)) = (&outcome, &range, &kvm) {
        let pl = &placement;
        let vms = &mut vms;
        checks = tokio::task::block_in_place(|| {
            let mut all = checks::run(&[], (r, range6.as_ref()), pl);
            all.extend(kvm::pool::wait_booted(vms, KVM_BOOT_WAIT));
            all.extend(kvm::pool::run(vms, r, &spec.pool.dns));
            if let Some(r6) = &range6 {
                all.extend(kvm::pool::run6(vms, r6));
            }
            all
        });
        for g in vms.iter() {
            if let Some(s) = g.ready_secs {
                eprintln!(
                    "{}: network-ready (cloud-init done) {s:.1} s after its qemu started",
                    g.id
                );
            }
        }
    } else if let (Ok(()), Some(r)) = (&outcome, &range) {
        let (gs, pl) = (&guests, &placement);
        let rt = tokio::runtime::Handle::current();
        let agent = &agent;
        checks = tokio::task::block_in_place(|| {
            let mut all = checks::run(gs, (r, range6.as_ref()), pl);
            all.extend(checks::host_reach(
                gs,
                &host,
                bridge.as_str(),
                (r.gateway, range6.as_ref().map(|r6| r6.gateway)),
            ));
            let before = std::cell::Cell::new(0);
            let mut hold_audit = || {
                before.set(
                    rt.block_on(agent.pool_status())
                        .map_err(|e| e.message)?
                        .drift_repairs,
                );
                agent.signal(nix::sys::signal::Signal::SIGSTOP)
            };
            let mut audit = || {
                agent.signal(nix::sys::signal::Signal::SIGCONT)?;
                Ok(rt
                    .block_on(agent.wait_repair(before.get(), AUDIT_WAIT))
                    .is_some())
            };
            all.extend(checks::gap(
                gs,
                &mut checks::GapHost {
                    ns: &host,
                    bridge: bridge.as_str(),
                    hold_audit: &mut hold_audit,
                    audit: &mut audit,
                },
            ));
            all
        });
    }
    drop(relays);
    drop(vms);
    // Deleting the instances through the API removes their taps, rules and seeds.
    for id in &created {
        if let Err(e) = agent.delete_instance(id).await {
            checks.push(checks::check(
                format!("teardown: delete {id}"),
                "deleted",
                e.to_string(),
            ));
        }
    }
    if outcome.is_ok() && range.is_some() {
        checks.push(checks::left_behind(&host));
    }
    let (agent_pid, agent_command) = (agent.pid(), agent.command().to_vec());
    drop(agent);
    drop(sb);
    outcome?;
    Ok(PoolReport {
        sandbox: name.to_owned(),
        agent_pid,
        agent_command,
        instances: rows,
        checks,
    })
}

/// How long real guests get to boot and finish cloud-init (TCG on a loaded host is slow).
const KVM_BOOT_WAIT: Duration = Duration::from_secs(600);

/// How long the gap check waits for the agent's audit (one 5 s period and some slack).
const AUDIT_WAIT: Duration = Duration::from_secs(6);
