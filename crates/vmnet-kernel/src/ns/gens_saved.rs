//! The table records an agent hands to the next one ([`super::gens`]): a file the stopping
//! agent writes and the starting agent takes (reads and removes) before its first pass.
//!
//! # Design
//! - The file is JSON: the host's boot id and, per VM netns, its cookie, the generation at which
//!   a listing showed its table as planned and the plan's fingerprints. A record proves nothing
//!   by itself: the next agent uses it only for a netns that still has that cookie and that
//!   generation (see [`super::gens::NftGens::resume_here`]), so an old or stale file costs a
//!   listing, never a wrong skip. The boot id keeps a file from before a reboot (when cookies
//!   start again) from being read at all.
//! - Written to a file beside it with mode 0600 (never through a symbolic link) and renamed
//!   over it, so a reader sees the whole file or none; read once and removed, at most
//!   [`MAX_BYTES`].
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
/// Creating, writing or renaming the file failing.
pub fn write(path: &Path, tables: &SavedTables) -> io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".new");
    let tmp = std::path::PathBuf::from(tmp);
    let bytes = serde_json::to_vec(tables).map_err(io::Error::other)?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)?;
    f.write_all(&bytes)?;
    drop(f);
    std::fs::rename(&tmp, path)
}

/// Reads `path` and removes it. `None` when there is no file.
///
/// # Errors
/// A file that cannot be read, is larger than [`MAX_BYTES`] or does not parse (it is removed
/// all the same).
pub fn take(path: &Path) -> io::Result<Option<SavedTables>> {
    let f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut bytes = Vec::new();
    let read = f.take(MAX_BYTES + 1).read_to_end(&mut bytes);
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
