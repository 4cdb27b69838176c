//! `vmnet-lab up --sandbox` and `vmnet-lab down --sandbox`: the flags checked, the spec read and handed
//! to its job — [`crate::pool_job`] for `"mode": "pool"`, [`crate::fleet_job`] for
//! `"mode": "fleet"`, [`crate::ns_job`] for a namespace-mode host spec — and `down`'s removal
//! ([`crate::teardown`]).

use std::path::Path;
use std::time::Duration;

use vmnet_model::Error;

use crate::args::{DEFAULT_HOST_SPEC, DownArgs, EMBEDDED_HOST_SPEC, UpArgs};
use crate::sandbox;
use crate::state::{self, Paths};
use crate::teardown::{pg_dir, teardown};

fn need_root_and_flag(sandbox: bool, cmd: &str) -> Result<(), Error> {
    if !sandbox {
        return Err(Error::invalid(format!(
            "vmnet-lab {cmd}: only the sandbox mode exists; pass --sandbox"
        )));
    }
    if !nix::unistd::geteuid().is_root() {
        return Err(Error::invalid(format!(
            "vmnet-lab {cmd} --sandbox must run as root (it creates network namespaces)"
        )));
    }
    Ok(())
}

fn check_name(name: &str) -> Result<(), Error> {
    vmnet_plan::ns::names::check_prefix(name)
        .map_err(|m| Error::invalid(format!("sandbox --name: {m}")))
}

/// The fleet that `name` is a host of: a fleet `f` names its hosts `f1` to `f4` (their
/// namespaces start with those), so `up` or `down` of such a name would take that host's
/// namespaces for its own. `None` when no such fleet is up.
fn fleet_of_host(name: &str) -> Option<&str> {
    let (fleet, last) = name.split_at(name.len().checked_sub(1)?);
    (matches!(last, "1" | "2" | "3" | "4") && !fleet.is_empty() && crate::fleet::exists(fleet))
        .then_some(fleet)
}

/// `CONFLICT` when `name` is a host of a running fleet (see [`fleet_of_host`]).
fn refuse_fleet_host(name: &str) -> Result<(), Error> {
    match fleet_of_host(name) {
        Some(fleet) => Err(Error::conflict(format!(
            "sandbox {name} is a host of the fleet sandbox {fleet}: its namespaces are that fleet's (`vmnet-lab down --sandbox --name {fleet}` removes the whole fleet)"
        ))),
        None => Ok(()),
    }
}

/// Reads the host spec; the default path falls back to the compiled-in `examples/host.json` when
/// the file is not there (e.g. the binary runs from another directory).
fn read_spec(path: &Path) -> Result<String, Error> {
    match std::fs::read_to_string(path) {
        Ok(t) => Ok(t),
        Err(e)
            if e.kind() == std::io::ErrorKind::NotFound && path == Path::new(DEFAULT_HOST_SPEC) =>
        {
            Ok(EMBEDDED_HOST_SPEC.to_owned())
        }
        Err(e) => Err(Error::invalid(format!("host spec {}: {e}", path.display()))),
    }
}

/// Runs `vmnet-lab up --sandbox`.
///
/// # Errors
/// `INVALID_INPUT` for a bad flag or host spec, `UNAVAILABLE` when there is no `vmnet` binary
/// to run the agent from ([`crate::exe::vmnet`]), `CONFLICT` when the sandbox exists, `INTERNAL`
/// when building it fails (after removing what was built) or when any check fails (the sandbox
/// then stays up for inspection).
pub async fn run(json: bool, args: UpArgs) -> Result<(), Error> {
    // Caught from the start, so an interrupt never leaves a half-built sandbox behind.
    let interrupts = state::Interrupts::install()?;
    need_root_and_flag(args.sandbox, "up")?;
    crate::agent_args::check(&args.agent_args)?;
    check_name(&args.name)?;
    refuse_fleet_host(&args.name)?;
    // Every agent of the sandbox is a `vmnet serve`: no binary, nothing is built.
    crate::exe::vmnet()?;
    let text = read_spec(&args.host_spec)?;
    if crate::pool_job::is_pool_spec(&text) {
        return crate::pool_job::up_pool(
            json,
            &args.host_spec,
            &args.name,
            &args.root,
            Duration::from_secs(args.timeout_secs),
            (args.guests, &args.agent_args),
            interrupts,
        )
        .await;
    }
    if crate::fleet_job::is_fleet_spec(&text) {
        if args.guests == crate::kvm::GuestKind::Kvm {
            return Err(Error::invalid(
                "vmnet-lab up --sandbox --guests kvm: real guests run for single-host specs (namespace or pool mode), not fleet specs (\"mode\": \"fleet\")",
            ));
        }
        return crate::fleet_job::up(json, &args, &text, interrupts).await;
    }
    crate::ns_job::up(json, &args, &text, interrupts).await
}

/// Runs `vmnet-lab down --sandbox`.
///
/// # Errors
/// `INVALID_INPUT` for a bad flag, `NOT_FOUND` when no such sandbox exists, `INTERNAL` when
/// something could not be removed.
pub async fn down(json: bool, args: DownArgs) -> Result<(), Error> {
    need_root_and_flag(args.sandbox, "down")?;
    if let Some(pid) = state::builder(&args.root.join(&args.name)) {
        return Err(Error::conflict(format!(
            "sandbox {} is still being made by `vmnet-lab up` (pid {pid}): interrupt that run (Ctrl-C) instead, it removes what it built",
            args.name
        )));
    }
    check_name(&args.name)?;
    refuse_fleet_host(&args.name)?;
    let paths = Paths::new(&args.root, &args.name);
    let owned = sandbox::owned(&args.name);
    // Without its state, a sandbox is known by namespaces only a sandbox makes (its host, its
    // fake internet, its `x-` helpers). Names like `<name>n0042` alone are an agent's VMs, which
    // may be any agent's whose --name-prefix is this name: never deleted here.
    let sandbox_made = owned.iter().any(|n| {
        n.strip_prefix(args.name.as_str())
            .is_some_and(|rest| rest == "host" || rest == "inet" || rest.starts_with("x-"))
    });
    if !paths.dir.exists() && !sandbox_made && !pg_dir(&args.name).exists() {
        let vms = if owned.is_empty() {
            String::new()
        } else {
            format!(
                "; {} namespaces named like an agent's VMs ({}) are left alone: remove those \
                 VMs through their agent",
                owned.len(),
                owned.join(" ")
            )
        };
        return Err(Error::not_found(format!(
            "no sandbox {} is up (no {}, no namespace {}host or {}inet){vms}",
            args.name,
            paths.dir.display(),
            args.name,
            args.name
        )));
    }
    let report = tokio::task::spawn_blocking(move || teardown(&paths, &args.name))
        .await
        .map_err(|e| Error::internal(format!("down: {e}")))??;
    match json {
        true => println!(
            "{}",
            serde_json::to_string_pretty(&report).map_err(|e| Error::internal(e.to_string()))?
        ),
        false => {
            for p in &report.stopped {
                println!("stopped {p}");
            }
            for p in &report.already_gone {
                println!("{p} was no longer running");
            }
            let n = report.namespaces.len();
            println!(
                "deleted {n} namespace{}: {}",
                if n == 1 { "" } else { "s" },
                report.namespaces.join(" ")
            );
            for p in &report.left_running {
                eprintln!(
                    "warning: {p} was inside the sandbox's namespaces and was not started by `up`: left running, stop it by its pid"
                );
            }
        }
    }
    Ok(())
}
