//! The guest image: `vmlinuz`, `initrd.img` and `rootfs.raw` in a directory made by
//! `scripts/guest-image.sh` (cached by its inputs; see the script), and the host image of
//! `vmnet-lab package-vm` made by `scripts/guest-image.sh --host`.

use std::path::{Path, PathBuf};
use std::process::Command;

use vmnet_model::Error;

/// A built guest image.
#[derive(Debug, Clone)]
pub struct GuestImage {
    /// The image directory.
    pub dir: PathBuf,
    /// The kernel.
    pub kernel: PathBuf,
    /// The initramfs.
    pub initrd: PathBuf,
    /// The root file system (raw ext4, read-only to guests: each boots from an overlay).
    pub rootfs: PathBuf,
}

impl GuestImage {
    /// The image in `dir`.
    ///
    /// # Errors
    /// `UNAVAILABLE` naming the missing file.
    pub fn at(dir: &Path) -> Result<Self, Error> {
        let img = Self {
            dir: dir.to_owned(),
            kernel: dir.join("vmlinuz"),
            initrd: dir.join("initrd.img"),
            rootfs: dir.join("rootfs.raw"),
        };
        for f in [&img.kernel, &img.initrd, &img.rootfs] {
            if !f.is_file() {
                return Err(Error::unavailable(format!(
                    "guest image: {} is missing",
                    f.display()
                )));
            }
        }
        Ok(img)
    }

    /// The image named by `VMNET_GUEST_IMAGE`, or the one `scripts/guest-image.sh` builds (or
    /// finds in its cache) for the `vmnet-guest` binary next to this executable. The script is
    /// looked for under the current directory and the repository this executable was built in.
    ///
    /// # Errors
    /// `UNAVAILABLE` when there is no script or it fails (its last output lines in the message).
    pub fn find_or_build() -> Result<Self, Error> {
        if let Some(dir) = std::env::var_os("VMNET_GUEST_IMAGE") {
            return Self::at(Path::new(&dir));
        }
        let (script, bin_dir, exe) = script("VMNET_GUEST_IMAGE")?;
        let guest_bin = bin_dir
            .ancestors()
            .take(2)
            .map(|d| d.join("vmnet-guest"))
            .find(|p| p.is_file())
            .ok_or_else(|| {
                // The hint builds the guest agent in this executable's profile.
                let release = bin_dir.ends_with("release");
                Error::unavailable(format!(
                    "no vmnet-guest next to {} (cargo build{} -p vmnet-guest)",
                    exe.display(),
                    if release { " --release" } else { "" }
                ))
            })?;
        build(&script, &guest_bin.into_os_string())
    }

    /// The host image of `vmnet-lab package-vm`: the one `VMNET_HOST_IMAGE` names, or the one
    /// `scripts/guest-image.sh --host` builds (or finds in its cache), the script looked for as
    /// in [`Self::find_or_build`].
    ///
    /// # Errors
    /// `UNAVAILABLE` when there is no script or it fails (its last output lines in the message).
    pub fn find_or_build_host() -> Result<Self, Error> {
        if let Some(dir) = std::env::var_os("VMNET_HOST_IMAGE") {
            return Self::at(Path::new(&dir));
        }
        let (script, _, _) = script("VMNET_HOST_IMAGE")?;
        build(&script, std::ffi::OsStr::new("--host"))
    }
}

/// `scripts/guest-image.sh` under the current directory or the repository this executable was
/// built in; with the executable's directory and path. `env` names the variable that skips it.
fn script(env: &str) -> Result<(PathBuf, PathBuf, PathBuf), Error> {
    let exe = std::env::current_exe()
        .map_err(|e| Error::unavailable(format!("cannot find this executable: {e}")))?;
    let bin_dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    // target/<profile>/vmnet (or target/<profile>/deps/<test>) → the repository.
    let repo_guess = bin_dir
        .ancestors()
        .find(|a| a.join("scripts/guest-image.sh").is_file())
        .map(Path::to_path_buf);
    let script = [PathBuf::from("scripts/guest-image.sh")]
        .into_iter()
        .chain(repo_guess.map(|r| r.join("scripts/guest-image.sh")))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            Error::unavailable(format!(
                "no scripts/guest-image.sh (run from the repository or set {env})"
            ))
        })?;
    Ok((script, bin_dir, exe))
}

/// Runs the image script with `arg`; the image directory it printed last.
fn build(script: &Path, arg: &std::ffi::OsStr) -> Result<GuestImage, Error> {
    let out = Command::new(script)
        .arg(arg)
        .output()
        .map_err(|e| Error::unavailable(format!("{}: {e}", script.display())))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(12).collect();
        return Err(Error::unavailable(format!(
            "{} failed ({}): {}",
            script.display(),
            out.status,
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        )));
    }
    let dir = stdout.lines().last().unwrap_or_default().trim();
    GuestImage::at(Path::new(dir))
}
