//! Real guests for `vmnet-lab up --sandbox --guests kvm`: Linux VMs booted by `qemu-system-x86_64`
//! on the taps vmnet made, from the image `scripts/guest-image.sh` builds (Debian's cloud
//! kernel, an ext4 root with systemd-networkd, cloud-init and vmnet-guest).
//!
//! - [`image`]: the cached image (built on first use).
//! - [`Vm`]: one guest — its qcow2 overlay over the read-only cached root, its serial console log
//!   and command-channel socket, all in the sandbox state directory; qemu runs in the namespace
//!   that holds the tap (`ip netns exec`), in its own process group, and is stopped by pid on
//!   drop (and by `vmnet-lab down --sandbox`, which finds it in `sandbox.json`: its command line
//!   names the state directory).
//! - [`chan`]: the command channel (virtio-serial).
//! - [`qmp`], [`snapshot`]: the QMP socket (`qmp.sock` in the guest's directory), and a guest
//!   saved to a file with qemu quit, then restored by a new qemu on the same tap.
//! - [`pool`]: the pool-mode checks run from inside the guests.
//! - [`ns`], [`ns_traffic`]: the namespace-mode checks run from inside the guests.
//! - [`package_vm`], [`package_vm_guest`] (and its restarts): `vmnet-lab package-vm`, the vmnet package installed
//!   and checked under systemd in a VM booted from the host image.
//!
//! # Acceleration
//! KVM when `/dev/kvm` is there and usable by a stock kernel; otherwise TCG with a warning. A host
//! whose KVM is `kvm_pvm` (pagetable-based virtualisation inside a VM) runs only guests built for
//! PVM, so there TCG is used too. `VMNET_GUEST_ACCEL=kvm|tcg` overrides the choice.

pub mod chan;
pub mod image;
pub mod ns;
pub mod ns_traffic;
pub mod package_vm;
pub mod package_vm_guest;
mod package_vm_restarts;
pub mod pool;
pub mod qmp;
pub mod snapshot;
pub mod watch;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use std::os::unix::process::CommandExt;

use vmnet_model::Error;

pub use self::chan::{Channel, Ran};
pub use self::image::GuestImage;

/// Which guests `vmnet-lab up --sandbox` attaches to the VMs' taps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum GuestKind {
    /// Simulated guests: a namespace per VM joined to its tap by a frame relay.
    #[default]
    Sim,
    /// Real Linux guests under qemu (KVM, or TCG with a warning).
    Kvm,
}

/// How qemu runs the guest's CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    /// Hardware virtualisation.
    Kvm,
    /// Emulation (slow; a warning is printed).
    Tcg,
}

impl Accel {
    /// The choice for this host (see the module docs) and, for TCG, why.
    #[must_use]
    pub fn detect() -> (Self, Option<String>) {
        match std::env::var("VMNET_GUEST_ACCEL").as_deref() {
            Ok("kvm") => return (Self::Kvm, None),
            Ok("tcg") => return (Self::Tcg, Some("VMNET_GUEST_ACCEL=tcg".into())),
            _ => {}
        }
        if !Path::new("/dev/kvm").exists() {
            return (Self::Tcg, Some("no /dev/kvm".into()));
        }
        if Path::new("/sys/module/kvm_pvm").exists() {
            return (
                Self::Tcg,
                Some("this host's KVM is kvm_pvm, which boots only PVM guest kernels".into()),
            );
        }
        (Self::Kvm, None)
    }

    fn args(self) -> [&'static str; 4] {
        match self {
            // arch-capabilities off: nested hosts refuse MSR 0x10a and qemu aborts.
            Self::Kvm => ["-accel", "kvm", "-cpu", "host,-arch-capabilities"],
            Self::Tcg => ["-accel", "tcg,thread=multi", "-cpu", "max"],
        }
    }
}

/// The guest image (built or found in its cache) and the accelerator, warning on TCG.
///
/// # Errors
/// `UNAVAILABLE` when the image cannot be built or found.
pub fn setup() -> Result<(GuestImage, Accel), Error> {
    let (accel, why) = Accel::detect();
    if let Some(why) = why {
        eprintln!("warning: real guests run under TCG (emulation, slow): {why}");
    }
    Ok((GuestImage::find_or_build()?, accel))
}

/// How one guest boots.
#[derive(Debug, Clone)]
pub struct VmConfig {
    /// A short name (file names in the state directory).
    pub name: String,
    /// The namespace qemu runs in (the one holding the tap).
    pub netns: String,
    /// The NIC arguments, as `GET /v1/instances/{id}/nics` gives them (`runtime.qemu_args`), or
    /// built for namespace mode.
    pub nic_args: Vec<String>,
    /// The NoCloud seed image (`seed.iso`), when the guest boots with cloud-init.
    pub seed_iso: Option<PathBuf>,
    /// Extra kernel command line words (`cloud-init=disabled vmnet.mode=ns`).
    pub cmdline_extra: String,
    /// Raw disk images attached read-only after the root disk (`/dev/vdb`, … in the guest).
    pub disks: Vec<PathBuf>,
    /// Guest memory, MiB.
    pub memory_mib: u32,
    /// Virtual CPUs.
    pub cpus: u32,
}

/// A running guest (stopped on drop).
pub struct Vm {
    /// Its name.
    pub name: String,
    /// When qemu was started.
    pub started: std::time::Instant,
    pid: u32,
    child: Option<std::process::Child>,
    marker: String,
    /// The serial console log.
    pub console: PathBuf,
    /// The command channel socket.
    pub socket: PathBuf,
    /// The QMP socket ([`snapshot`]).
    pub qmp: PathBuf,
    log: PathBuf,
    /// qemu's arguments after `ip` (`netns exec NS qemu-system-x86_64 …`), to start it again.
    argv: Vec<OsString>,
    overlay: PathBuf,
    detached: bool,
}

impl Vm {
    /// Starts qemu for `cfg` with `image`, its files under `dir` (the sandbox state directory).
    ///
    /// # Errors
    /// `INTERNAL` when the overlay cannot be made or qemu not started.
    pub fn start(
        cfg: &VmConfig,
        image: &GuestImage,
        accel: Accel,
        dir: &Path,
    ) -> Result<Self, Error> {
        let vmdir = dir.join("vms").join(&cfg.name);
        std::fs::create_dir_all(&vmdir)
            .map_err(|e| Error::internal(format!("{}: {e}", vmdir.display())))?;
        let overlay = vmdir.join("overlay.qcow2");
        let out = Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b"])
            .arg(&image.rootfs)
            .arg(&overlay)
            .output()
            .map_err(|e| Error::internal(format!("qemu-img: {e}")))?;
        if !out.status.success() {
            return Err(Error::internal(format!(
                "qemu-img create {}: {}",
                overlay.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        let console = vmdir.join("console.log");
        let socket = vmdir.join("cmd.sock");
        let qmp = vmdir.join("qmp.sock");
        let log = vmdir.join("qemu.log");
        // The console is appended to, across a restore too: start it empty.
        std::fs::File::create(&console)
            .map_err(|e| Error::internal(format!("{}: {e}", console.display())))?;
        let mut argv: Vec<OsString> = ["netns", "exec", &cfg.netns, "qemu-system-x86_64"]
            .iter()
            .map(OsString::from)
            .collect();
        let mut add = |a: &[&str]| argv.extend(a.iter().map(OsString::from));
        add(&[
            "-machine",
            "q35",
            "-m",
            &cfg.memory_mib.to_string(),
            "-smp",
            &cfg.cpus.to_string(),
        ]);
        add(&accel.args());
        add(&[
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
        ]);
        argv.push("-kernel".into());
        argv.push(image.kernel.clone().into());
        argv.push("-initrd".into());
        argv.push(image.initrd.clone().into());
        argv.push("-append".into());
        argv.push(
            format!(
                "root=LABEL=vmroot rw console=ttyS0 panic=-1 net.ifnames=0 {}",
                cfg.cmdline_extra
            )
            .into(),
        );
        argv.push("-drive".into());
        argv.push(format!("file={},if=virtio,format=qcow2", overlay.display()).into());
        argv.push("-chardev".into());
        argv.push(format!("file,id=console,path={},append=on", console.display()).into());
        argv.push("-serial".into());
        argv.push("chardev:console".into());
        argv.push("-qmp".into());
        argv.push(format!("unix:{},server=on,wait=off", qmp.display()).into());
        argv.extend(["-device", "virtio-serial-pci", "-chardev"].map(OsString::from));
        argv.push(format!("socket,id=cmd,path={},server=on,wait=off", socket.display()).into());
        argv.extend(["-device", "virtserialport,chardev=cmd,name=vmnet.cmd"].map(OsString::from));
        argv.extend(cfg.nic_args.iter().map(OsString::from));
        for disk in &cfg.disks {
            argv.push("-drive".into());
            argv.push(format!("file={},if=virtio,format=raw,readonly=on", disk.display()).into());
        }
        if let Some(seed) = &cfg.seed_iso {
            argv.push("-drive".into());
            argv.push(
                format!(
                    "file={},if=virtio,format=raw,readonly=on,media=cdrom",
                    seed.display()
                )
                .into(),
            );
        }
        let mut vm = Self {
            name: cfg.name.clone(),
            started: std::time::Instant::now(),
            pid: 0,
            child: None,
            marker: vmdir.display().to_string(),
            console,
            socket,
            qmp,
            log,
            argv,
            overlay,
            detached: false,
        };
        vm.spawn(&[], false)?;
        Ok(vm)
    }

    /// Starts qemu with the guest's command line and `extra` arguments, its output to
    /// `qemu.log` (appended to with `append`).
    fn spawn(&mut self, extra: &[OsString], append: bool) -> Result<(), Error> {
        let logf = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(&self.log)
            .map_err(|e| Error::internal(format!("{}: {e}", self.log.display())))?;
        let errf = logf
            .try_clone()
            .map_err(|e| Error::internal(format!("{}: {e}", self.log.display())))?;
        let mut cmd = Command::new("ip");
        cmd.args(&self.argv).args(extra);
        let child = crate::state::inherit_no_descriptors(&mut cmd)
            .stdin(Stdio::null())
            .stdout(logf)
            .stderr(errf)
            .process_group(0)
            .spawn()
            .map_err(|e| Error::internal(format!("cannot start qemu for {}: {e}", self.name)))?;
        self.started = std::time::Instant::now();
        self.pid = child.id();
        self.child = Some(child);
        Ok(())
    }

    /// qemu's pid.
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Connects the command channel and waits until the guest answers on it; the channel and
    /// the time it took.
    ///
    /// # Errors
    /// `INTERNAL` naming the VM, with the tail of its console, when it does not answer within
    /// `timeout` or qemu exited.
    pub fn channel(&self, timeout: Duration) -> Result<(Channel, Duration), Error> {
        let start = std::time::Instant::now();
        let fail = |what: String| {
            Error::internal(format!(
                "guest {}: {what}; console: {}; qemu: {}",
                self.name,
                crate::state::log_tail(&self.console),
                crate::state::log_tail(&self.log)
            ))
        };
        let mut ch = loop {
            match Channel::connect(&self.socket) {
                Ok(c) => break c,
                Err(e) if start.elapsed() > Duration::from_secs(10) => {
                    return Err(fail(format!("command socket: {e}")));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        };
        ch.wait_ready(timeout.saturating_sub(start.elapsed()))
            .map_err(|e| fail(e.to_string()))?;
        Ok((ch, start.elapsed()))
    }
}

impl Vm {
    /// Leaves the guest running after this process ends (the sandbox stays up): it is stopped by
    /// pid when the sandbox goes (`vmnet-lab down --sandbox`, from the state file).
    pub fn detach(mut self) {
        self.child = None;
        self.detached = true;
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        if self.detached {
            return;
        }
        let _ = crate::state::stop(self.pid, &self.marker);
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_file(&self.overlay);
    }
}
