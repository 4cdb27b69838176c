//! `vmnet-lab package-vm DEB`: the vmnet package on a fresh Debian 12 VM, installed and run as
//! an operator does, and checked there under systemd.
//!
//! The VM boots under qemu (KVM, or TCG with a warning: see [`super::Accel`]) from the host image
//! of `scripts/guest-image.sh --host` (Debian's packages only, made on this machine, cached; it
//! holds what the package depends on and Debian's `prometheus`). The VM needs no internet: the
//! package reaches it on a read-only virtio disk (`/dev/vdb`, ext4), and `apt-get install
//! ./vmnet_*.deb` finds every dependency installed. qemu runs in a throwaway namespace of this
//! host, on a tap `tap0` at 192.0.2.1/24 there: the VM's uplink `eth0` is 192.0.2.2/24 via
//! 192.0.2.1 (the image's), so the far end of the VM's uplink is that namespace and nothing else.
//! Inside the VM, vmnet changes the VM's own network, never this host's.
//!
//! The checks run inside the VM over the command channel ([`super::chan`]), in order; the first
//! step that cannot run ends the list with its failure ([`super::package_vm_guest`] has each
//! step). Everything made here (the namespaces, the tap, qemu, the overlay and the package disk in
//! a temporary directory) is removed on return, also on failure.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde::Serialize;
use vmnet_model::Error;

use super::package_vm_guest::{self as steps, Guest};
use super::{Accel, GuestImage, Vm, VmConfig};
use crate::pool_job::checks::Check;

/// The VM's MAC: the host image's networkd file matches it.
pub const MAC: &str = "06:00:c0:00:02:02";
/// The far end of the VM's uplink (the tap in this host's throwaway namespace).
pub const UPLINK_PEER: &str = "192.0.2.1";

/// Arguments of `vmnet-lab package-vm`.
#[derive(Debug, clap::Args)]
pub struct PackageVmArgs {
    /// The vmnet package to install (`scripts/package.sh` makes it:
    /// `target/debian/vmnet_VERSION_amd64.deb`).
    pub deb: PathBuf,
    /// How long the VM may take to answer on its command channel after qemu starts, seconds.
    #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(10..=3600))]
    pub boot_timeout_secs: u64,
    /// The VM's memory, MiB.
    #[arg(long, default_value_t = 1536, value_parser = clap::value_parser!(u32).range(512..=16384))]
    pub memory_mib: u32,
}

/// What `package-vm` reports (`--output json`).
#[derive(Debug, Clone, Serialize)]
pub struct PackageVmReport {
    /// The package installed.
    pub deb: PathBuf,
    /// The host image booted.
    pub image: PathBuf,
    /// `kvm` or `tcg`.
    pub accel: String,
    /// Seconds from qemu's start to the command channel's first answer.
    pub boot_secs: f64,
    /// Seconds the whole run took, the image's lookup included.
    pub wall_secs: f64,
    /// The checks, in order.
    pub checks: Vec<Check>,
}

/// Runs the checks and prints the table (or JSON).
///
/// # Errors
/// `INVALID_INPUT` when not root or `deb` is not a vmnet package; `UNAVAILABLE` when the image,
/// the namespace, the package disk or qemu cannot be set up; `INTERNAL` when a check failed
/// (after the report is printed).
pub fn run(json: bool, args: &PackageVmArgs) -> Result<(), Error> {
    let start = Instant::now();
    if !nix::unistd::geteuid().is_root() {
        return Err(Error::invalid(
            "vmnet-lab package-vm must run as root (it creates a network namespace and boots qemu)",
        ));
    }
    check_deb(&args.deb)?;
    let (accel, why) = Accel::detect();
    if let Some(why) = why {
        eprintln!("warning: the VM runs under TCG (emulation, slow): {why}");
    }
    let image = GuestImage::find_or_build_host()?;
    let unavailable =
        |what: &str, e: String| Error::unavailable(format!("package-vm: {what}: {e}"));
    let sb = crate::Sandbox::new("pv").map_err(|e| unavailable("sandbox", e.to_string()))?;
    let ns = uplink(&sb).map_err(|e| unavailable("uplink tap", e))?;
    let dir = tempfile::Builder::new()
        .prefix("vmnet-package-vm.")
        .tempdir()
        .map_err(|e| unavailable("temporary directory", e.to_string()))?;
    let disk = package_disk(&args.deb, dir.path()).map_err(|e| unavailable("package disk", e))?;
    let cfg = VmConfig {
        name: "host".into(),
        netns: ns,
        nic_args: vec![
            "-netdev".into(),
            "tap,id=net0,ifname=tap0,script=no,downscript=no".into(),
            "-device".into(),
            format!("virtio-net-pci,netdev=net0,mac={MAC}"),
        ],
        seed_iso: None,
        cmdline_extra: String::new(),
        disks: vec![disk],
        memory_mib: args.memory_mib,
        cpus: 2,
    };
    let vm = Vm::start(&cfg, &image, accel, dir.path())?;
    let (ch, boot) = vm.channel(Duration::from_secs(args.boot_timeout_secs))?;
    let deb_name = args
        .deb
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut guest = Guest::new(ch, deb_name);
    let checks = steps::run_all(&mut guest, boot, accel);
    if checks.iter().any(|c| !c.ok) {
        eprintln!("{}", guest.diagnostics());
    }
    drop(guest);
    drop(vm);
    drop(sb);
    let report = PackageVmReport {
        deb: args.deb.clone(),
        image: image.dir.clone(),
        accel: match accel {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
        .into(),
        boot_secs: boot.as_secs_f64(),
        wall_secs: start.elapsed().as_secs_f64(),
        checks,
    };
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).unwrap_or_default()
        );
    } else {
        print!("{}", render(&report));
    }
    let failed = report.checks.iter().filter(|c| !c.ok).count();
    if failed > 0 {
        return Err(Error::internal(format!(
            "{failed} of {} package-vm checks failed",
            report.checks.len()
        )));
    }
    Ok(())
}

/// Refuses a file that is not a `vmnet` package.
fn check_deb(deb: &Path) -> Result<(), Error> {
    let out = Command::new("dpkg-deb")
        .args(["-f"])
        .arg(deb)
        .arg("Package")
        .output()
        .map_err(|e| Error::unavailable(format!("dpkg-deb: {e}")))?;
    let name = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if !out.status.success() || name != "vmnet" {
        return Err(Error::invalid(format!(
            "package-vm: {} is not the vmnet package ({}); build it with scripts/package.sh",
            deb.display(),
            if out.status.success() {
                format!("it is {name:?}")
            } else {
                String::from_utf8_lossy(&out.stderr).trim().to_owned()
            }
        )));
    }
    Ok(())
}

/// A namespace of `sb` with the tap `tap0` at [`UPLINK_PEER`]/24 that qemu opens; its name.
fn uplink(sb: &crate::Sandbox) -> Result<String, String> {
    let ns = sb.add_netns("u").map_err(|e| e.to_string())?;
    let addr = format!("{UPLINK_PEER}/24");
    for args in [
        &["tuntap", "add", "dev", "tap0", "mode", "tap"][..],
        &["addr", "add", &addr, "dev", "tap0"],
        &["link", "set", "tap0", "up"],
    ] {
        crate::netns::ip(&ns, args).map_err(|e| e.to_string())?;
    }
    Ok(ns)
}

/// An ext4 image in `dir` holding a copy of `deb` (the VM mounts it read-only); its path.
fn package_disk(deb: &Path, dir: &Path) -> Result<PathBuf, String> {
    let content = dir.join("pkg");
    std::fs::create_dir_all(&content).map_err(|e| e.to_string())?;
    let name = deb.file_name().ok_or("the package path has no file name")?;
    let size =
        std::fs::copy(deb, content.join(name)).map_err(|e| format!("{}: {e}", deb.display()))?;
    let mib = size / 1_048_576 + size / 10_485_760 + 32;
    let disk = dir.join("pkg.raw");
    let out = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-L", "vmnetpkg", "-d"])
        .arg(&content)
        .arg(&disk)
        .arg(format!("{mib}M"))
        .output()
        .map_err(|e| format!("mkfs.ext4: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "mkfs.ext4: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let _ = std::fs::remove_dir_all(&content);
    Ok(disk)
}

/// The checks table and the summary line.
fn render(r: &PackageVmReport) -> String {
    let ok = r.checks.iter().filter(|c| c.ok).count();
    format!(
        "package {} on a fresh Debian 12 VM ({}, image {})\n\n{}\n{ok}/{} checks ok in {:.0} s (boot {:.0} s); VM, namespaces and files removed\n",
        r.deb.display(),
        r.accel,
        r.image.display(),
        crate::pool_job::checks::table(&r.checks),
        r.checks.len(),
        r.wall_secs,
        r.boot_secs
    )
}
