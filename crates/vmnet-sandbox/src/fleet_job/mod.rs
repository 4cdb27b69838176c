//! `vmnet-lab up --sandbox examples/fleet.json`: several sandbox hosts, each running its own agent,
//! sharing a fake internet, a private network and one PostgreSQL cluster.
//!
//! `up` builds, as root and without touching the machine's own network:
//!
//! 1. the topology of [`crate::fleet`]: per host a namespace `<name><i>host` with an uplink to
//!    the shared fake internet `<name>inet` (which routes the host's public block to it, or
//!    treats the block as on-link, per the spec's `public_neighbors`) and a leg on the private
//!    network `<name>x-priv` (a bridge; 10.10.0.<i>/24 and fd00:10::<i>/64, MTU 1500); the fake
//!    internet routes each VM's mesh address to its host and runs the echo service;
//! 2. a PostgreSQL cluster on a unix socket only, in `<temp dir>/vmnet-sandbox-<name>-pg`: the
//!    fleet's shared store. Each host's agent gets its own database in it (named after its
//!    prefix): namespace mode keeps VM configs in a table without a host column, and every
//!    agent reconciles every row of it, so two agents on one database would each build the
//!    other's VMs (and user ids are unique per database);
//! 3. per host, the agent (`vmnet serve --netns <name><i>host --name-prefix <name><i>
//!    --database-url …`, socket and state under `<state dir>/<host name>/`), its VMs applied
//!    through its API, a simulated guest per VM (as the single-host job does) and the single-host
//!    guest checks ([`crate::ns_job::checks`]) with the host's uplink address as the NAT source;
//! 4. the mesh ([`mesh`]): each agent runs its WireGuard interface (`wireguard-go`) and the
//!    mesh's data plane (BPF maps pinned on a bpffs in its state directory, VM registrations in
//!    the cluster's shared database `mesh`); once every host is up, each is synced with the
//!    others over the private network;
//! 5. the checks across hosts ([`checks`], every host's mesh address answering across the
//!    interface, and TCP from every VM's guest to every VM's mesh address on the other hosts:
//!    answered within a tenant, dropped between tenants) and the impersonation check
//!    ([`hostile`]: a guest sending as another VM's mesh address to a VM on another host, with
//!    and without the guest guard); then a table per host (VMs, guest checks) and the fleet's
//!    checks.
//!
//! The exit status is non-zero when any check saw something other than expected; the sandbox
//! stays up either way, its pids (agents, echo service, relays, PostgreSQL) in `sandbox.json`.
//! `vmnet-lab down --sandbox --name <name>` stops the processes by pid, the PostgreSQL server by its
//! pid (fast shutdown), deletes the namespaces of the fleet prefix and of each host prefix
//! ([`crate::fleet::owned`]) and removes the state and cluster directories. A failed or
//! interrupted `up` does the same before it returns.

pub mod checks;
pub mod hostile;
pub mod mesh;
pub mod public;
pub mod spec;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;
use vmnet_model::Error;
use vmnet_model::error::chain;

use self::checks::FleetCheck;
pub use self::spec::{FleetHostSpec, FleetSpec, is_fleet_spec};
use crate::agent::AgentOptions;
use crate::args::{DEFAULT_NAME, UpArgs};
use crate::fleet::{self, Fleet, HostNet};
use crate::ns_job::checks::{CheckResult, render_checks};
use crate::ns_job::client_hint;
use crate::ns_job::steps::{self, VM_HEADER, VmRow};
use crate::postgres::DetachedPg;
use crate::state::{self, FleetState, Paths, SandboxState};
use crate::teardown::{pg_dir, teardown};
use vmnet_agent::table::render as render_table;

/// One host of the fleet report.
#[derive(Debug, Clone, Serialize)]
pub struct HostReport {
    /// The host's name from the spec.
    pub name: String,
    /// Its namespace.
    pub netns: String,
    /// Its agent's name prefix.
    pub agent_prefix: String,
    /// Its agent's API socket.
    pub socket: PathBuf,
    /// `VMNET_SOCKET=<socket> vmnet status`.
    pub client_hint: String,
    /// Its agent's pid (recorded in `sandbox.json`, stopped by `down`).
    pub agent_pid: u32,
    /// Its agent's log file.
    pub agent_log: PathBuf,
    /// Its agent's whole command line, the `vmnet` binary first.
    pub agent_command: Vec<String>,
    /// Its agent's database in the shared cluster.
    pub database: String,
    /// Its mesh address (on its WireGuard interface).
    pub mesh_address: String,
    /// Its WireGuard public key.
    pub wg_public_key: String,
    /// Its network: uplink, public block and private addresses.
    pub net: HostNet,
    /// Its VMs.
    pub vms: Vec<VmRow>,
    /// The guest checks of its VMs.
    pub checks: Vec<CheckResult>,
    /// Its VMs with public addresses, for the checks across hosts.
    #[serde(skip)]
    pub public_guests: Vec<public::PublicGuest>,
    /// Its VMs with a veth pair and their guests, for the VM-to-VM checks across hosts.
    #[serde(skip)]
    pub mesh_guests: Vec<mesh::MeshGuest>,
}

/// What `up` prints with `--output json` for a fleet spec.
#[derive(Debug, Clone, Serialize)]
pub struct FleetReport {
    /// The sandbox name (the fleet prefix).
    pub sandbox: String,
    /// The shared PostgreSQL cluster's directory (its unix socket lives there).
    pub postgres: PathBuf,
    /// The hosts.
    pub hosts: Vec<HostReport>,
    /// The checks across hosts.
    pub checks: Vec<FleetCheck>,
}

impl FleetReport {
    /// How many checks ran in all, and how many of them failed.
    #[must_use]
    pub fn counts(&self) -> (usize, usize) {
        let host = self
            .hosts
            .iter()
            .flat_map(|h| h.checks.iter().map(|c| c.ok));
        let all: Vec<bool> = host.chain(self.checks.iter().map(|c| c.ok)).collect();
        (all.len(), all.iter().filter(|ok| !**ok).count())
    }
}

/// Runs `vmnet-lab up --sandbox` for a fleet spec (see the module docs).
///
/// # Errors
/// `INVALID_INPUT` for a bad spec or name, `CONFLICT` when the sandbox (or its cluster
/// directory) exists, `INTERNAL` when building fails (after removing what was built) or a check
/// fails (the sandbox then stays up), `UNAVAILABLE` when interrupted.
pub async fn up(
    json: bool,
    args: &UpArgs,
    text: &str,
    mut interrupts: state::Interrupts,
) -> Result<(), Error> {
    fleet::check_prefix(&args.name).map_err(|m| Error::invalid(format!("sandbox --name: {m}")))?;
    let spec = FleetSpec::parse(&args.host_spec.display().to_string(), text)?;
    let pg = pg_dir(&args.name);
    if pg.exists() {
        return Err(Error::conflict(format!(
            "sandbox {}: its PostgreSQL directory {} exists already: run `vmnet-lab down --sandbox --name {}` first",
            args.name,
            pg.display(),
            args.name
        )));
    }
    let paths = state::claim(&args.root, &args.name)?;
    let built = tokio::select! {
        biased;
        why = interrupts.wait() => Err(state::interrupted_error(why, &args.name)),
        r = bring_up(args, &paths, &spec) => r,
    };
    let report = match built {
        Ok(r) => r,
        Err(e) => {
            let _ = teardown(&paths, &args.name);
            return Err(state::Interrupts::reason()
                .map_or(e, |why| state::interrupted_error(why, &args.name)));
        }
    };
    state::done_building(&paths);
    match json {
        true => println!(
            "{}",
            serde_json::to_string_pretty(&report).map_err(|e| Error::internal(e.to_string()))?
        ),
        false => print!("{}", render(&report, &paths.dir)),
    }
    let (all, failed) = report.counts();
    if failed > 0 {
        return Err(Error::internal(format!(
            "{failed} of {all} fleet sandbox checks failed; the sandbox stays up for inspection (`vmnet-lab down --sandbox --name {}` removes it)",
            args.name
        )));
    }
    Ok(())
}

async fn bring_up(args: &UpArgs, paths: &Paths, spec: &FleetSpec) -> Result<FleetReport, Error> {
    let timeout = Duration::from_secs(args.timeout_secs);
    let name = args.name.as_str();
    let sb_err = |e: crate::SandboxError| Error::internal(format!("sandbox {name}: {}", chain(&e)));
    let modes: Vec<fleet::PublicNeighbors> =
        spec.hosts.iter().map(|h| h.public_neighbors).collect();
    let fl = Fleet::with_prefix(name, &modes).map_err(sb_err)?;
    let inet = fl.inet();
    let nets: Vec<HostNet> = fl.hosts().to_vec();
    let pg_dir = pg_dir(name);
    let mut st = SandboxState {
        name: name.to_owned(),
        inet_ns: inet.clone(),
        fleet: Some(FleetState {
            hosts: nets.iter().map(|h| h.prefix.clone()).collect(),
            postgres_dir: Some(pg_dir.clone()),
            postgres_pid: None,
        }),
        ..SandboxState::default()
    };
    // From here on `teardown` (via the state file and the prefixes) removes everything.
    let _ = fl.keep();
    paths.save(&st)?;
    for (h, net) in spec.hosts.iter().zip(&nets) {
        for mesh in h.vms.iter().filter_map(|v| v.mesh_ipv6) {
            fleet::route_mesh(&inet, net, mesh).map_err(sb_err)?;
        }
    }
    steps::start_echo(paths, &mut st, &inet, timeout)?;
    // The sandbox's own routes on both ends of every uplink, put back after a flap.
    let inet_ifs: Vec<&str> = nets.iter().map(|n| n.inet_if.as_str()).collect();
    steps::keep_uplinks(paths, &mut st, &inet, &inet_ifs, timeout)?;
    for n in &nets {
        let up = [crate::sandbox::HOST_UPLINK_IF];
        steps::keep_uplinks(paths, &mut st, &n.ns, &up, timeout)?;
    }

    // The shared store. Started on this thread: an interrupt is seen once it is up, and the
    // teardown then stops it (no start left running behind the teardown's back).
    std::fs::create_dir(&pg_dir)
        .map_err(|e| Error::internal(format!("{}: {e}", pg_dir.display())))?;
    let pg = tokio::task::block_in_place(|| DetachedPg::start(&pg_dir))
        .map_err(|e| Error::internal(format!("PostgreSQL: {e:#}")))?;
    if let Some(f) = st.fleet.as_mut() {
        f.postgres_pid = Some(pg.pid);
    }
    paths.save(&st)?;

    // The fleet's VM registrations: one database every agent's data plane shares.
    pg.create_database(mesh::REGISTRY_DB)
        .map_err(|e| Error::internal(format!("PostgreSQL: {e:#}")))?;
    let registry = pg.url(mesh::REGISTRY_DB);
    let mut hosts = Vec::new();
    for (h, net) in spec.hosts.iter().zip(nets.iter().cloned()) {
        let agent = (registry.as_str(), args.agent_args.as_slice(), timeout);
        hosts.push(bring_up_host(paths, &mut st, &pg, agent, h, net).await?);
    }
    let clients: Vec<(String, HostNet, vmnet_agent::client::Client)> = hosts
        .iter()
        .map(|h| {
            let c = vmnet_agent::client::Client::new(&h.socket);
            (h.name.clone(), h.net.clone(), c)
        })
        .collect();
    let keys = mesh::sync_all(&clients).await?;
    for (h, k) in hosts.iter_mut().zip(keys) {
        h.wg_public_key = k;
    }
    let pairs: Vec<(String, HostNet)> = hosts
        .iter()
        .map(|h| (h.name.clone(), h.net.clone()))
        .collect();
    let public_guests: Vec<public::PublicGuest> = hosts
        .iter()
        .flat_map(|h| h.public_guests.iter().cloned())
        .collect();
    let mesh_guests: Vec<mesh::MeshGuest> = hosts
        .iter()
        .flat_map(|h| h.mesh_guests.iter().cloned())
        .collect();
    let checks = tokio::task::spawn_blocking(move || {
        let mut c = checks::run(&inet, &pairs)?;
        c.extend(public::run(&public_guests)?);
        c.extend(mesh::checks(&pairs));
        c.extend(mesh::vm_checks(&mesh_guests)?);
        Ok::<_, crate::SandboxError>(c)
    })
    .await
    .map_err(|e| Error::internal(format!("checks: {e}")))?
    .map_err(|e| Error::internal(format!("checks: {}", chain(&e))))?;
    let mut checks = checks;
    checks.extend(hostile::run(&hosts).await);
    Ok(FleetReport {
        sandbox: name.to_owned(),
        postgres: pg_dir,
        hosts,
        checks,
    })
}

/// One host: its database, its agent, its VMs with their guests, and its guest checks.
async fn bring_up_host(
    paths: &Paths,
    st: &mut SandboxState,
    pg: &DetachedPg,
    (registry, extra, timeout): (&str, &[String], Duration),
    h: &FleetHostSpec,
    net: HostNet,
) -> Result<HostReport, Error> {
    let database = net.prefix.clone();
    pg.create_database(&database)
        .map_err(|e| Error::internal(format!("host {}: PostgreSQL: {e:#}", h.name)))?;
    let url = pg.url(&database);
    let dir = paths.dir.join(&h.name);
    let role = format!("agent-{}", h.name);
    let bpf = dir.join(mesh::MESH_BPF_DIR);
    mesh::mount_bpf(&bpf)
        .map_err(|e| Error::internal(format!("host {}: {}", h.name, chain(&e))))?;
    let agent = AgentOptions::new(&net.ns, &net.prefix, &dir)
        .args(mesh::agent_args(&net, &bpf, registry))
        .database_url(url)
        .log(paths.log(&role))
        // Public addresses come from the host's block, reached as the fake internet treats it.
        .args([
            "--uplink",
            crate::sandbox::HOST_UPLINK_IF,
            "--public-neighbors",
            net.public_neighbors.as_str(),
        ]);
    let (client, started) = steps::start_agent(paths, st, &role, agent, (extra, timeout))
        .await
        .map_err(|e| Error::new(e.code, format!("host {}: {}", h.name, e.message)))?;
    let applied = vmnet_agent::apply::apply_host_spec(&client, &h.host_spec(), false).await?;
    for item in &applied.items {
        eprintln!(
            "host {}: applied {} {}: {}",
            h.name, item.kind, item.id, item.result
        );
    }
    let mut guests = Vec::new();
    let mut vms = Vec::new();
    let mut public_guests = Vec::new();
    let mut mesh_guests = Vec::new();
    for vm in &h.vms {
        let v = steps::wait_applied(&client, &vm.id, timeout).await?;
        let host = (net.prefix.as_str(), net.ns.as_str(), net.uplink_v4);
        let (mut guest, row) = steps::attach_guest(paths, st, host, &v, timeout)?;
        guest.public =
            crate::ns_job::public::public_check(&v.config, &st.inet_ns, net.inet_v4, net.inet_v6);
        if let (Some(p), Some(mesh)) = (&guest.public, v.config.mesh_ipv6) {
            public_guests.push(public::PublicGuest {
                host: h.name.clone(),
                vm: v.config.id.clone(),
                guest_ns: guest.guest_ns.clone(),
                mesh,
                ipv4: p.ipv4,
                ipv6: p.ipv6,
            });
        }
        if let (Some(mesh), true) = (v.config.mesh_ipv6, v.status.veth_host.is_some()) {
            mesh_guests.push(mesh::MeshGuest {
                host: h.name.clone(),
                vm: v.config.id.clone(),
                guest_ns: guest.guest_ns.clone(),
                mesh,
                tenant: v.config.tenant,
            });
        }
        guests.push(guest);
        vms.push(row);
    }
    let checks = tokio::task::spawn_blocking(move || crate::ns_job::checks::run_checks(&guests))
        .await
        .map_err(|e| Error::internal(format!("checks: {e}")))?
        .map_err(|e| Error::internal(format!("host {}: checks: {}", h.name, chain(&e))))?;
    let socket =
        std::path::absolute(client.socket()).unwrap_or_else(|_| client.socket().to_owned());
    Ok(HostReport {
        name: h.name.clone(),
        netns: net.ns.clone(),
        agent_prefix: net.prefix.clone(),
        client_hint: client_hint(&socket),
        socket,
        agent_pid: started.pid,
        agent_log: started.log,
        agent_command: started.command,
        database,
        mesh_address: mesh::host_mesh(&net).to_string(),
        wg_public_key: String::new(),
        net,
        vms,
        checks,
        public_guests,
        mesh_guests,
    })
}

/// The report as text: a section per host (its addresses, agent, VM table and guest checks),
/// the checks across hosts, and the summary line.
#[must_use]
pub fn render(r: &FleetReport, state_dir: &Path) -> String {
    let mut out = format!(
        "fleet sandbox {} (state {}, PostgreSQL {})\n",
        r.sandbox,
        state_dir.display(),
        r.postgres.display()
    );
    for h in &r.hosts {
        let n = &h.net;
        let _ = writeln!(
            out,
            "\nhost {}: netns {}, agent prefix {}, database {}",
            h.name, h.netns, h.agent_prefix, h.database
        );
        let _ = writeln!(
            out,
            "  uplink {} {}; public {} {} ({}); private {} {}",
            n.uplink_v4,
            n.uplink_v6,
            n.public_v4,
            n.public_v6,
            n.public_neighbors.as_str(),
            n.private_v4,
            n.private_v6
        );
        let _ = writeln!(
            out,
            "  mesh {} on {}, key {}",
            h.mesh_address,
            mesh::ifname(&h.agent_prefix),
            h.wg_public_key
        );
        let _ = writeln!(out, "  agent: {}", h.client_hint);
        let started = steps::StartedAgent {
            pid: h.agent_pid,
            log: h.agent_log.clone(),
            command: h.agent_command.clone(),
        };
        let _ = writeln!(out, "{}", started.lines("  "));
        if h.vms.is_empty() {
            out.push_str("no VMs\n");
        } else {
            let rows: Vec<Vec<String>> = h.vms.iter().map(VmRow::cells).collect();
            out.push_str(&render_table(&VM_HEADER, &rows));
            out.push('\n');
            out.push_str(&render_checks(&h.checks));
        }
    }
    out.push_str("\nchecks across hosts\n");
    let rows: Vec<Vec<String>> = r
        .checks
        .iter()
        .map(|c| {
            vec![
                c.host.clone(),
                c.check.clone(),
                c.expected.clone(),
                c.seen.clone(),
                if c.ok { "ok" } else { "FAIL" }.into(),
            ]
        })
        .collect();
    out.push_str(&render_table(
        &["HOST", "CHECK", "EXPECTED", "SEEN", "RESULT"],
        &rows,
    ));
    let (all, failed) = r.counts();
    let name_flag = if r.sandbox == DEFAULT_NAME {
        String::new()
    } else {
        format!(" --name {}", r.sandbox)
    };
    let _ = writeln!(
        out,
        "\n{}/{all} checks ok; the sandbox stays up (`vmnet-lab down --sandbox{name_flag}` removes it)",
        all - failed
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::{PublicNeighbors, host_net};

    fn check(host: &str, name: &str, ok: bool) -> FleetCheck {
        FleetCheck {
            host: host.into(),
            check: name.into(),
            expected: "from 10.10.0.1".into(),
            seen: if ok { "from 10.10.0.1" } else { "no reach" }.into(),
            ok,
        }
    }

    #[test]
    fn the_report_has_a_section_per_host_and_counts_every_check() {
        let host = |name: &str, i: u8, pn| HostReport {
            name: name.into(),
            netns: format!("fq{i}host"),
            agent_prefix: format!("fq{i}"),
            socket: format!("/s/{name}/vmnet.sock").into(),
            client_hint: format!("VMNET_SOCKET=/s/{name}/vmnet.sock vmnet status"),
            agent_pid: 4000 + u32::from(i),
            agent_log: format!("/s/agent-{name}.log").into(),
            agent_command: vec!["/bin/vmnet".into(), "serve".into(), "--x=a b".into()],
            database: format!("fq{i}"),
            mesh_address: format!("fdaa::{i}"),
            wg_public_key: "K".into(),
            net: host_net("fq", i, pn),
            vms: Vec::new(),
            checks: vec![CheckResult {
                vm: "vm-a".into(),
                check: "nat rule".into(),
                expected: "snat".into(),
                seen: "snat".into(),
                ok: true,
            }],
            public_guests: Vec::new(),
            mesh_guests: Vec::new(),
        };
        let r = FleetReport {
            sandbox: "fq".into(),
            postgres: "/tmp/pg".into(),
            hosts: vec![
                host("host-1", 1, PublicNeighbors::Routed),
                host("host-2", 2, PublicNeighbors::Proxy),
            ],
            checks: vec![
                check("host-1", "private ipv4 -> host-2", true),
                check("host-2", "private ipv4 -> host-1", false),
            ],
        };
        assert_eq!(r.counts(), (4, 1));
        let text = render(&r, Path::new("/s"));
        assert!(
            text.starts_with("fleet sandbox fq (state /s, PostgreSQL /tmp/pg)\n"),
            "{text}"
        );
        assert!(
            text.contains("\nhost host-2: netns fq2host, agent prefix fq2, database fq2\n"),
            "{text}"
        );
        assert!(
            text.contains("  uplink 192.0.2.18 2001:db8:0:2::2; public 203.0.113.80/28 2001:db8:2::/48 (proxy); private 10.10.0.2 fd00:10::2\n"),
            "{text}"
        );
        assert!(
            text.contains("  agent pid 4002, log /s/agent-host-2.log\n  agent command: /bin/vmnet serve '--x=a b'\n"),
            "{text}"
        );
        assert!(text.contains("HOST    CHECK"), "{text}");
        assert!(
            text.lines()
                .any(|l| l.starts_with("host-2  private ipv4 -> host-1") && l.ends_with("FAIL")),
            "{text}"
        );
        assert!(
            text.ends_with("\n3/4 checks ok; the sandbox stays up (`vmnet-lab down --sandbox --name fq` removes it)\n"),
            "{text}"
        );
    }
}
