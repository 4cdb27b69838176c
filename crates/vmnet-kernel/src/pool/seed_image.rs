//! The NoCloud seed image: an ISO9660 volume labelled `cidata` holding `meta-data`,
//! `user-data` and, when present, `network-config` (spec: "The guest's network configuration").
//!
//! # Design
//! The files come from [`vmnet_plan::pool::seed::seed`]; they are written into a private temporary
//! directory and packed with Debian's `genisoimage` (`-volid cidata -joliet -rock`), the layout
//! cloud-init's NoCloud datasource finds by label. The image is written to a temporary name
//! next to the target and renamed, so a VMM never sees half an image.
//!
//! # Limitations
//! Needs `genisoimage` on the host (Debian package `genisoimage`).

use std::path::{Path, PathBuf};
use std::process::Command;

use vmnet_plan::pool::seed::Seed;

/// Errors of seed image creation.
#[derive(Debug, thiserror::Error)]
pub enum SeedImageError {
    /// A file operation failed.
    #[error("seed image {path}: {op}")]
    Io {
        /// The path.
        path: PathBuf,
        /// What was attempted.
        op: &'static str,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// genisoimage failed.
    #[error("seed image {path}: genisoimage failed: {stderr}")]
    Tool {
        /// The image path.
        path: PathBuf,
        /// genisoimage's error output.
        stderr: String,
    },
}

/// Writes `seed` as a `cidata` ISO image at `path` (replacing it atomically).
///
/// # Errors
/// [`SeedImageError`] naming the path.
pub fn write_iso(seed: &Seed, path: &Path) -> Result<(), SeedImageError> {
    let io = |op: &'static str| {
        let path = path.to_owned();
        move |source| SeedImageError::Io { path, op, source }
    };
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    let stage = dir.join(format!(
        ".{}.seed-{}",
        path.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        std::process::id()
    ));
    std::fs::create_dir_all(&stage).map_err(io("create staging directory"))?;
    let result = (|| {
        let mut names = Vec::new();
        for (name, contents) in seed.files() {
            std::fs::write(stage.join(name), contents).map_err(io("write seed file"))?;
            names.push(name);
        }
        let tmp = stage.join("seed.iso");
        let out = Command::new("genisoimage")
            .arg("-quiet")
            .arg("-output")
            .arg(&tmp)
            .args(["-volid", "cidata", "-joliet", "-rock"])
            .args(&names)
            .current_dir(&stage)
            .output()
            .map_err(io("run genisoimage"))?;
        if !out.status.success() {
            return Err(SeedImageError::Tool {
                path: path.to_owned(),
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            });
        }
        std::fs::rename(&tmp, path).map_err(io("rename into place"))
    })();
    let _ = std::fs::remove_dir_all(&stage);
    result
}
