//! `vmnet-lab guest attach --sandbox [--name NAME] [--host HOST] VM`: a simulated guest for a VM
//! put on a sandbox's agent after `up`, as `up` gives one to each VM of its spec.
//!
//! It waits until the agent reports the VM applied, then makes the guest namespace
//! `<agent prefix>g<user id, 4 hex digits>`, starts the frame relay that joins its `eth0` to the
//! VM's tap (`vmnet-lab sandbox-helper relay`, opening the tap as a VMM does) and configures the
//! guest as `up` does (the VM's guest MAC, address, gateway and MTU, its mesh address, its IPv6
//! routes via `fe80::1`). Namespace and relay are recorded in the sandbox's `sandbox.json`, so
//! `vmnet-lab down --sandbox` stops the relay by pid and deletes the namespace.
//!
//! The agent is found by its record in `sandbox.json` (`agent`, or `agent-<HOST>` in a fleet):
//! its socket, namespace and name prefix are read from its recorded command line.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;
use vmnet_agent::client::Client;
use vmnet_model::Error;

use crate::args::{DEFAULT_NAME, DEFAULT_ROOT};
use crate::ns_job::steps;
use crate::state::{self, Paths, Proc};

/// `vmnet-lab guest …`
#[derive(Debug, clap::Subcommand)]
pub enum GuestCmd {
    /// Give a VM put after `up` a simulated guest: a namespace whose eth0 a frame relay joins
    /// to the VM's tap; `down` removes both.
    Attach(AttachArgs),
}

/// Arguments of `vmnet-lab guest attach`.
#[derive(Debug, clap::Args)]
pub struct AttachArgs {
    /// Attach to a VM of a sandbox made by `vmnet-lab up --sandbox` (required).
    #[arg(long)]
    pub sandbox: bool,
    /// The sandbox name.
    #[arg(long, default_value = DEFAULT_NAME)]
    pub name: String,
    /// Where the sandbox's state directory is.
    #[arg(long, default_value = DEFAULT_ROOT)]
    pub root: PathBuf,
    /// In a fleet sandbox: the host (its name in the fleet spec) whose agent holds the VM.
    #[arg(long)]
    pub host: Option<String>,
    /// How long to wait for the VM to be applied and the relay to start, seconds.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub timeout_secs: u64,
    /// The VM id (as put to the sandbox's agent).
    pub vm: String,
}

/// What `guest attach` prints.
#[derive(Debug, Clone, Serialize)]
pub struct Attached {
    /// The sandbox name.
    pub sandbox: String,
    /// The VM id.
    pub vm: String,
    /// The guest's namespace.
    pub guest_netns: String,
    /// The guest's interface.
    pub guest_if: String,
    /// Its address and gateway.
    pub guest_ipv4: String,
    /// The gateway its default route goes to.
    pub gateway_ipv4: String,
    /// Its MAC.
    pub guest_mac: String,
    /// The relay's pid (stopped by `down`).
    pub relay_pid: u32,
    /// The relay's log file.
    pub relay_log: PathBuf,
    /// A command to try from inside the guest.
    pub hint: String,
}

/// The value after `flag` in a recorded command line.
fn flag_value<'a>(command: &'a [String], flag: &str) -> Option<&'a str> {
    let i = command.iter().position(|a| a == flag)?;
    command.get(i + 1).map(String::as_str)
}

/// The recorded agent `role` of the sandbox and its socket, namespace and name prefix.
fn agent_of(procs: &[Proc], role: &str, name: &str) -> Result<(PathBuf, String, String), Error> {
    let p = procs.iter().find(|p| p.role == role).ok_or_else(|| {
        Error::not_found(format!(
            "sandbox {name}: no {role} recorded in its sandbox.json (a fleet sandbox needs --host, a pool sandbox is removed when `up` ends)"
        ))
    })?;
    let get = |flag: &str| {
        flag_value(&p.command, flag).ok_or_else(|| {
            Error::internal(format!(
                "sandbox {name}: the recorded command line of {role} (pid {}) has no {flag}",
                p.pid
            ))
        })
    };
    Ok((
        get("--socket")?.into(),
        get("--netns")?.to_owned(),
        get("--name-prefix")?.to_owned(),
    ))
}

/// Runs `vmnet-lab guest attach` (see the module docs).
///
/// # Errors
/// `INVALID_INPUT` without `--sandbox` or as a normal user, `NOT_FOUND` when the sandbox, its
/// agent or the VM does not exist, `CONFLICT` while `up` still builds the sandbox or when the
/// VM has a guest already, `INTERNAL` when the guest cannot be set up.
pub async fn run(json: bool, args: AttachArgs) -> Result<(), Error> {
    if !args.sandbox {
        return Err(Error::invalid(
            "vmnet-lab guest attach: only the sandbox mode exists; pass --sandbox",
        ));
    }
    if !nix::unistd::geteuid().is_root() {
        return Err(Error::invalid(
            "vmnet-lab guest attach --sandbox must run as root (it creates a network namespace)",
        ));
    }
    let name = args.name.as_str();
    let paths = Paths::new(&args.root, name);
    if let Some(pid) = state::builder(&paths.dir) {
        return Err(Error::conflict(format!(
            "sandbox {name} is still being made by `vmnet-lab up` (pid {pid}): attach once it is done"
        )));
    }
    let mut st = paths.load()?.ok_or_else(|| {
        Error::not_found(format!(
            "no sandbox {name} is up (no {})",
            paths.state_file().display()
        ))
    })?;
    let role = args
        .host
        .as_ref()
        .map_or_else(|| "agent".to_owned(), |h| format!("agent-{h}"));
    let (socket, host_ns, prefix) = agent_of(&st.procs, &role, name)?;
    let timeout = Duration::from_secs(args.timeout_secs);
    let client = Client::new(&socket);
    let v = steps::wait_applied(&client, &args.vm, timeout).await?;
    let guest_ns = format!("{prefix}g{:04x}", v.config.user_id);
    if crate::netns::exists(&guest_ns) {
        return Err(Error::conflict(format!(
            "vm {}: its guest namespace {guest_ns} exists already (made by `up` or an earlier attach)",
            args.vm
        )));
    }
    // The NAT source is only for the checks of `up`, which do not run here.
    let host = (prefix.as_str(), host_ns.as_str(), Ipv4Addr::UNSPECIFIED);
    let (guest, _) =
        tokio::task::block_in_place(|| steps::attach_guest(&paths, &mut st, host, &v, timeout))?;
    let relay = st.procs.last().cloned().unwrap_or_default();
    let out = Attached {
        sandbox: name.to_owned(),
        vm: args.vm.clone(),
        guest_netns: guest.guest_ns.clone(),
        guest_if: crate::guest::GUEST_IF.to_owned(),
        guest_ipv4: v.status.guest_ipv4.clone(),
        gateway_ipv4: v.status.gateway_ipv4.clone(),
        guest_mac: v.status.guest_mac.clone(),
        relay_pid: relay.pid,
        relay_log: relay.log.unwrap_or_default(),
        hint: format!(
            "ip netns exec {} ping -c 1 {}",
            guest.guest_ns, v.status.gateway_ipv4
        ),
    };
    if json {
        let text =
            serde_json::to_string_pretty(&out).map_err(|e| Error::internal(e.to_string()))?;
        println!("{text}");
        return Ok(());
    }
    let name_flag = if name == DEFAULT_NAME {
        String::new()
    } else {
        format!(" --name {name}")
    };
    println!(
        "vm {}: guest netns {}, {} {} {} (gateway {}), relay pid {}, log {}",
        out.vm,
        out.guest_netns,
        out.guest_if,
        out.guest_ipv4,
        out.guest_mac,
        out.gateway_ipv4,
        out.relay_pid,
        out.relay_log.display()
    );
    println!("try: {}", out.hint);
    println!("`vmnet-lab down --sandbox{name_flag}` removes it with the sandbox");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agent_is_found_by_its_recorded_command_line() {
        let command: Vec<String> = [
            "/bin/vmnet",
            "--socket",
            "/run/s/box/vmnet.sock",
            "--state-dir",
            "/run/s/box/state",
            "serve",
            "--netns",
            "boxhost",
            "--name-prefix",
            "box",
        ]
        .map(str::to_owned)
        .to_vec();
        let procs = vec![
            Proc {
                role: "echo".into(),
                pid: 1,
                ..Proc::default()
            },
            Proc {
                role: "agent".into(),
                pid: 2,
                log: None,
                command,
            },
        ];
        let (socket, ns, prefix) = agent_of(&procs, "agent", "box").unwrap();
        assert_eq!(socket, PathBuf::from("/run/s/box/vmnet.sock"));
        assert_eq!((ns.as_str(), prefix.as_str()), ("boxhost", "box"));
        let e = agent_of(&procs, "agent-host-1", "box").unwrap_err();
        assert_eq!(e.code, vmnet_model::ErrorCode::NotFound);
        assert!(e.message.contains("no agent-host-1 recorded"), "{e}");
        let e = agent_of(&procs[..1], "agent", "box").unwrap_err();
        assert!(e.message.contains("no agent recorded"), "{e}");
    }
}
