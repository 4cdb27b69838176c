//! Named network namespaces, created and entered without forking.
//!
//! A named netns is a bind mount of a namespace file onto `/run/netns/<name>`, the same layout
//! iproute2 uses, so `ip netns` and `ip -n` see what vmnet made.
//!
//! # Design
//! Linux namespaces are per thread. Every operation that must happen inside a namespace runs on a
//! short-lived dedicated OS thread that calls `setns(2)` (or `unshare(2)`) and exits; no thread of
//! the agent's runtime ever changes namespace, and the multi-threaded agent is never forked.
//! Sockets keep the namespace they were opened in, so [`netlink_in`] opens an rtnetlink socket on
//! such a thread and hands back a handle usable from any task.
//!
//! # Limitations
//! The bind mounts live in the caller's mount namespace: run the agent in the host's mount
//! namespace, not under `ip netns exec` (which makes a private one).

use std::fs::{self, File, OpenOptions};
use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};

use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::sched::{CloneFlags, setns, unshare};

/// Where named namespaces are mounted, as in iproute2.
pub const NETNS_RUN_DIR: &str = "/run/netns";

/// Errors from namespace operations; each names the namespace.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    /// A system call failed.
    #[error("netns {name}: {op} failed")]
    Sys {
        /// The namespace.
        name: String,
        /// What was attempted (`unshare`, `bind mount`, `setns`, …).
        op: &'static str,
        /// The errno.
        #[source]
        source: nix::Error,
    },
    /// A file operation failed.
    #[error("netns {name}: {op} failed")]
    Io {
        /// The namespace.
        name: String,
        /// What was attempted.
        op: &'static str,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The namespace exists already.
    #[error("netns {0} exists already")]
    Exists(String),
    /// The name is empty, too long or contains `/`.
    #[error("netns name {0:?} is not valid")]
    BadName(String),
    /// The helper thread panicked.
    #[error("netns {0}: helper thread panicked")]
    ThreadPanicked(String),
}

fn sys(name: &str, op: &'static str) -> impl FnOnce(nix::Error) -> NetnsError {
    let name = name.to_owned();
    move |source| NetnsError::Sys { name, op, source }
}

fn io(name: &str, op: &'static str) -> impl FnOnce(std::io::Error) -> NetnsError {
    let name = name.to_owned();
    move |source| NetnsError::Io { name, op, source }
}

/// The mount path of a named namespace: `/run/netns/<name>`.
#[must_use]
pub fn path(name: &str) -> PathBuf {
    Path::new(NETNS_RUN_DIR).join(name)
}

fn check_name(name: &str) -> Result<(), NetnsError> {
    if name.is_empty() || name.len() > 200 || name.contains('/') || name == "." || name == ".." {
        return Err(NetnsError::BadName(name.to_owned()));
    }
    Ok(())
}

/// Set once `/run/netns` was made a shared mount point by this process.
static RUN_DIR_READY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes `/run/netns` exist and be a shared mount point, as iproute2 does, so namespaces mounted
/// later propagate into mount namespaces that were copied from this one. Done once per process:
/// the recursive remount walks every namespace mounted there, so repeating it per create would
/// make creating a namespace cost grow with the number of namespaces.
fn ensure_run_dir() -> Result<(), NetnsError> {
    if RUN_DIR_READY.load(std::sync::atomic::Ordering::Acquire) && Path::new(NETNS_RUN_DIR).is_dir()
    {
        return Ok(());
    }
    ensure_run_dir_now()?;
    RUN_DIR_READY.store(true, std::sync::atomic::Ordering::Release);
    Ok(())
}

fn ensure_run_dir_now() -> Result<(), NetnsError> {
    fs::create_dir_all(NETNS_RUN_DIR).map_err(io(NETNS_RUN_DIR, "create run dir"))?;
    let shared = MsFlags::MS_SHARED | MsFlags::MS_REC;
    if mount(
        None::<&str>,
        NETNS_RUN_DIR,
        None::<&str>,
        shared,
        None::<&str>,
    )
    .is_ok()
    {
        return Ok(());
    }
    // Not a mount point yet: bind it onto itself, then make it shared.
    mount(
        Some(NETNS_RUN_DIR),
        NETNS_RUN_DIR,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        None::<&str>,
    )
    .map_err(sys(NETNS_RUN_DIR, "bind mount run dir"))?;
    mount(
        None::<&str>,
        NETNS_RUN_DIR,
        None::<&str>,
        shared,
        None::<&str>,
    )
    .map_err(sys(NETNS_RUN_DIR, "make run dir shared"))
}

/// Creates the named namespace `name` (with its loopback down, as the kernel makes it).
///
/// # Errors
/// [`NetnsError::Exists`] when the name is taken; a system error otherwise, after which nothing
/// is left behind.
pub fn create(name: &str) -> Result<(), NetnsError> {
    create_and_run(name, || ())
}

/// Creates the named namespace `name` like [`create`] and runs `f` inside it on the very thread
/// that created it (one thread hop for "create, then configure inside"). When `f` returns, the
/// namespace stays (it is mounted); sockets `f` opened stay bound to it.
///
/// # Errors
/// As [`create`]; nothing is left behind when creation fails. `f`'s own result is returned as is
/// (the namespace exists then, whatever `f` returned).
pub fn create_and_run<T, F>(name: &str, f: F) -> Result<T, NetnsError>
where
    T: Send,
    F: FnOnce() -> T + Send,
{
    name_and_run(name, None, f)
}

/// Like [`create_and_run`], but the namespace named is `made` when given: one made earlier
/// (by `unshare(2)` on another thread) and held by that descriptor only, not mounted anywhere.
/// Its thread enters it instead of making one.
///
/// # Errors
/// As [`create_and_run`]; a failed `setns` into `made` is a system error and leaves nothing.
pub fn name_and_run<T, F>(name: &str, made: Option<BorrowedFd<'_>>, f: F) -> Result<T, NetnsError>
where
    T: Send,
    F: FnOnce() -> T + Send,
{
    check_name(name)?;
    ensure_run_dir()?;
    remove_stale(name);
    let target = path(name);
    match OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&target)
    {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            return Err(NetnsError::Exists(name.to_owned()));
        }
        Err(e) => return Err(io(name, "create mount point")(e)),
    }
    let result = std::thread::scope(|s| {
        s.spawn(|| {
            match made {
                Some(fd) => setns(fd, CloneFlags::CLONE_NEWNET).map_err(sys(name, "setns"))?,
                None => unshare(CloneFlags::CLONE_NEWNET).map_err(sys(name, "unshare"))?,
            }
            mount(
                Some("/proc/thread-self/ns/net"),
                &target,
                None::<&str>,
                MsFlags::MS_BIND,
                None::<&str>,
            )
            .map_err(sys(name, "bind mount"))?;
            Ok(f())
        })
        .join()
        .unwrap_or_else(|_| Err(NetnsError::ThreadPanicked(name.to_owned())))
    });
    if result.is_err() {
        let _ = umount2(&target, MntFlags::MNT_DETACH);
        let _ = fs::remove_file(&target);
    }
    result
}

/// Deletes the named namespace. The kernel frees it (and its links) once no process or socket
/// holds it. Deleting a namespace that does not exist succeeds.
///
/// # Errors
/// A system error when the mount cannot be detached or the file removed.
pub fn delete(name: &str) -> Result<(), NetnsError> {
    check_name(name)?;
    let target = path(name);
    if !target.exists() {
        return Ok(());
    }
    match umount2(&target, MntFlags::MNT_DETACH) {
        Ok(()) | Err(nix::Error::EINVAL | nix::Error::ENOENT) => {}
        Err(e) => return Err(sys(name, "umount")(e)),
    }
    match fs::remove_file(&target) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io(name, "remove mount point")(e)),
    }
}

/// Whether the named namespace exists: its path is a mounted namespace (nsfs). A plain file
/// left by a process killed between creating the mount point and bind-mounting it does not
/// count (`create` replaces such a file).
#[must_use]
pub fn exists(name: &str) -> bool {
    is_namespace(&path(name))
}

fn is_namespace(p: &Path) -> bool {
    nix::sys::statfs::statfs(p).is_ok_and(|st| st.filesystem_type() == nix::sys::statfs::NSFS_MAGIC)
}

/// Removes the mount point of `name` when it is a stale plain file (no namespace mounted on
/// it), as a crash between creating the file and the bind mount leaves it, so the name can be
/// created again. A live namespace is left alone.
fn remove_stale(name: &str) {
    let target = path(name);
    if target.exists() && !is_namespace(&target) {
        let _ = fs::remove_file(&target);
    }
}

/// The names of the named namespaces that start with `prefix`, sorted.
///
/// # Errors
/// An I/O error reading `/run/netns` (a missing directory is an empty list).
pub fn list(prefix: &str) -> Result<Vec<String>, NetnsError> {
    let entries = match fs::read_dir(NETNS_RUN_DIR) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io(NETNS_RUN_DIR, "read run dir")(e)),
    };
    let mut names: Vec<String> = entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with(prefix))
        .collect();
    names.sort();
    Ok(names)
}

/// Opens the namespace file, for `setns` or for netlink's `IFLA_NET_NS_FD`.
///
/// # Errors
/// An I/O error when the namespace does not exist.
pub fn open(name: &str) -> Result<File, NetnsError> {
    check_name(name)?;
    File::open(path(name)).map_err(io(name, "open"))
}

/// Moves the calling thread into the named namespace. Call it on the main thread before any
/// other thread (e.g. a tokio runtime) starts, so the whole process lives there; elsewhere use
/// [`run_in`].
///
/// # Errors
/// A system error when the namespace does not exist or `setns` fails.
pub fn enter_current_thread(name: &str) -> Result<(), NetnsError> {
    let file = open(name)?;
    setns(file.as_fd(), CloneFlags::CLONE_NEWNET).map_err(sys(name, "setns"))
}

/// Runs `f` on a dedicated thread inside the named namespace and returns its result. The thread
/// exits afterwards, so no other thread ever changes namespace.
///
/// # Errors
/// A system error when the namespace cannot be entered, or [`NetnsError::ThreadPanicked`].
pub fn run_in<T, F>(name: &str, f: F) -> Result<T, NetnsError>
where
    T: Send,
    F: FnOnce() -> T + Send,
{
    let file = open(name)?;
    std::thread::scope(|s| {
        s.spawn(|| {
            setns(file.as_fd(), CloneFlags::CLONE_NEWNET).map_err(sys(name, "setns"))?;
            Ok(f())
        })
        .join()
        .unwrap_or_else(|_| Err(NetnsError::ThreadPanicked(name.to_owned())))
    })
}

/// Opens an rtnetlink connection inside the named namespace and spawns its driver on the current
/// tokio runtime. The returned handle talks to that namespace from any task.
///
/// # Errors
/// A system error when the namespace cannot be entered or the socket cannot be opened.
///
/// # Panics
/// When called outside a tokio runtime.
pub fn netlink_in(name: &str) -> Result<rtnetlink::Handle, NetnsError> {
    let rt = tokio::runtime::Handle::current();
    let opened = run_in(name, || {
        let _guard = rt.enter();
        rtnetlink::new_connection().map(|(conn, handle, _)| {
            rt.spawn(conn);
            handle
        })
    })?;
    opened.map_err(io(name, "open rtnetlink socket"))
}

/// Like [`netlink_in`], but with `NETLINK_GET_STRICT_CHK` set, so dump requests are filtered by
/// the kernel (by table, output interface, link index) instead of returning everything.
///
/// # Errors
/// As [`netlink_in`].
///
/// # Panics
/// When called outside a tokio runtime.
pub fn netlink_in_strict(name: &str) -> Result<rtnetlink::Handle, NetnsError> {
    let rt = tokio::runtime::Handle::current();
    let opened = run_in(name, || {
        let _guard = rt.enter();
        rtnetlink::new_connection_with_strict_check().map(|(conn, handle, _)| {
            rt.spawn(conn);
            handle
        })
    })?;
    opened.map_err(io(name, "open rtnetlink socket"))
}
