//! Applying a [`GuestNet`] through systemd-networkd: a drop-in for the guest interface's
//! `.network` file, written atomically, then the reload and the resets.
//!
//! The command sequence, in order. The first two apply the network and must succeed (else the
//! apply fails and is retried at the next poll):
//! 1. `networkctl reload` — networkd re-reads its files;
//! 2. `networkctl reconfigure <if>` — and re-applies them to the interface now.
//!
//! Then the resets, each run once per apply whatever the others gave. A reset that fails (an
//! image without systemd-timesyncd, a resolver that is not running) is logged and does not fail
//! the apply: retrying it would reconfigure the interface again every poll, taking its routes
//! down each time, for a service that is not there. (A real guest showed exactly that.)
//! 3. `resolvectl flush-caches` and `resolvectl reset-server-features` — systemd-resolved
//!    forgets answers and the feature level it backed off to while the VM was suspended;
//! 4. `systemctl try-restart systemd-timesyncd` — timesyncd, when running, starts polling again
//!    at its shortest interval (after a resume it sits at a long back-off and the clock is off
//!    by the pause).

use std::io::Write;
use std::path::{Path, PathBuf};

use ipnet::IpNet;

use crate::doc::GuestNet;

/// The guest's IPv4 gateway (the tap in the VM's namespace).
pub const GATEWAY_V4: &str = "172.16.0.1";
/// The guest's IPv6 gateway (the tap's link-local).
pub const GATEWAY_V6: &str = "fe80::1";
/// The name of the drop-in file inside `<network file>.d/`.
pub const DROP_IN_NAME: &str = "50-vmnet-guest.conf";

/// What the networkd applier needs from the system; faked in tests.
pub trait System {
    /// Writes `contents` to `path` atomically: a temporary file in the same directory, synced,
    /// then renamed over `path` (the directory is created when missing).
    ///
    /// # Errors
    /// The I/O error, as a message.
    fn write_atomic(&mut self, path: &Path, contents: &str) -> Result<(), String>;
    /// Runs `argv` and waits for it.
    ///
    /// # Errors
    /// A message when it cannot start or exits unsuccessfully.
    fn run(&mut self, argv: &[&str]) -> Result<(), String>;
}

/// The real system: the file system and child processes.
#[derive(Debug, Default)]
pub struct RealSystem;

impl System for RealSystem {
    fn write_atomic(&mut self, path: &Path, contents: &str) -> Result<(), String> {
        let dir = path
            .parent()
            .ok_or_else(|| format!("{}: no parent directory", path.display()))?;
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let tmp = dir.join(format!(
            ".{}.tmp",
            path.file_name()
                .and_then(|n| n.to_str())
                .unwrap_or("drop-in")
        ));
        let mut f = std::fs::File::create(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
        f.write_all(contents.as_bytes())
            .and_then(|()| f.sync_all())
            .map_err(|e| format!("{}: {e}", tmp.display()))?;
        std::fs::rename(&tmp, path).map_err(|e| format!("{}: {e}", path.display()))
    }

    fn run(&mut self, argv: &[&str]) -> Result<(), String> {
        let (cmd, args) = argv.split_first().ok_or("empty command")?;
        let out = std::process::Command::new(cmd)
            .args(args)
            .output()
            .map_err(|e| format!("{}: {e}", argv.join(" ")))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "{}: {}: {}",
                argv.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }
}

/// The drop-in for `net`: the mesh address as a /128 without duplicate address detection, a
/// route to the mesh range `fdaa::/16` (mesh peers), and one route per host route, each via
/// the guest's gateway of its family.
#[must_use]
pub fn render(net: &GuestNet) -> String {
    let mut s = String::from(
        "# Written by vmnet-guest from the metadata service (169.254.169.254); do not edit.\n\n",
    );
    s.push_str(&format!(
        "[Address]\nAddress={}/128\nDuplicateAddressDetection=none\n",
        net.mesh_ipv6
    ));
    let mesh = IpNet::V6(vmnet_model::vm::MESH_RANGE);
    for d in std::iter::once(&mesh).chain(net.host_routes.iter().filter(|d| **d != mesh)) {
        let gw = match d {
            IpNet::V4(_) => GATEWAY_V4,
            IpNet::V6(_) => GATEWAY_V6,
        };
        s.push_str(&format!("\n[Route]\nDestination={d}\nGateway={gw}\n"));
    }
    s
}

fn owned(v: Vec<Vec<&str>>) -> Vec<Vec<String>> {
    v.into_iter()
        .map(|v| v.into_iter().map(str::to_owned).collect())
        .collect()
}

/// The commands that apply the drop-in, in order; each must succeed (module docs).
#[must_use]
pub fn commands(ifname: &str) -> Vec<Vec<String>> {
    owned(vec![
        vec!["networkctl", "reload"],
        vec!["networkctl", "reconfigure", ifname],
    ])
}

/// The resets run after [`commands`], each once, failures logged only (module docs).
#[must_use]
pub fn resets() -> Vec<Vec<String>> {
    owned(vec![
        vec!["resolvectl", "flush-caches"],
        vec!["resolvectl", "reset-server-features"],
        vec!["systemctl", "try-restart", "systemd-timesyncd"],
    ])
}

/// Applies [`GuestNet`]s through networkd.
#[derive(Debug)]
pub struct Networkd<S> {
    sys: S,
    ifname: String,
    path: PathBuf,
}

impl<S: System> Networkd<S> {
    /// An applier writing `<dir>/<network_file>.d/50-vmnet-guest.conf` for `ifname`.
    pub fn new(sys: S, ifname: &str, dir: &Path, network_file: &str) -> Self {
        Self {
            sys,
            ifname: ifname.to_owned(),
            path: dir.join(format!("{network_file}.d")).join(DROP_IN_NAME),
        }
    }

    #[cfg(test)]
    /// The drop-in's path.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes the drop-in and runs the [`commands`], stopping at the first failure, then every
    /// one of the [`resets`]; the resets that failed, as messages (logged by the caller).
    ///
    /// # Errors
    /// The first failure of the drop-in write or the [`commands`].
    pub fn apply(&mut self, net: &GuestNet) -> Result<Vec<String>, String> {
        self.sys.write_atomic(&self.path, &render(net))?;
        for argv in commands(&self.ifname) {
            let args: Vec<&str> = argv.iter().map(String::as_str).collect();
            self.sys.run(&args)?;
        }
        Ok(resets()
            .iter()
            .filter_map(|argv| {
                let args: Vec<&str> = argv.iter().map(String::as_str).collect();
                self.sys.run(&args).err()
            })
            .collect())
    }

    #[cfg(test)]
    /// The system (tests look at what the fake recorded).
    #[must_use]
    pub fn system(&self) -> &S {
        &self.sys
    }

    #[cfg(test)]
    /// The system, to change (tests make the fake fail).
    pub fn sys_mut(&mut self) -> &mut S {
        &mut self.sys
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doc::parse;

    #[test]
    fn drop_in_rendering() {
        let net = parse("fdaa:1::7", "0.0.0.0/0\n::/0").unwrap();
        assert_eq!(
            render(&net),
            "# Written by vmnet-guest from the metadata service (169.254.169.254); do not edit.\n\n\
             [Address]\nAddress=fdaa:1::7/128\nDuplicateAddressDetection=none\n\n\
             [Route]\nDestination=fdaa::/16\nGateway=fe80::1\n\n\
             [Route]\nDestination=0.0.0.0/0\nGateway=172.16.0.1\n\n\
             [Route]\nDestination=::/0\nGateway=fe80::1\n"
        );
        let bare = parse("fdaa::9", "").unwrap();
        assert!(render(&bare).ends_with("[Route]\nDestination=fdaa::/16\nGateway=fe80::1\n"));
    }

    #[test]
    fn real_writes_are_atomic_renames() {
        let dir = tempfile::tempdir().unwrap();
        let mut n = Networkd::new(RealSystem, "eth0", dir.path(), "10-eth0.network");
        let net = parse("fdaa:1::7", "").unwrap();
        // Only the write: the commands are not run here.
        n.sys.write_atomic(&n.path.clone(), &render(&net)).unwrap();
        let p = dir.path().join("10-eth0.network.d").join(DROP_IN_NAME);
        assert_eq!(n.path(), p);
        assert_eq!(std::fs::read_to_string(&p).unwrap(), render(&net));
        let names: Vec<_> = std::fs::read_dir(p.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            names,
            [std::ffi::OsString::from(DROP_IN_NAME)],
            "no temporary left"
        );
    }
}
