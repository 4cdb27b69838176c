//! What one agent hands to the next on the same state directory: the records of the VM tables
//! it found as planned ([`NetlinkNsDriver::save_table_records`]), so a restart or an upgrade
//! does not list every table again. Best effort both ways: without the file the next agent
//! lists each table once.

use std::path::{Path, PathBuf};

use vmnet_kernel::ns::NetlinkNsDriver;

/// The file, in the state directory.
const FILE: &str = "nft-tables.json";

fn file(state_dir: &Path) -> PathBuf {
    state_dir.join(FILE)
}

/// Takes the records of the agent before this one, before the first pass.
pub(super) fn take(driver: &NetlinkNsDriver, state_dir: &Path) {
    match driver.restore_table_records(&file(state_dir)) {
        Ok(n) => tracing::info!(tables = n, "table records of the previous agent taken"),
        Err(e) => tracing::warn!(
            file = %file(state_dir).display(),
            "table records of the previous agent not used: {e}; every table is listed once"
        ),
    }
}

/// Saves this agent's records for the next one, after the last change.
pub(super) fn save(driver: &NetlinkNsDriver, state_dir: &Path) {
    match driver.save_table_records(&file(state_dir)) {
        Ok(n) => tracing::info!(tables = n, "table records saved for the next agent"),
        Err(e) => tracing::warn!(
            file = %file(state_dir).display(),
            "saving the table records failed: {e}; the next agent lists every table once"
        ),
    }
}
