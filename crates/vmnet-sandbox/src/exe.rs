//! The programs the lab starts: the product's `vmnet` binary (every agent is a `vmnet serve`)
//! and the lab's own executable (the sandbox's helper processes, `vmnet-lab sandbox-helper …`).
//!
//! The `vmnet` binary is, in order: the path given to [`set_vmnet`] (`vmnet-lab --vmnet PATH`,
//! or its environment variable `VMNET_BIN`), else `vmnet` in the directory of this executable,
//! else in its parent directory (a test binary lives in `target/<profile>/deps/`, the binaries
//! in `target/<profile>/`). The lab never falls back to a `vmnet` on `PATH`: a sandbox checks
//! the build it sits beside, not whatever happens to be installed.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use vmnet_model::Error;

/// The file name of the product binary.
pub const VMNET: &str = "vmnet";

static VMNET_OVERRIDE: OnceLock<PathBuf> = OnceLock::new();

/// Makes [`vmnet`] return `path` for the rest of the process (the first call wins).
pub fn set_vmnet(path: PathBuf) {
    let _ = VMNET_OVERRIDE.set(path);
}

/// This executable (the lab binary, or a test binary).
///
/// # Errors
/// `INTERNAL` when the kernel cannot name it.
pub fn this() -> Result<PathBuf, Error> {
    std::env::current_exe()
        .map_err(|e| Error::internal(format!("cannot find this executable: {e}")))
}

/// The `vmnet` binary to run `serve` from (see the module docs).
///
/// # Errors
/// `UNAVAILABLE` when no `vmnet` is found, naming where it was looked for.
pub fn vmnet() -> Result<PathBuf, Error> {
    if let Some(p) = VMNET_OVERRIDE.get() {
        return if p.is_file() {
            Ok(p.clone())
        } else {
            Err(Error::unavailable(format!(
                "the vmnet binary {} (--vmnet/VMNET_BIN) is not a file",
                p.display()
            )))
        };
    }
    let exe = this()?;
    beside(&exe).ok_or_else(|| {
        Error::unavailable(format!(
            "no vmnet binary beside {} (build it with `cargo build -p vmnet`, or name it with --vmnet PATH or VMNET_BIN)",
            exe.display()
        ))
    })
}

/// `vmnet` in the directory of `exe` or in its parent, whichever exists first.
fn beside(exe: &Path) -> Option<PathBuf> {
    exe.parent()?
        .ancestors()
        .take(2)
        .map(|d| d.join(VMNET))
        .find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vmnet_is_found_beside_the_executable_or_one_level_up() {
        let tmp = tempfile::tempdir().unwrap();
        let deps = tmp.path().join("deps");
        std::fs::create_dir(&deps).unwrap();
        let lab = tmp.path().join("vmnet-lab");
        let test_bin = deps.join("sandbox_up-0123");
        assert_eq!(beside(&lab), None, "nothing there yet");
        std::fs::write(tmp.path().join(VMNET), b"").unwrap();
        assert_eq!(beside(&lab), Some(tmp.path().join(VMNET)));
        assert_eq!(beside(&test_bin), Some(tmp.path().join(VMNET)));
        std::fs::write(deps.join(VMNET), b"").unwrap();
        assert_eq!(beside(&test_bin), Some(deps.join(VMNET)), "own dir first");
        // Two levels up is not looked at.
        let deeper = deps.join("x").join("t");
        std::fs::create_dir(deps.join("x")).unwrap();
        std::fs::remove_file(deps.join(VMNET)).unwrap();
        assert_eq!(
            beside(&deeper),
            None,
            "{} is two levels up",
            tmp.path().display()
        );
    }
}
