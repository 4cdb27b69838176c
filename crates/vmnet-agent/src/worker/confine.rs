//! The worker's confinement, applied by the worker process to itself on its single thread,
//! before its runtime starts and before it reads a byte from the agent:
//!
//! 1. every descriptor but stdin, stdout, stderr and its socket is closed;
//! 2. it becomes the worker user: no supplementary groups, real, effective and saved gid and
//!    uid the user's; the capability bounding set and the ambient set are emptied first, so no
//!    capability is left in any set (`CapEff`, `CapPrm`, `CapBnd` 0), and the process is not
//!    dumpable;
//! 3. `no_new_privs` is set and a seccomp filter installed ([`filter`]): the system calls a tokio
//!    runtime, sockets, name resolution and reading files need, with arguments pinned where it
//!    matters (`socket` families, `clone` only for threads, `openat` read-only, `ioctl` only to
//!    set non-blocking or close-on-exec); any other call kills the process (`SIGSYS`).
//!
//! The user is `vmnet serve --worker-user` (default [`DEFAULT_USER`]), an unprivileged user of
//! its own: never root, never gid 0.

use std::os::fd::RawFd;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// The worker user of an agent started without `--worker-user`.
pub const DEFAULT_USER: &str = "vmnet-worker";

/// The unprivileged user the worker runs as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerUser {
    /// The name (or the number, when given as `UID:GID`).
    pub name: String,
    /// Its uid (never 0).
    pub uid: u32,
    /// Its gid (never 0).
    pub gid: u32,
}

impl WorkerUser {
    /// Resolves `--worker-user`: a user name (its uid and primary gid from the user database)
    /// or `UID:GID`.
    ///
    /// # Errors
    /// A message naming the flag: no such user, or root's uid or gid.
    pub fn lookup(spec: &str) -> Result<Self, String> {
        let u = if let Some((u, g)) = spec.split_once(':') {
            let n = |s: &str| {
                s.parse::<u32>()
                    .map_err(|_| format!("--worker-user {spec}: expected NAME or UID:GID"))
            };
            Self {
                name: spec.to_owned(),
                uid: n(u)?,
                gid: n(g)?,
            }
        } else {
            match nix::unistd::User::from_name(spec) {
                Ok(Some(u)) => Self {
                    name: spec.to_owned(),
                    uid: u.uid.as_raw(),
                    gid: u.gid.as_raw(),
                },
                Ok(None) => {
                    return Err(format!(
                        "--worker-user {spec}: no such user; create it (scripts/install-deps.sh does: \
                         useradd --system --no-create-home --shell /usr/sbin/nologin {DEFAULT_USER}) \
                         or name another unprivileged user of its own"
                    ));
                }
                Err(e) => return Err(format!("--worker-user {spec}: user lookup failed: {e}")),
            }
        };
        if u.uid == 0 || u.gid == 0 {
            return Err(format!(
                "--worker-user {spec}: uid {} gid {}: the worker must not run as root or with group 0",
                u.uid, u.gid
            ));
        }
        Ok(u)
    }

    /// `UID:GID`, as the worker process takes it.
    #[must_use]
    pub fn ids(&self) -> String {
        format!("{}:{}", self.uid, self.gid)
    }
}

/// Closes every descriptor above `keep` (stdin, stdout, stderr and the worker's socket stay).
///
/// # Errors
/// The system call's error.
pub fn close_above(keep: RawFd) -> Result<(), String> {
    let first = u32::try_from(keep + 1).map_err(|e| e.to_string())?;
    // SAFETY: close_range closes descriptors of this process only; no Rust object owns a
    // descriptor above `keep` at this point (called first thing in the worker's main).
    let rc = unsafe { libc::syscall(libc::SYS_close_range, first, u32::MAX, 0u32) };
    if rc == 0 {
        Ok(())
    } else {
        Err(format!("close_range: {}", std::io::Error::last_os_error()))
    }
}

fn prctl(what: &str, op: libc::c_int, arg: libc::c_ulong) -> Result<libc::c_int, String> {
    // SAFETY: the prctl options used here (PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_SET_DUMPABLE,
    // PR_SET_NO_NEW_PRIVS) take integers only and touch no memory of this process.
    let rc = unsafe {
        libc::prctl(
            op,
            arg,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    if rc < 0 {
        Err(format!("{what}: {}", std::io::Error::last_os_error()))
    } else {
        Ok(rc)
    }
}

/// Becomes `user` with no capability left (see the module docs). Call on the only thread.
///
/// # Errors
/// A message naming the step that failed.
pub fn drop_privileges(user: &WorkerUser) -> Result<(), String> {
    use nix::unistd::{Gid, Uid, setgroups, setresgid, setresuid};
    if user.uid == 0 || user.gid == 0 {
        return Err("the worker must not run as root".into());
    }
    // Empty the bounding set while CAP_SETPCAP is still held (until EINVAL: past the last cap).
    for cap in 0u32..=63 {
        // SAFETY: as in `prctl`; PR_CAPBSET_READ takes an integer only.
        let known = unsafe {
            libc::prctl(
                libc::PR_CAPBSET_READ,
                libc::c_ulong::from(cap),
                0 as libc::c_ulong,
                0 as libc::c_ulong,
                0 as libc::c_ulong,
            )
        };
        if known < 0 {
            break;
        }
        prctl(
            "drop the bounding set",
            libc::PR_CAPBSET_DROP,
            libc::c_ulong::from(cap),
        )?;
    }
    prctl(
        "clear the ambient capabilities",
        libc::PR_CAP_AMBIENT,
        libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
    )?;
    setgroups(&[]).map_err(|e| format!("setgroups: {e}"))?;
    let g = Gid::from_raw(user.gid);
    setresgid(g, g, g).map_err(|e| format!("setresgid {}: {e}", user.gid))?;
    let u = Uid::from_raw(user.uid);
    setresuid(u, u, u).map_err(|e| format!("setresuid {}: {e}", user.uid))?;
    prctl("not dumpable", libc::PR_SET_DUMPABLE, 0)?;
    // Check, from the kernel's own account, that nothing is left.
    let status = std::fs::read_to_string("/proc/self/status")
        .map_err(|e| format!("/proc/self/status: {e}"))?;
    for key in ["CapInh:", "CapPrm:", "CapEff:", "CapBnd:", "CapAmb:"] {
        let v = status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .map(str::trim)
            .ok_or_else(|| format!("/proc/self/status has no {key}"))?;
        if u64::from_str_radix(v, 16) != Ok(0) {
            return Err(format!("{key} {v} after dropping every capability"));
        }
    }
    if nix::unistd::getuid().is_root() || nix::unistd::geteuid().is_root() {
        return Err("still root after setresuid".into());
    }
    Ok(())
}

/// A rule comparing argument `arg` with `value` by `op`.
fn cond(arg: u8, op: SeccompCmpOp, value: u64) -> Result<SeccompCondition, String> {
    SeccompCondition::new(arg, SeccompCmpArgLen::Dword, op, value).map_err(|e| e.to_string())
}

fn rule(conds: Vec<SeccompCondition>) -> Result<SeccompRule, String> {
    SeccompRule::new(conds).map_err(|e| e.to_string())
}

fn num(v: libc::c_int) -> u64 {
    u64::try_from(v).unwrap_or(u64::MAX)
}

/// The system calls the worker may make without conditions.
fn plain_calls() -> Vec<libc::c_long> {
    let mut v = vec![
        // Memory, threads, signals, time.
        libc::SYS_brk,
        libc::SYS_mmap,
        libc::SYS_munmap,
        libc::SYS_mremap,
        libc::SYS_mprotect,
        libc::SYS_madvise,
        libc::SYS_futex,
        libc::SYS_set_robust_list,
        libc::SYS_rseq,
        libc::SYS_sched_yield,
        libc::SYS_sched_getaffinity,
        libc::SYS_rt_sigaction,
        libc::SYS_rt_sigprocmask,
        libc::SYS_rt_sigreturn,
        libc::SYS_sigaltstack,
        libc::SYS_getrandom,
        libc::SYS_clock_gettime,
        libc::SYS_clock_getres,
        libc::SYS_gettimeofday,
        libc::SYS_clock_nanosleep,
        libc::SYS_nanosleep,
        libc::SYS_getpid,
        libc::SYS_gettid,
        libc::SYS_tgkill,
        libc::SYS_exit,
        libc::SYS_exit_group,
        libc::SYS_restart_syscall,
        libc::SYS_membarrier,
        libc::SYS_uname,
        libc::SYS_getuid,
        libc::SYS_geteuid,
        libc::SYS_getgid,
        libc::SYS_getegid,
        libc::SYS_prlimit64,
        // The runtime's event loop.
        libc::SYS_epoll_create1,
        libc::SYS_epoll_ctl,
        libc::SYS_epoll_pwait,
        libc::SYS_epoll_pwait2,
        libc::SYS_eventfd2,
        libc::SYS_pipe2,
        libc::SYS_ppoll,
        // Descriptors and files (read-only opens: see `openat` below).
        libc::SYS_read,
        libc::SYS_readv,
        libc::SYS_pread64,
        libc::SYS_write,
        libc::SYS_writev,
        libc::SYS_close,
        libc::SYS_fcntl,
        libc::SYS_fstat,
        libc::SYS_newfstatat,
        libc::SYS_statx,
        libc::SYS_lseek,
        libc::SYS_faccessat,
        libc::SYS_faccessat2,
        libc::SYS_getdents64,
        // Sockets (creation: see `socket` below).
        libc::SYS_accept4,
        libc::SYS_connect,
        libc::SYS_recvfrom,
        libc::SYS_recvmsg,
        libc::SYS_recvmmsg,
        libc::SYS_sendto,
        libc::SYS_sendmsg,
        libc::SYS_sendmmsg,
        libc::SYS_shutdown,
        libc::SYS_setsockopt,
        libc::SYS_getsockopt,
        libc::SYS_getsockname,
        libc::SYS_getpeername,
        // Threads: `clone3` takes its flags in memory a filter cannot read; a second filter
        // answers it ENOSYS, and the C library falls back to `clone` (checked below).
        libc::SYS_clone3,
    ];
    #[cfg(target_arch = "x86_64")]
    v.extend([
        libc::SYS_epoll_wait,
        libc::SYS_poll,
        libc::SYS_access,
        libc::SYS_stat,
        libc::SYS_lstat,
        libc::SYS_arch_prctl,
    ]);
    v
}

fn arch() -> Result<TargetArch, String> {
    if cfg!(target_arch = "x86_64") {
        Ok(TargetArch::x86_64)
    } else if cfg!(target_arch = "aarch64") {
        Ok(TargetArch::aarch64)
    } else {
        Err("seccomp: this architecture has no worker filter".into())
    }
}

/// The worker's filters, in the order they are installed: the one that answers `clone3` with
/// `ENOSYS`, then the allow-list (anything else kills the process; it also forbids installing
/// another filter, so it comes last).
///
/// # Errors
/// When a filter does not compile (a bug).
pub fn filter() -> Result<Vec<BpfProgram>, String> {
    use std::collections::BTreeMap;
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for c in plain_calls() {
        rules.insert(c, Vec::new());
    }
    // socket: IPv4, IPv6 (the providers' APIs, name servers), unix (name service caches) and
    // routing netlink (the C resolver asks for the host's addresses); nothing else (no packet
    // sockets, no other netlink families).
    let mut socket = Vec::new();
    for family in [libc::AF_INET, libc::AF_INET6, libc::AF_UNIX] {
        socket.push(rule(vec![cond(0, SeccompCmpOp::Eq, num(family))?])?);
    }
    socket.push(rule(vec![
        cond(0, SeccompCmpOp::Eq, num(libc::AF_NETLINK))?,
        cond(2, SeccompCmpOp::Eq, num(libc::NETLINK_ROUTE))?,
    ])?);
    rules.insert(libc::SYS_socket, socket);
    // socketpair: unix only (the runtime's signal driver makes one at start).
    rules.insert(
        libc::SYS_socketpair,
        vec![rule(vec![cond(0, SeccompCmpOp::Eq, num(libc::AF_UNIX))?])?],
    );
    // clone: threads only (never a new process).
    let thread = u64::try_from(libc::CLONE_THREAD).map_err(|e| e.to_string())?;
    rules.insert(
        libc::SYS_clone,
        vec![rule(vec![cond(
            0,
            SeccompCmpOp::MaskedEq(thread),
            thread,
        )?])?],
    );
    // openat: read-only.
    let accmode = num(libc::O_ACCMODE);
    rules.insert(
        libc::SYS_openat,
        vec![rule(vec![cond(
            2,
            SeccompCmpOp::MaskedEq(accmode),
            num(libc::O_RDONLY),
        )?])?],
    );
    #[cfg(target_arch = "x86_64")]
    rules.insert(
        libc::SYS_open,
        vec![rule(vec![cond(
            1,
            SeccompCmpOp::MaskedEq(accmode),
            num(libc::O_RDONLY),
        )?])?],
    );
    // ioctl: non-blocking and close-on-exec switches only.
    let ioctls = [libc::FIONBIO, libc::FIOCLEX, libc::FIONCLEX]
        .into_iter()
        .map(|r| {
            let v = u32::try_from(r).map_err(|e| e.to_string())?;
            rule(vec![cond(1, SeccompCmpOp::Eq, u64::from(v))?])
        })
        .collect::<Result<Vec<_>, _>>()?;
    rules.insert(libc::SYS_ioctl, ioctls);
    // prctl: naming threads only.
    rules.insert(
        libc::SYS_prctl,
        vec![rule(vec![cond(
            0,
            SeccompCmpOp::Eq,
            num(libc::PR_SET_NAME),
        )?])?],
    );
    let arch = arch()?;
    let allow = SeccompFilter::new(
        rules,
        SeccompAction::KillProcess,
        SeccompAction::Allow,
        arch,
    )
    .map_err(|e| e.to_string())?;
    let mut clone3 = BTreeMap::new();
    clone3.insert(libc::SYS_clone3, Vec::new());
    let enosys = u32::try_from(libc::ENOSYS).map_err(|e| e.to_string())?;
    let no_clone3 = SeccompFilter::new(
        clone3,
        SeccompAction::Allow,
        SeccompAction::Errno(enosys),
        arch,
    )
    .map_err(|e| e.to_string())?;
    let a: BpfProgram = allow
        .try_into()
        .map_err(|e: seccompiler::BackendError| e.to_string())?;
    let b: BpfProgram = no_clone3
        .try_into()
        .map_err(|e: seccompiler::BackendError| e.to_string())?;
    Ok(vec![b, a])
}

/// Installs [`filter`] (and `no_new_privs`) for this thread and every thread it starts later.
/// Call on the only thread.
///
/// # Errors
/// When a filter does not compile or the kernel refuses it.
pub fn install_seccomp() -> Result<(), String> {
    for prog in filter()? {
        seccompiler::apply_filter(&prog).map_err(|e| format!("seccomp: {e}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_filters_compile() {
        let f = filter().unwrap();
        assert_eq!(f.len(), 2);
        assert!(f[1].len() > 50, "the allow-list comes last");
    }

    #[test]
    fn root_is_never_the_worker_user() {
        assert!(
            WorkerUser::lookup("0:5")
                .unwrap_err()
                .contains("must not run as root")
        );
        assert!(WorkerUser::lookup("5:0").is_err());
        assert!(WorkerUser::lookup("root").is_err());
        assert_eq!(
            WorkerUser::lookup("4242:4343").unwrap(),
            WorkerUser {
                name: "4242:4343".into(),
                uid: 4242,
                gid: 4343
            }
        );
        assert!(WorkerUser::lookup("a:b").is_err());
        let e = WorkerUser::lookup("surely-no-such-user-vmnet").unwrap_err();
        assert!(e.contains("no such user"), "{e}");
    }
}
