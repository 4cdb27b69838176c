//! The steps of bringing a namespace-mode sandbox host up, shared by the single-host job
//! ([`super`]) and the fleet ([`crate::fleet_job`]): the fake internet's echo service, an agent
//! inside a host namespace, waiting for the VMs to be applied, and a simulated guest per VM.
//! Every background process is recorded in the sandbox state as soon as it runs, so `down`
//! (or a failed `up`) stops it by pid.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::time::{Duration, Instant};

use serde::Serialize;
use vmnet_agent::api::types::{VmState, VmView};
use vmnet_agent::client::{Client, segment};
use vmnet_model::error::chain;
use vmnet_model::vm::Via;
use vmnet_model::{Error, ErrorCode};

use super::checks::{self, GUEST_GW_V6, GuestInfo};
use crate::agent::AgentOptions;
use crate::guest::{GuestConfig, GuestRoute6};
use crate::state::{self, Paths, Proc, SandboxState};
use crate::{netns, sandbox};

/// One VM row of the `up` table.
#[derive(Debug, Clone, Serialize)]
pub struct VmRow {
    /// VM id.
    pub vm: String,
    /// User id.
    pub user_id: u32,
    /// The agent's state for it.
    pub state: String,
    /// Its namespace.
    pub netns: String,
    /// `host/ns` veth names, or `-`.
    pub veth: String,
    /// The transit /30, or `-`.
    pub transit: String,
    /// The tap.
    pub tap: String,
    /// Guest address and MAC.
    pub guest: String,
    /// Mesh address, or `-`.
    pub mesh: String,
    /// Routes, `dst via x` joined by `, `.
    pub routes: String,
    /// The simulated guest's namespace, or `qemu <pid>` for a real guest.
    pub guest_ns: String,
}

/// The header of the VM table, matching [`VmRow::cells`].
pub const VM_HEADER: [&str; 8] = [
    "VM",
    "STATE",
    "NETNS",
    "VETH (HOST/NS)",
    "TRANSIT",
    "GUEST",
    "MESH",
    "ROUTES",
];

impl VmRow {
    /// The cells of the VM table ([`VM_HEADER`]).
    #[must_use]
    pub fn cells(&self) -> Vec<String> {
        vec![
            self.vm.clone(),
            self.state.clone(),
            self.netns.clone(),
            self.veth.clone(),
            self.transit.clone(),
            self.guest.clone(),
            self.mesh.clone(),
            self.routes.clone(),
        ]
    }
}

/// Records a background process in the state file.
pub(crate) fn record(
    paths: &Paths,
    st: &mut SandboxState,
    role: &str,
    pid: u32,
) -> Result<(), Error> {
    record_proc(
        paths,
        st,
        Proc {
            role: role.to_owned(),
            pid,
            ..Proc::default()
        },
    )
}

/// Records a background process, with whatever else is known of it, in the state file.
pub(crate) fn record_proc(paths: &Paths, st: &mut SandboxState, p: Proc) -> Result<(), Error> {
    st.procs.push(p);
    paths.save(st)
}

/// An agent `up` started and left running: what it prints of it and records in `sandbox.json`.
#[derive(Debug, Clone, Serialize)]
pub struct StartedAgent {
    /// Its pid (`down` stops it by this pid).
    pub pid: u32,
    /// Its log file.
    pub log: std::path::PathBuf,
    /// Its whole command line, the binary first.
    pub command: Vec<String>,
}

impl StartedAgent {
    /// The text lines `up` prints of it: pid and log, then the command line to copy.
    #[must_use]
    pub fn lines(&self, indent: &str) -> String {
        format!(
            "{indent}agent pid {}, log {}\n{indent}agent command: {}\n",
            self.pid,
            self.log.display(),
            crate::agent_args::shell_line(&self.command)
        )
    }
}

/// Starts the echo service in the fake internet `inet_ns` as a background helper and waits
/// until it listens.
pub(crate) fn start_echo(
    paths: &Paths,
    st: &mut SandboxState,
    inet_ns: &str,
    timeout: Duration,
) -> Result<(), Error> {
    let ready = paths.ready("echo");
    let echo_args: Vec<String> = [
        "sandbox-helper",
        "echo",
        "--netns",
        inet_ns,
        "--listen",
        &format!("{}:7", sandbox::ECHO_V4),
        "--listen",
        &format!("[{}]:7", sandbox::ECHO_V6),
        "--ready-file",
        &ready.display().to_string(),
    ]
    .map(str::to_owned)
    .to_vec();
    let mut child = state::spawn_background(&echo_args, &paths.log("echo"))?;
    record(paths, st, "echo", child.id())?;
    state::wait_ready(
        &mut child,
        &ready,
        &paths.log("echo"),
        "echo service",
        timeout,
    )
}

/// Starts the uplink keeper of `links` in namespace `ns` ([`crate::uplink`]) as a background
/// helper, records it as `uplink-<ns>` and waits until it listens.
pub(crate) fn keep_uplinks(
    paths: &Paths,
    st: &mut SandboxState,
    ns: &str,
    links: &[&str],
    timeout: Duration,
) -> Result<(), Error> {
    let role = format!("uplink-{ns}");
    let ready = paths.ready(&role);
    let mut args: Vec<String> = ["sandbox-helper", "uplink", "--netns", ns]
        .map(str::to_owned)
        .to_vec();
    for l in links {
        args.extend(["--link".to_owned(), (*l).to_owned()]);
    }
    args.extend(["--ready-file".to_owned(), ready.display().to_string()]);
    let log = paths.log(&role);
    let mut child = state::spawn_background(&args, &log)?;
    let keeper = Proc {
        role: role.clone(),
        pid: child.id(),
        log: Some(log.clone()),
        ..Proc::default()
    };
    record_proc(paths, st, keeper)?;
    state::wait_ready(&mut child, &ready, &log, &role, timeout)
}

/// Starts `agent` (this executable, `vmnet serve --netns …`) with `extra` (`up --agent-arg`)
/// appended, in a process group of its own, records it in the state file as `role` (pid, log,
/// command line), waits until its API answers and leaves it running (`down` stops it by pid);
/// returns a client for it and what was started.
pub(crate) async fn start_agent(
    paths: &Paths,
    st: &mut SandboxState,
    role: &str,
    agent: AgentOptions,
    (extra, timeout): (&[String], Duration),
) -> Result<(Client, StartedAgent), Error> {
    let mut agent = agent.args(extra).own_process_group().spawn()?;
    let log = std::path::absolute(agent.log_path()).unwrap_or_else(|_| agent.log_path().into());
    let started = StartedAgent {
        pid: agent.pid(),
        log: log.clone(),
        command: agent.command().to_vec(),
    };
    record_proc(
        paths,
        st,
        Proc {
            role: role.to_owned(),
            pid: started.pid,
            log: Some(log),
            command: started.command.clone(),
        },
    )?;
    agent.wait_ready(timeout).await?;
    let client = agent.client().clone();
    let _ = agent.detach();
    Ok((client, started))
}

/// Starts a simulated guest for the applied VM `v` of the agent with `prefix` in `host_ns`:
/// namespace `<prefix>g<uid>`, a relay helper joining its `eth0` to the VM's tap, the guest's
/// addresses and routes. `uplink_v4` is what the internet sees of the host's NAT.
pub(crate) fn attach_guest(
    paths: &Paths,
    st: &mut SandboxState,
    (prefix, host_ns, uplink_v4): (&str, &str, Ipv4Addr),
    v: &VmView,
    timeout: Duration,
) -> Result<(GuestInfo, VmRow), Error> {
    let guest_ns = format!("{prefix}g{:04x}", v.config.user_id);
    netns::create(&guest_ns)
        .map_err(|e| Error::internal(format!("sandbox {prefix}: {}", chain(&e))))?;
    st.guest_ns.push(guest_ns.clone());
    paths.save(st)?;
    let role = format!("relay-{}", v.config.id);
    let ready = paths.ready(&role);
    let relay_args: Vec<String> = vec![
        "sandbox-helper".into(),
        "relay".into(),
        "--vm-netns".into(),
        v.status.netns.clone(),
        "--tap".into(),
        v.status.tap.clone(),
        "--guest-netns".into(),
        guest_ns.clone(),
        "--ready-file".into(),
        ready.display().to_string(),
    ];
    let mut child = state::spawn_background(&relay_args, &paths.log(&role))?;
    let relay = Proc {
        role: role.clone(),
        pid: child.id(),
        log: Some(std::path::absolute(paths.log(&role)).unwrap_or_else(|_| paths.log(&role))),
        ..Proc::default()
    };
    record_proc(paths, st, relay)?;
    state::wait_ready(&mut child, &ready, &paths.log(&role), &role, timeout)?;
    let cfg = guest_config(v)?;
    crate::guest::configure(&guest_ns, crate::guest::GUEST_IF, &cfg)
        .map_err(|e| Error::internal(format!("guest of vm {}: {}", v.config.id, chain(&e))))?;
    let info = guest_info((prefix, host_ns, uplink_v4), v, &guest_ns);
    Ok((info, vm_row(v, &guest_ns)))
}

/// What the checks need of the applied VM `v` of the agent with `prefix` in `host_ns`, whose
/// guest runs in `guest_ns` (simulated guests; empty for real ones).
pub(crate) fn guest_info(
    (prefix, host_ns, uplink_v4): (&str, &str, Ipv4Addr),
    v: &VmView,
    guest_ns: &str,
) -> GuestInfo {
    GuestInfo {
        vm: v.config.id.clone(),
        guest_ns: guest_ns.to_owned(),
        mesh: v.config.mesh_ipv6,
        routes: v.config.network.routes.clone(),
        uplink_v4,
        kernel: Some(checks::KernelNames {
            host_ns: host_ns.to_owned(),
            vm_ns: v.status.netns.clone(),
            veth_host: v.status.veth_host.clone(),
            nft_table: prefix.to_owned(),
        }),
        public: None,
    }
}

/// How the simulated guest of `v` configures itself: the status's MAC, address, gateway and MTU;
/// its mesh /128; IPv6 routes via `fe80::1` for the mesh range and each IPv6 route destination.
pub(crate) fn guest_config(v: &VmView) -> Result<GuestConfig, Error> {
    let bad = |what: &str, val: &str| {
        Error::internal(format!(
            "vm {}: status {what} {val:?} is not an address",
            v.config.id
        ))
    };
    let ipv4 = v
        .status
        .guest_ipv4
        .parse()
        .map_err(|_| bad("guest_ipv4", &v.status.guest_ipv4))?;
    let gw = v
        .status
        .gateway_ipv4
        .parse()
        .map_err(|_| bad("gateway_ipv4", &v.status.gateway_ipv4))?;
    let mut routes_v6 = vec![GuestRoute6 {
        destination: "fdaa::/16".into(),
        via: Some(GUEST_GW_V6),
    }];
    for r in &v.config.network.routes {
        if let ipnet::IpNet::V6(d) = r.destination {
            routes_v6.push(GuestRoute6 {
                destination: d.to_string(),
                via: Some(GUEST_GW_V6),
            });
        }
    }
    Ok(GuestConfig {
        mac: v.status.guest_mac.clone(),
        ipv4,
        gateway_v4: Some(gw),
        mtu: v.status.mtu,
        mesh_ipv6: v.config.mesh_ipv6,
        routes_v6,
    })
}

/// The VM table row of `v`, whose guest is `guest_ns` (a namespace, or how a real guest runs).
pub(crate) fn vm_row(v: &VmView, guest_ns: &str) -> VmRow {
    let dash = |o: &Option<String>| o.clone().unwrap_or_else(|| "-".into());
    let veth = match (&v.status.veth_host, &v.status.veth_ns) {
        (Some(h), Some(n)) => format!("{h}/{n}"),
        _ => "-".into(),
    };
    let routes: Vec<String> = v
        .config
        .network
        .routes
        .iter()
        .map(|r| match r.via {
            Via::Host => format!("{} via host", r.destination),
            Via::Mesh(m) => format!("{} via {m}", r.destination),
        })
        .collect();
    VmRow {
        vm: v.config.id.clone(),
        user_id: v.config.user_id,
        state: v.status.state.as_str().into(),
        netns: v.status.netns.clone(),
        veth,
        transit: dash(&v.status.transit),
        tap: v.status.tap.clone(),
        guest: format!("{} {}", v.status.guest_ipv4, v.status.guest_mac),
        mesh: v
            .config
            .mesh_ipv6
            .map_or_else(|| "-".into(), |m: Ipv6Addr| m.to_string()),
        routes: if routes.is_empty() {
            "none".into()
        } else {
            routes.join(", ")
        },
        guest_ns: guest_ns.to_owned(),
    }
}

/// Waits until the agent reports VM `id` applied.
pub(crate) async fn wait_applied(
    client: &Client,
    id: &str,
    timeout: Duration,
) -> Result<VmView, Error> {
    let start = Instant::now();
    let path = format!("/v1/vms/{}", segment(id));
    loop {
        let v: VmView = client.get(&path).await?;
        match v.status.state {
            VmState::Applied => return Ok(v),
            VmState::Failed => {
                return Err(Error::internal(format!(
                    "vm {id}: apply failed: {}",
                    v.status
                        .last_error
                        .as_deref()
                        .unwrap_or("no error recorded")
                )));
            }
            VmState::Pending if start.elapsed() > timeout => {
                return Err(Error::new(
                    ErrorCode::Unavailable,
                    format!("vm {id}: not applied within {timeout:?}"),
                ));
            }
            VmState::Pending => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}
