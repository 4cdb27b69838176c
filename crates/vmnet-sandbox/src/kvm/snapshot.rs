//! Saving a running guest to a file and restoring it, over QMP ([`super::qmp`]): the way a
//! platform puts a VM to sleep and wakes it. Saving stops the guest's CPUs, migrates its state
//! (`migrate` to `exec:cat > FILE`; qemu 7.2 has no `file:` URI) and quits qemu, which closes
//! the tap. Restoring starts qemu again with the same command line (same tap, MAC and disk
//! overlay) and `-incoming exec:cat FILE`; qemu opens the tap at its start, loads the state
//! and stays paused (the state was saved paused) until `cont`.

use std::ffi::OsString;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::json;
use vmnet_model::Error;

use super::Vm;
use super::qmp::Qmp;

/// A saved guest.
#[derive(Debug, Clone, Copy)]
pub struct Saved {
    /// From `stop` to qemu's exit.
    pub took: Duration,
    /// The state file's size.
    pub bytes: u64,
}

/// A restored guest.
#[derive(Debug, Clone, Copy)]
pub struct Restored {
    /// When qemu was started again.
    pub spawned: Instant,
    /// When the state was loaded (qemu left `inmigrate`).
    pub loaded: Instant,
    /// When `cont` returned: the guest runs.
    pub running: Instant,
}

impl Vm {
    fn fail(&self, what: &str, e: impl std::fmt::Display) -> Error {
        Error::internal(format!(
            "guest {}: {what}: {e}; qemu: {}",
            self.name,
            crate::state::log_tail(&self.log)
        ))
    }

    /// Stops the guest, saves its state to `file` and quits qemu (the tap is left without a
    /// VMM); `timeout` bounds the save.
    ///
    /// # Errors
    /// `INTERNAL` naming the guest and the QMP step that failed, with the tail of its log.
    pub fn save_and_quit(&mut self, file: &Path, timeout: Duration) -> Result<Saved, Error> {
        let path = file.display().to_string();
        if path.contains('\'') {
            return Err(Error::internal(format!("state file {path}: a quote in it")));
        }
        let t = Instant::now();
        let mut q =
            Qmp::connect(&self.qmp, Duration::from_secs(10)).map_err(|e| self.fail("QMP", e))?;
        q.execute("stop", None).map_err(|e| self.fail("stop", e))?;
        // No bandwidth cap for a local file (qemu's default is 128 MiB/s).
        q.execute(
            "migrate-set-parameters",
            Some(json!({ "max-bandwidth": 1_u64 << 40 })),
        )
        .map_err(|e| self.fail("migrate-set-parameters", e))?;
        q.execute(
            "migrate",
            Some(json!({ "uri": format!("exec:cat > '{path}'") })),
        )
        .map_err(|e| self.fail("migrate", e))?;
        let status = q
            .wait_for(
                "query-migrate",
                "status",
                |s| matches!(s, "completed" | "failed" | "cancelled"),
                Duration::from_millis(20),
                timeout,
            )
            .map_err(|e| self.fail("query-migrate", e))?;
        if status != "completed" {
            return Err(self.fail("migrate", format!("status {status}")));
        }
        // qemu may close the socket before it answers `quit`.
        let _ = q.execute("quit", None);
        drop(q);
        let mut child = self.child.take();
        let exited = Instant::now();
        while exited.elapsed() < Duration::from_secs(15) {
            match child.as_mut().map(std::process::Child::try_wait) {
                Some(Ok(None)) => std::thread::sleep(Duration::from_millis(10)),
                _ => break,
            }
        }
        if let Some(mut c) = child
            && matches!(c.try_wait(), Ok(None))
        {
            let _ = crate::state::stop(self.pid, &self.marker);
            let _ = c.wait();
        }
        let bytes = std::fs::metadata(file).map_or(0, |m| m.len());
        Ok(Saved {
            took: t.elapsed(),
            bytes,
        })
    }

    /// Starts qemu again on the same tap, MAC and disk, loading the state [`Self::save_and_quit`]
    /// wrote to `file`, and lets the guest run; `timeout` bounds the load.
    ///
    /// # Errors
    /// `INTERNAL` naming the guest and the step that failed, with the tail of its log.
    pub fn restore(&mut self, file: &Path, timeout: Duration) -> Result<Restored, Error> {
        let path = file.display().to_string();
        if path.contains('\'') {
            return Err(Error::internal(format!("state file {path}: a quote in it")));
        }
        let incoming = [
            OsString::from("-incoming"),
            OsString::from(format!("exec:cat '{path}'")),
        ];
        self.spawn(&incoming, true)?;
        let spawned = Instant::now();
        let mut q =
            Qmp::connect(&self.qmp, Duration::from_secs(30)).map_err(|e| self.fail("QMP", e))?;
        let status = q
            .wait_for(
                "query-status",
                "status",
                |s| s != "inmigrate",
                Duration::from_millis(10),
                timeout,
            )
            .map_err(|e| self.fail("query-status", e))?;
        let loaded = Instant::now();
        match status.as_str() {
            "running" => {}
            "paused" | "postmigrate" | "prelaunch" => {
                q.execute("cont", None).map_err(|e| self.fail("cont", e))?;
            }
            s => return Err(self.fail("load", format!("status {s}"))),
        }
        Ok(Restored {
            spawned,
            loaded,
            running: Instant::now(),
        })
    }
}
