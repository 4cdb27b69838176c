//! `vmnet-lab bench boot`: how fast the agent (`vmnet serve`) is ready after a start with N
//! stored VMs, on an empty kernel (a host reboot) and on the kernel state a previous agent left
//! (an agent restart or upgrade).
//!
//! It creates a sandbox and a state directory as `vmnet-lab bench agent` does, starts an agent
//! there and PUTs VMs 1..=N (the same configs as that bench: a mesh address, `0.0.0.0/0` and
//! `::/0` via host, packet activity on), waits for a full reconcile pass over them (as on a
//! host in service, where the VMs were created long before) and stops it (SIGTERM: it saves
//! the records of the tables it found as planned for the next agent). Then, each time timing from
//! just before the process is spawned:
//!
//! 1. **Restart.** It records the kernel state: each VM netns's identity and nf_tables
//!    generation (the count of its committed transactions) and the host netns's, and every host
//!    veth's ifindex. It starts a second agent on the same store and polls `GET /readyz` every
//!    5 ms: the first answer (the API is up), the first 200 (ready: the first full reconcile
//!    pass since the start ended). Then it reads `GET /v1/status` and the kernel again and
//!    proves nothing was rewritten: no repair counted, no change logged as an adoption of an
//!    earlier agent's object, no nf_tables commit in any namespace, no netns or host veth made
//!    again.
//! 2. **Reboot.** It stops that agent, deletes every namespace of the sandbox (the VMs' and the
//!    host's: their links, addresses, routes, rules and tables go with them) and unmounts the
//!    agent's bpffs, then makes the sandbox's host and fake internet namespaces again, as after
//!    a reboot; the store keeps its N VMs, each recorded as applied. It starts a third agent and
//!    polls `GET /readyz` as above; the first pass's end (from the agent's own record in
//!    `GET /v1/status`) is when every VM was applied. It then checks the kernel holds N VM
//!    namespaces and the status no failed VM.
//!
//! It prints a table (figure, value, goal): ≤ 3 s to ready after a reboot and ≤ 0.5 s after a
//! restart, at 1,000 VMs on 2 cores.
//!
//! # Cleanup
//! As `vmnet-lab bench agent`: each agent is stopped by pid and reaped by a guard, also on
//! error; the sandbox guard deletes its namespaces, then the state directory goes.
//!
//! # Limitations
//! The polls cost the agent a little CPU (one request per 5 ms). The time to ready includes
//! the start of the process (`vmnet` runs `vmnetd serve`).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use hyper::Method;
use vmnet_agent::api::types::{AgentStatus, VmView};
use vmnet_agent::client::Client;
use vmnet_kernel::nftgen::{GenSocket, NsId};
use vmnet_kernel::ns::{NetlinkNsDriver, NsDriver};
use vmnet_model::Error;
use vmnet_plan::ns::NsSettings;

use crate::agent::{ACTIVITY_DIR, AgentProc, StateDir, log_tail, vm_body};
use crate::procstat::{cpu_busy_ms, proc_cpu_ms};

mod report;
pub use report::{BootRow, render};

/// Arguments of this command.
#[derive(Debug, clap::Args)]
pub struct BootBenchArgs {
    /// VMs in the store.
    #[arg(long, default_value_t = 1000)]
    pub vms: u32,
}

/// How long the bench waits for an agent to be ready.
const READY_WAIT: Duration = Duration::from_secs(300);

/// How often it asks `GET /readyz`.
const POLL: Duration = Duration::from_millis(5);

/// One agent start, timed from just before its spawn.
#[derive(Debug, Clone)]
pub struct Start {
    /// To the first answer of the API (any status).
    pub api: Duration,
    /// To the first `GET /readyz` 200.
    pub ready: Duration,
    /// To the end of the first reconcile pass, from the agent's record; `None` when more than
    /// one pass had run when the status was read.
    pub first_pass_end: Option<Duration>,
    /// The agent's CPU time (user and system, every thread) at ready.
    pub cpu: Option<Duration>,
    /// The host's CPU time (every process, both cores) from the spawn to ready.
    pub host_cpu: Option<Duration>,
    /// The status read right after ready.
    pub status: AgentStatus,
    /// The lines of the agent's log saying it replaced an earlier agent's objects.
    pub adoptions: Vec<String>,
    /// The VM tables whose records it took from the agent before it (its log).
    pub tables_taken: u64,
}

/// The kernel state a restart must leave alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelState {
    /// Each namespace of the agent (host and VMs): its identity and nf_tables generation.
    pub gens: BTreeMap<String, (NsId, u32)>,
    /// Each VM's host veth by user id: name and ifindex.
    pub veths: BTreeMap<u32, (String, u32)>,
    /// How long one observe of the host took (namespaces, host veths, rules: what a change pass
    /// checks per VM), from this process.
    pub observe: Duration,
}

impl KernelState {
    /// VM namespaces.
    #[must_use]
    pub fn vm_netns(&self) -> usize {
        self.gens.len().saturating_sub(1)
    }
}

/// What changed from `before` to `after`: namespaces with another identity or generation
/// (nf_tables commits), namespaces gone or new, host veths made again or gone.
#[must_use]
pub fn rewritten(before: &KernelState, after: &KernelState) -> (Vec<String>, Vec<String>) {
    let mut ns = Vec::new();
    for (name, (id, g)) in &before.gens {
        match after.gens.get(name) {
            None => ns.push(format!("{name}: gone")),
            Some((id2, _)) if id2 != id => ns.push(format!("{name}: made again")),
            Some((_, g2)) if g2 != g => {
                ns.push(format!("{name}: {} nft commits", g2.wrapping_sub(*g)))
            }
            Some(_) => {}
        }
    }
    ns.extend(
        after
            .gens
            .keys()
            .filter(|n| !before.gens.contains_key(*n))
            .map(|n| format!("{n}: new")),
    );
    let mut veths = Vec::new();
    for (uid, (name, ix)) in &before.veths {
        match after.veths.get(uid) {
            Some((n2, ix2)) if n2 == name && ix2 == ix => {}
            Some((n2, ix2)) => veths.push(format!("{name} ({ix}) now {n2} ({ix2})")),
            None => veths.push(format!("{name}: gone")),
        }
    }
    (ns, veths)
}

/// Reads the kernel state of the agent with `prefix` whose host netns is `host`.
async fn kernel_state(host: &str, prefix: &str) -> Result<KernelState, Error> {
    let mut names: Vec<String> = vmnet_sandbox::sandbox::owned(prefix)
        .into_iter()
        .filter(|n| n.len() == prefix.len() + 5)
        .collect();
    names.push(host.to_owned());
    let mut gens = BTreeMap::new();
    for name in names {
        let g = vmnet_sandbox::netns::run_in(&name, || {
            let mut s = GenSocket::open_here()?;
            s.read().map(|g| (s.netns(), g))
        })
        .map_err(|e| Error::internal(format!("netns {name}: {e}")))?
        .map_err(|e| Error::internal(format!("netns {name}: nf_tables generation: {e}")))?;
        gens.insert(name, g);
    }
    let observer = NetlinkNsDriver::new(
        NsSettings {
            name_prefix: prefix.to_owned(),
            ..NsSettings::default()
        },
        Some(host.to_owned()),
    )
    .map_err(|e| Error::internal(format!("observer: {e}")))?;
    let t = Instant::now();
    let seen = observer
        .observe()
        .await
        .map_err(|e| Error::internal(format!("observe: {e}")))?;
    let observe = t.elapsed();
    let veths = seen
        .into_iter()
        .filter_map(|o| o.host_veth.map(|v| (o.user_id, v)))
        .collect();
    Ok(KernelState {
        gens,
        veths,
        observe,
    })
}

/// Starts an agent on `dir`'s store (log `dir/<log>`) and times it to ready.
async fn timed_start(
    dir: &Path,
    host: &str,
    prefix: &str,
    log: &str,
) -> Result<(AgentProc, Start), Error> {
    let client = Client::new(dir.join("vmnet.sock"));
    let log_path = dir.join(log);
    let since_unix_ms = vmnet_agent::agent::now_ms();
    let host_cpu0 = cpu_busy_ms();
    let t0 = Instant::now();
    // The reconcile module at info: its adoptions of an earlier agent's objects are logged;
    // and the records of the tables it took from the agent before it.
    let agent = AgentProc::start_logged(
        dir,
        host,
        prefix,
        log,
        "warn,vmnet_agent::reconcile=info,vmnet::cli::serve::handover=info",
    )?;
    let mut api = None;
    let ready = loop {
        if let Ok((status, _)) = client.send_raw(Method::GET, "/readyz", None).await {
            api.get_or_insert(t0.elapsed());
            if status.is_success() {
                break t0.elapsed();
            }
        }
        if t0.elapsed() > READY_WAIT {
            return Err(Error::internal(format!(
                "agent not ready after {} s; its log ends:\n{}",
                READY_WAIT.as_secs(),
                log_tail(&log_path, 40)
            )));
        }
        tokio::time::sleep(POLL).await;
    };
    let cpu = proc_cpu_ms(agent.pid()).map(Duration::from_millis);
    let host_cpu = host_cpu0
        .zip(cpu_busy_ms())
        .map(|(a, b)| Duration::from_millis(b.saturating_sub(a)));
    let status: AgentStatus = client.get("/v1/status").await?;
    let r = &status.reconcile;
    let first_pass_end = r
        .last_finished_at_unix_ms
        .filter(|_| r.passes == 1)
        .and_then(|end| u64::try_from(end - since_unix_ms).ok())
        .map(Duration::from_millis);
    let text = std::fs::read_to_string(&log_path).unwrap_or_default();
    let adoptions = text
        .lines()
        .filter(|l| l.contains("replaced an earlier agent's objects"))
        .map(str::to_owned)
        .collect();
    let tables_taken = text
        .lines()
        .filter(|l| l.contains("table records of the previous agent taken"))
        .find_map(|l| {
            let n = l.split("tables=").nth(1)?;
            n.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
        })
        .unwrap_or(0);
    let start = Start {
        api: api.unwrap_or(ready),
        ready,
        cpu,
        host_cpu,
        first_pass_end,
        status,
        adoptions,
        tables_taken,
    };
    Ok((agent, start))
}

/// Runs the command.
///
/// # Errors
/// `INVALID_INPUT` when not root or for a bad `--vms`; `INTERNAL` when the sandbox or an agent
/// fails, a PUT fails, or a start leaves the kernel not as it should.
pub async fn run(args: BootBenchArgs) -> Result<(), Error> {
    if !nix::unistd::geteuid().is_root() {
        return Err(Error::invalid(
            "vmnet-lab bench boot must run as root (it creates network namespaces)",
        ));
    }
    let n = args.vms;
    if n == 0 || n > vmnet_model::vm::MAX_USER_ID {
        return Err(Error::invalid(format!(
            "--vms {n}: must be 1..={}",
            vmnet_model::vm::MAX_USER_ID
        )));
    }
    let sb = vmnet_sandbox::Sandbox::new("bb")
        .map_err(|e| Error::internal(format!("bench sandbox: {e}")))?;
    let (prefix, host) = (sb.prefix().to_owned(), sb.host());
    let dir = StateDir::new()?;
    let client = Client::new(dir.0.join("vmnet.sock"));

    // The store: N VMs put through a first agent.
    let (first, _) = timed_start(&dir.0, &host, &prefix, "agent-put.log").await?;
    eprintln!(
        "bench sandbox {prefix} (host netns {host}), agent pid {}: putting {n} VMs",
        first.pid()
    );
    for uid in 1..=n {
        let _: VmView = client
            .put(&format!("/v1/vms/bench-{uid}"), &vm_body(uid))
            .await
            .map_err(|e| {
                Error::internal(format!(
                    "PUT vm {uid}: {}; the agent log ends:\n{}",
                    e.message,
                    log_tail(&dir.0.join("agent-put.log"), 40)
                ))
            })?;
    }
    // As on a host in service, a full pass ran over every VM before the agent stops.
    let put_log = dir.0.join("agent-put.log");
    crate::agent::settle(&client, vmnet_agent::agent::now_ms(), &put_log).await?;
    drop(first);

    // Restart: the kernel state is there.
    let before = kernel_state(&host, &prefix).await?;
    eprintln!("restart: {} VM namespaces in place", before.vm_netns());
    let (second, restart) = timed_start(&dir.0, &host, &prefix, "agent-restart.log").await?;
    eprintln!("restart: agent pid {} ready", second.pid());
    let after = kernel_state(&host, &prefix).await?;
    drop(second);
    let changed = rewritten(&before, &after);

    // Reboot: every namespace and the bpffs gone, the store as it was.
    drop(sb);
    vmnet_kernel::activity::remove_root(&dir.0.join(ACTIVITY_DIR))
        .map_err(|e| Error::internal(format!("remove the agent's bpffs: {e}")))?;
    let sb = vmnet_sandbox::Sandbox::with_prefix(&prefix)
        .map_err(|e| Error::internal(format!("bench sandbox again: {e}")))?;
    eprintln!("reboot: namespaces deleted, sandbox {prefix} made again");
    let (third, reboot) = timed_start(&dir.0, &host, &prefix, "agent-reboot.log").await?;
    eprintln!("reboot: agent pid {} ready", third.pid());
    let booted = kernel_state(&host, &prefix).await?;
    drop(third);

    print!(
        "{}",
        render(&BootRow {
            n,
            reboot,
            booted_netns: booted.vm_netns(),
            restart,
            changed,
            observe: before.observe,
        })
    );
    drop(sb);
    drop(dir);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(ino: u64) -> NsId {
        NsId { dev: 4, ino }
    }

    fn state(gens: &[(&str, u64, u32)], veths: &[(u32, &str, u32)]) -> KernelState {
        KernelState {
            gens: gens
                .iter()
                .map(|(n, ino, g)| ((*n).to_owned(), (id(*ino), *g)))
                .collect(),
            veths: veths
                .iter()
                .map(|(u, n, ix)| (*u, ((*n).to_owned(), *ix)))
                .collect(),
            observe: Duration::ZERO,
        }
    }

    #[test]
    fn an_untouched_kernel_shows_nothing_rewritten() {
        let s = state(
            &[("pfhost", 1, 9), ("pfn0001", 2, 3)],
            &[(1, "pfh0001", 12)],
        );
        assert_eq!(rewritten(&s, &s.clone()), (vec![], vec![]));
        assert_eq!(s.vm_netns(), 1);
    }

    #[test]
    fn commits_remade_namespaces_and_veths_are_each_named() {
        let before = state(
            &[
                ("pfhost", 1, 9),
                ("pfn0001", 2, 3),
                ("pfn0002", 3, 3),
                ("pfn0003", 4, 3),
            ],
            &[(1, "pfh0001", 12), (2, "pfh0002", 13), (3, "pfh0003", 14)],
        );
        let after = state(
            &[
                ("pfhost", 1, 11),
                ("pfn0001", 2, 3),
                ("pfn0002", 7, 3),
                ("pfn0004", 8, 1),
            ],
            &[(1, "pfh0001", 12), (2, "pfh0002", 21)],
        );
        let (ns, veths) = rewritten(&before, &after);
        assert_eq!(
            ns,
            [
                "pfhost: 2 nft commits",
                "pfn0002: made again",
                "pfn0003: gone",
                "pfn0004: new"
            ]
        );
        assert_eq!(veths, ["pfh0002 (13) now pfh0002 (21)", "pfh0003: gone"]);
    }
}
