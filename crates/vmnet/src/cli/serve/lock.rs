//! One agent per state directory, and one per name prefix in a network namespace: `serve`
//! holds both locks for its whole life and refuses to start when another agent holds either,
//! before it binds its socket or touches the kernel.
//!
//! # Design
//! - Each lock is `flock(LOCK_EX | LOCK_NB)` on a file holding the holder's pid (written once
//!   the lock is taken): `<state dir>/agent.lock`, and `/run/vmnet/agents/net<inode>.<prefix>.lock`
//!   where the inode is the agent's network namespace's (`/proc/thread-self/ns/net`; unique
//!   among the namespaces that exist, however they are named or entered). The kernel releases
//!   a lock when its process ends, however it ends (`kill -9` included); a file left behind
//!   holds no lock and is taken by the next agent.
//! - The descriptors are close-on-exec: the worker, the pool helper and `wireguard-go` (which
//!   outlives the agent) never hold them.
//! - A stopping agent removes its lock files while it still holds them. A starting agent that
//!   locked a file checks that the path still names it (another agent may have removed it in
//!   between) and opens the path again when not, so two agents never hold one name.
//! - `/run/vmnet/agents` is made by root with mode 0755: no other user can make or hold a lock
//!   there and so keep an agent from starting.
//!
//! # Limitations
//! - Two agents given different state directories and different prefixes in one namespace both
//!   run: that is two independent agents, as long as their sockets differ (the socket is
//!   checked too, see [`vmnet_agent::server::bind_unix`]).

use std::fs::{File, OpenOptions};
use std::io::{Read as _, Seek as _, Write as _};
use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};

use vmnet_model::Error;

/// Where the per-namespace prefix locks are.
pub const PREFIX_LOCK_DIR: &str = "/run/vmnet/agents";

/// The name of the state directory's lock file.
pub const STATE_LOCK: &str = "agent.lock";

/// A lock this process holds; the file is removed (still locked) and the lock released when
/// it drops.
#[derive(Debug)]
pub struct Held {
    /// The locked file: closing it releases the lock.
    _file: File,
    path: PathBuf,
}

impl Drop for Held {
    fn drop(&mut self) {
        // Removed while locked; closing the file after this releases the lock.
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Why a lock was not taken.
#[derive(Debug)]
pub enum LockError {
    /// Another process holds it; its pid when the file tells it.
    Held(Option<u32>),
    /// The file cannot be made, opened or locked.
    Io(std::io::Error),
}

/// Takes the lock on `path` (creating the file) without waiting, and writes this process's
/// pid into it.
///
/// # Errors
/// [`LockError::Held`] with the holder's pid, or [`LockError::Io`].
pub fn take(path: &Path) -> Result<Held, LockError> {
    loop {
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .open(path)
            .map_err(LockError::Io)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let mut text = String::new();
                let pid = file
                    .read_to_string(&mut text)
                    .ok()
                    .and_then(|_| text.trim().parse().ok());
                return Err(LockError::Held(pid));
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(LockError::Io(e)),
        }
        // The holder before may have removed the file after this one opened it: the lock is
        // on a file nobody else finds. Open the path again then.
        let here = file.metadata().map_err(LockError::Io)?;
        match std::fs::metadata(path) {
            Ok(m) if m.dev() == here.dev() && m.ino() == here.ino() => {}
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(LockError::Io(e)),
        }
        file.set_len(0).map_err(LockError::Io)?;
        file.rewind().map_err(LockError::Io)?;
        writeln!(file, "{}", std::process::id()).map_err(LockError::Io)?;
        return Ok(Held {
            _file: file,
            path: path.to_owned(),
        });
    }
}

/// The holder, for a message: `the agent with pid N` or `another agent`.
fn holder(pid: Option<u32>) -> String {
    pid.map_or_else(
        || "another agent (its pid is not known yet)".to_owned(),
        |p| format!("the agent with pid {p}"),
    )
}

/// Takes the state directory's lock (making the directory when missing).
///
/// # Errors
/// `CONFLICT` naming the directory and the holder's pid when another agent runs on it;
/// `UNAVAILABLE` when the lock file cannot be had.
pub fn state_dir(dir: &Path) -> Result<Held, Error> {
    let shown = dir.display();
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::unavailable(format!("--state-dir {shown}: cannot create it: {e}")))?;
    let path = dir.join(STATE_LOCK);
    take(&path).map_err(|e| match e {
        LockError::Held(pid) => Error::conflict(format!(
            "--state-dir {shown}: {} runs on this state directory (lock {}); stop it first, or give this one another --state-dir",
            holder(pid),
            path.display()
        )),
        LockError::Io(e) => Error::unavailable(format!(
            "--state-dir {shown}: cannot lock {}: {e}",
            path.display()
        )),
    })
}

/// The identity of the calling thread's network namespace (its inode) and how to name it.
fn this_netns(netns: Option<&str>) -> Result<(u64, String), Error> {
    let ino = std::fs::metadata("/proc/thread-self/ns/net")
        .map_err(|e| {
            Error::unavailable(format!(
                "--name-prefix: cannot identify the network namespace: {e}"
            ))
        })?
        .ino();
    let shown = match netns {
        Some(n) => format!("network namespace {n} (net:[{ino}])"),
        None => format!("the agent's network namespace (net:[{ino}])"),
    };
    Ok((ino, shown))
}

/// Takes the lock of name prefix `prefix` in the calling thread's network namespace (named
/// `netns` in messages, when given), under `dir` ([`PREFIX_LOCK_DIR`] for the agent).
///
/// # Errors
/// `CONFLICT` naming the prefix, the namespace and the holder's pid when another agent uses
/// the prefix there; `UNAVAILABLE` when the lock file cannot be had.
pub fn prefix(dir: &Path, prefix: &str, netns: Option<&str>) -> Result<Held, Error> {
    let (ino, shown) = this_netns(netns)?;
    let unavailable = |e: std::io::Error, what: &Path| {
        Error::unavailable(format!(
            "--name-prefix {prefix}: cannot lock {}: {e}",
            what.display()
        ))
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir)
        .map_err(|e| unavailable(e, dir))?;
    let path = dir.join(format!("net{ino}.{prefix}.lock"));
    take(&path).map_err(|e| match e {
        LockError::Held(pid) => Error::conflict(format!(
            "--name-prefix {prefix}: {} uses this prefix in {shown} (lock {}): both would fight over the same kernel objects; stop it first, or give this one another --name-prefix",
            holder(pid),
            path.display()
        )),
        LockError::Io(e) => unavailable(e, &path),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmnet_model::ErrorCode;

    #[test]
    fn a_second_holder_is_refused_with_the_first_ones_pid() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("state");
        let first = state_dir(&dir).unwrap();
        let pid = std::fs::read_to_string(dir.join(STATE_LOCK)).unwrap();
        assert_eq!(pid.trim(), std::process::id().to_string());
        // A second open file description is refused as another process would be.
        let e = state_dir(&dir).unwrap_err();
        assert_eq!(e.code, ErrorCode::Conflict);
        assert!(
            e.message
                .contains(&format!("--state-dir {}", dir.display()))
                && e.message
                    .contains(&format!("the agent with pid {}", std::process::id())),
            "{e}"
        );
        drop(first);
        assert!(!dir.join(STATE_LOCK).exists(), "removed on drop");
        let again = state_dir(&dir).expect("free again");
        drop(again);
    }

    #[test]
    fn a_file_left_by_a_killed_holder_is_taken() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join(STATE_LOCK), "999999\n").unwrap();
        let held = state_dir(tmp.path()).expect("an unlocked file is free");
        let pid = std::fs::read_to_string(tmp.path().join(STATE_LOCK)).unwrap();
        assert_eq!(pid, format!("{}\n", std::process::id()));
        drop(held);
    }

    #[test]
    fn a_prefix_is_held_per_network_namespace() {
        let tmp = tempfile::tempdir().unwrap();
        let a = prefix(tmp.path(), "vmn", Some("h1host")).unwrap();
        let e = prefix(tmp.path(), "vmn", Some("h1host")).unwrap_err();
        assert_eq!(e.code, ErrorCode::Conflict);
        assert!(
            e.message.contains("--name-prefix vmn: the agent with pid")
                && e.message.contains("in network namespace h1host (net:["),
            "{e}"
        );
        let other = prefix(tmp.path(), "vmo", None).expect("another prefix is free");
        drop((a, other));
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
    }
}
