//! The worker user on a fresh machine: the agent runs its unprivileged worker as
//! `--worker-user` (default `vmnet-worker`), which the set-up (`scripts/install-deps.sh`)
//! creates; the sandbox, the benchmarks and the root tests create the default one themselves
//! when it is missing, as the set-up does.

use std::process::Command;

use vmnet_agent::worker::DEFAULT_USER;

/// Makes sure user `name` exists: a `UID:GID` needs nothing; the default user is created with
/// `useradd --system` (no home, no login shell) when missing; any other name must exist.
///
/// # Errors
/// A message when the user is missing and cannot (or may not) be created.
pub fn ensure(name: &str) -> Result<(), String> {
    if name.contains(':') {
        return Ok(());
    }
    match nix::unistd::User::from_name(name) {
        Ok(Some(_)) => return Ok(()),
        Ok(None) if name == DEFAULT_USER => {}
        Ok(None) => return Err(format!("user {name} does not exist")),
        Err(e) => return Err(format!("user {name}: lookup failed: {e}")),
    }
    let out = Command::new("useradd")
        .args([
            "--system",
            "--user-group",
            "--no-create-home",
            "--home-dir",
            "/nonexistent",
            "--shell",
            "/usr/sbin/nologin",
            "--comment",
            "vmnet unprivileged worker",
            name,
        ])
        .output()
        .map_err(|e| format!("useradd {name}: {e}"))?;
    // Another process may have created it meanwhile (useradd exits 9: the name is taken).
    if out.status.success() || matches!(nix::unistd::User::from_name(name), Ok(Some(_))) {
        Ok(())
    } else {
        Err(format!(
            "useradd {name}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}
