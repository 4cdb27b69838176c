//! Applying a [`GuestNet`] with systemd-networkd: only what changed changes.
//!
//! 1. The kernel first: the interface's addresses and routes are read and only the difference
//!    is applied over rtnetlink ([`crate::plan`], [`crate::kernel`]): a new mesh address goes on
//!    before the old one comes off, a new host route is added, a route no longer asked for is
//!    deleted. The guest address, the default routes and every route that stays are never
//!    touched, so traffic on them does not stop.
//! 2. Then the drop-in for the guest interface's `.network` file, written atomically, and only
//!    when its text differs from what is on disk. It makes the configuration survive a reboot or
//!    a restart of networkd, and it is the record of the routes vmnet-guest put on the
//!    interface (so a restarted vmnet-guest knows which ones are its own to delete).
//!
//! networkd is not asked to reload: its `networkctl reload` (and `reconfigure`) take every
//! address and route of the interface down and put them back, twice the whole configuration
//! for one changed address. networkd leaves addresses and routes it did not add alone until it
//! configures the interface again (its own restart, or a reload by someone else), and then it
//! reads the drop-in, which already says the same as the kernel.
//!
//! After a change to the kernel the resets run, each once whatever the others gave:
//! `resolvectl flush-caches` and `resolvectl reset-server-features` (systemd-resolved forgets
//! answers and the feature level it backed off to while the VM was suspended) and
//! `systemctl try-restart systemd-timesyncd` (timesyncd polls again at its shortest interval;
//! after a resume the clock is off by the pause). A reset that fails (an image without
//! timesyncd) is logged and does not fail the apply. Nothing changed, nothing runs: a restarted
//! vmnet-guest that finds its configuration on disk and in the kernel writes and runs nothing.

use std::io::Write;
use std::path::{Path, PathBuf};

use ipnet::IpNet;

use crate::doc::GuestNet;
use crate::kernel::Kernel;
use crate::plan::{self, Changes, GATEWAY_V4, GATEWAY_V6};

/// The name of the drop-in file inside `<network file>.d/`.
pub const DROP_IN_NAME: &str = "50-vmnet-guest.conf";

/// What the networkd applier needs from the system; faked in tests.
pub trait System {
    /// The text of `path`, `None` when it does not exist or cannot be read.
    fn read(&mut self, path: &Path) -> Option<String>;
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
    fn read(&mut self, path: &Path) -> Option<String> {
        std::fs::read_to_string(path).ok()
    }

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
    for d in plan::wanted_routes(net) {
        let gw = match d {
            IpNet::V4(_) => GATEWAY_V4.to_string(),
            IpNet::V6(_) => GATEWAY_V6.to_string(),
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

/// The resets run after a change to the kernel, each once, failures logged only (module docs).
#[must_use]
pub fn resets() -> Vec<Vec<String>> {
    owned(vec![
        vec!["resolvectl", "flush-caches"],
        vec!["resolvectl", "reset-server-features"],
        vec!["systemctl", "try-restart", "systemd-timesyncd"],
    ])
}

/// What one apply did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Applied {
    /// The kernel changes made.
    pub changes: Changes,
    /// Whether the drop-in was written.
    pub wrote: bool,
    /// The resets that failed, as messages.
    pub failed_resets: Vec<String>,
}

impl Applied {
    /// Whether anything changed (the kernel or the file).
    #[must_use]
    pub fn changed(&self) -> bool {
        self.wrote || !self.changes.is_empty()
    }
}

impl std::fmt::Display for Applied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}; drop-in {}",
            self.changes,
            if self.wrote { "written" } else { "unchanged" }
        )
    }
}

/// Applies [`GuestNet`]s with networkd's drop-in and the kernel difference.
#[derive(Debug)]
pub struct Networkd<S, K> {
    sys: S,
    kernel: K,
    path: PathBuf,
    base: PathBuf,
    /// The routes of the last apply (owned even when the drop-in cannot be read).
    last: Vec<IpNet>,
}

impl<S: System, K: Kernel> Networkd<S, K> {
    /// An applier writing `<dir>/<network_file>.d/50-vmnet-guest.conf`, changing the interface
    /// through `kernel`.
    pub fn new(sys: S, kernel: K, dir: &Path, network_file: &str) -> Self {
        Self {
            sys,
            kernel,
            path: dir.join(format!("{network_file}.d")).join(DROP_IN_NAME),
            base: dir.join(network_file),
            last: Vec::new(),
        }
    }

    /// Applies `net` (see the module docs).
    ///
    /// # Errors
    /// The first failure of the kernel changes or the drop-in write; the next apply reads the
    /// kernel and the disk again and does what is left.
    pub async fn apply(&mut self, net: &GuestNet) -> Result<Applied, String> {
        let seen = self.kernel.observe().await?;
        let on_disk = self.sys.read(&self.path);
        let mut owned = on_disk
            .as_deref()
            .map(plan::file_routes)
            .unwrap_or_default();
        owned.extend(self.last.iter().copied());
        let kept = self
            .sys
            .read(&self.base)
            .map(|t| plan::file_routes(&t))
            .unwrap_or_default();
        let changes = plan::plan(net, &seen, &owned, &kept);
        self.kernel.apply(&changes).await?;
        self.last = plan::wanted_routes(net);
        let text = render(net);
        let wrote = on_disk.as_deref() != Some(text.as_str());
        if wrote {
            self.sys.write_atomic(&self.path, &text)?;
        }
        let failed_resets = if changes.is_empty() {
            Vec::new()
        } else {
            resets()
                .iter()
                .filter_map(|argv| {
                    let args: Vec<&str> = argv.iter().map(String::as_str).collect();
                    self.sys.run(&args).err()
                })
                .collect()
        };
        Ok(Applied {
            changes,
            wrote,
            failed_resets,
        })
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

    #[cfg(test)]
    /// The kernel (tests look at and change the fake).
    pub fn kernel_mut(&mut self) -> &mut K {
        &mut self.kernel
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
        let path = dir.path().join("10-eth0.network.d").join(DROP_IN_NAME);
        let net = parse("fdaa:1::7", "").unwrap();
        let mut sys = RealSystem;
        assert_eq!(sys.read(&path), None);
        sys.write_atomic(&path, &render(&net)).unwrap();
        assert_eq!(sys.read(&path).as_deref(), Some(render(&net).as_str()));
        let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
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
