//! The table records an agent hands to the next one ([`super::gens`]): a file the stopping
//! agent writes and the starting agent takes (reads and removes) before its first pass.
//!
//! # Design
//! - The file is JSON: the host's boot id and, per VM netns, its cookie, the generation at which
//!   a listing showed its table as planned and the plan's fingerprints. The next agent uses a
//!   record only for a netns that still has that cookie and that generation (see
//!   [`super::gens::NftGens::resume_here`]). The boot id keeps a file from before a reboot
//!   (when cookies start again) from being read at all. Records taken but not yet used when an
//!   agent stops (it stopped before its first pass reached their VMs) are saved again.
//! - Written to a new file beside it (mode 0600, never through a symbolic link or into a file
//!   left there) and renamed over it, so a reader sees the whole file or none; read once and
//!   removed, at most [`MAX_BYTES`], and only a regular file (a link, a pipe or a device is
//!   refused, never followed or waited on).
//! - The file is the agent's own state, trusted as its store is: whoever can write the state
//!   directory (root) can also change the stored configs. A record written by hand for a
//!   netns's current generation makes the agent take an edited table as checked until the
//!   next commit in that netns; an old or stale file from an earlier agent costs a listing,
//!   never a wrong skip.
//!
//! # Limitations
//! An agent that is killed saves nothing: its successor lists every table once.

use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::driver::NetlinkNsDriver;

/// The largest file taken: about 200 bytes per VM netns, 65,536 VMs, with room to spare.
pub const MAX_BYTES: u64 = 32 << 20;

/// Where the boot id is read.
const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

/// One VM netns's record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedTable {
    /// The netns name.
    pub netns: String,
    /// Its cookie (`SO_NETNS_COOKIE`).
    pub cookie: u64,
    /// The nf_tables generation at which its table was found as planned.
    pub generation: u32,
    /// The plan's fingerprint.
    pub fingerprint: String,
    /// The plan's shape fingerprint.
    pub shape: String,
}

/// The file's content.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedTables {
    /// The boot the cookies belong to.
    pub boot_id: String,
    /// The records.
    pub tables: Vec<SavedTable>,
}

fn boot_id() -> io::Result<String> {
    Ok(std::fs::read_to_string(BOOT_ID)?.trim().to_owned())
}

/// Writes `tables` to `path` (see the module docs).
///
/// # Errors
/// Creating, writing or renaming the file failing (the file beside it is removed).
pub fn write(path: &Path, tables: &SavedTables) -> io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".new");
    let tmp = std::path::PathBuf::from(tmp);
    let bytes = serde_json::to_vec(tables).map_err(io::Error::other)?;
    // A file left there (by a failed write, or put there) is never reused: its mode and owner
    // would be kept.
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)
        .and_then(|mut f| f.write_all(&bytes))
        .and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Reads `path` and removes it. `None` when there is no file.
///
/// # Errors
/// Anything but a regular file (a symbolic link, a pipe, a directory: never followed or waited
/// on), a file that cannot be read, is larger than [`MAX_BYTES`] or does not parse (a file is
/// removed all the same).
pub fn take(path: &Path) -> io::Result<Option<SavedTables>> {
    let f = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            let _ = std::fs::remove_file(path);
            if e.raw_os_error() == Some(libc::ELOOP) {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "a symbolic link, not followed",
                ));
            }
            return Err(e);
        }
    };
    let regular = f.metadata().map(|m| m.file_type().is_file());
    let mut bytes = Vec::new();
    let read = match regular {
        Ok(true) => f.take(MAX_BYTES + 1).read_to_end(&mut bytes).map(drop),
        Ok(false) => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a regular file",
        )),
        Err(e) => Err(e),
    };
    let _ = std::fs::remove_file(path);
    read?;
    parse(&bytes).map(Some)
}

fn parse(bytes: &[u8]) -> io::Result<SavedTables> {
    if bytes.len() as u64 > MAX_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("larger than {MAX_BYTES} bytes"),
        ));
    }
    serde_json::from_slice(bytes).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// The records of `saved` that belong to the boot `now` (all or none).
fn of_boot(saved: SavedTables, now: &str) -> Option<Vec<SavedTable>> {
    (saved.boot_id == now).then_some(saved.tables)
}

impl NetlinkNsDriver {
    /// Saves the records of the tables found as planned to `path`, for the next agent; returns
    /// how many. Call it when the agent stops, after its last change.
    ///
    /// # Errors
    /// The boot id unreadable or the file not written.
    pub fn save_table_records(&self, path: &Path) -> io::Result<usize> {
        let tables = self.nft_gens.to_save();
        let n = tables.len();
        write(
            path,
            &SavedTables {
                boot_id: boot_id()?,
                tables,
            },
        )?;
        Ok(n)
    }

    /// Takes the records an earlier agent of this boot saved to `path` (the file is removed);
    /// returns how many were taken (0 without a file or after a reboot). Call it before the
    /// first pass.
    ///
    /// # Errors
    /// The file unreadable or malformed, or the boot id unreadable: nothing is taken and every
    /// table is listed once.
    pub fn restore_table_records(&self, path: &Path) -> io::Result<usize> {
        let Some(saved) = take(path)? else {
            return Ok(0);
        };
        let Some(tables) = of_boot(saved, &boot_id()?) else {
            return Ok(0);
        };
        let n = tables.len();
        self.nft_gens.restore(tables);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn sample() -> SavedTables {
        SavedTables {
            boot_id: "b1".into(),
            tables: vec![SavedTable {
                netns: "vmnn00001".into(),
                cookie: 4099,
                generation: 17,
                fingerprint: "ab12".into(),
                shape: "cd34".into(),
            }],
        }
    }

    #[test]
    fn a_written_file_is_taken_once_and_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tables.json");
        write(&path, &sample()).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
            0o600
        );
        assert_eq!(take(&path).unwrap(), Some(sample()));
        assert!(!path.exists(), "taken means removed");
        assert_eq!(take(&path).unwrap(), None);
    }

    #[test]
    fn a_pipe_or_a_link_is_refused_at_once_and_a_left_file_is_not_reused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tables.json");
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        assert_eq!(take(&path).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert!(!path.exists());
        let target = dir.path().join("elsewhere");
        std::fs::write(&target, b"{}").unwrap();
        std::os::unix::fs::symlink(&target, &path).unwrap();
        let e = take(&path).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
        assert!(e.to_string().contains("symbolic link"), "{e}");
        assert!(target.exists(), "its target is left alone");
        // A file left beside it, open to all, is replaced, not written into.
        let left = dir.path().join("tables.json.new");
        std::fs::write(&left, b"junk").unwrap();
        std::fs::set_permissions(&left, std::fs::Permissions::from_mode(0o666)).unwrap();
        write(&path, &sample()).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(!left.exists());
        assert_eq!(take(&path).unwrap(), Some(sample()));
    }

    #[test]
    fn records_of_another_boot_are_not_used() {
        assert_eq!(of_boot(sample(), "b2"), None);
        assert_eq!(of_boot(sample(), "b1"), Some(sample().tables));
    }

    #[test]
    fn a_malformed_or_oversized_file_is_refused_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tables.json");
        std::fs::write(&path, br#"{"boot_id":"b1","tables":[],"extra":1}"#).unwrap();
        assert_eq!(take(&path).unwrap_err().kind(), io::ErrorKind::InvalidData);
        assert!(!path.exists());
        let big = vec![b' '; usize::try_from(MAX_BYTES).unwrap() + 1];
        assert!(parse(&big).is_err());
    }
}
