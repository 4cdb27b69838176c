//! Synchronous work done on a thread inside a namespace: the persistent tap, sysctls and
//! the `nft` transaction. Call these only from a thread that entered the target namespace
//! ([`crate::netns::run_in`] / [`crate::netns::create_and_run`]): `/dev/net/tun` creates the tap in
//! the caller's namespace, `/proc/sys/net` opened from a thread shows that thread's namespace,
//! and a child process inherits the namespace of the thread that spawned it.

use std::ffi::c_short;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::{Command, Stdio};

use nix::fcntl::{OFlag, openat};
use nix::sys::stat::Mode;
use vmnet_plan::ns::TapPlan;

use crate::pool::libnft::{LibNft, LibNftError};
use crate::tap::TapOwner;

use super::NsError;

/// Creates the persistent tap `plan.name` in the calling thread's namespace with its owner and
/// group ([`crate::tap::create_persistent`]); an existing tap of that name is attached and
/// updated instead (idempotent).
pub(super) fn create_tap(plan: &TapPlan) -> Result<(), NsError> {
    let owner = TapOwner {
        uid: plan.owner_uid,
        gid: plan.owner_gid,
    };
    crate::tap::create_persistent(&plan.name, owner).map_err(|e| NsError::Tap {
        name: plan.name.clone(),
        op: e.op,
        source: e.source,
    })
}

/// Sets link `name` up (and its MTU when given) in the calling thread's namespace with ioctls
/// on a datagram socket, and returns its ifindex. Cheaper than netlink for a link just created
/// on this thread (no socket round trip through the runtime).
pub(super) fn link_up(name: &str, mtu: Option<u32>) -> std::io::Result<u32> {
    // SAFETY: plain socket(2) call; the result is checked.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor we own; OwnedFd closes it.
    let sock = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    // SAFETY: `ifreq` is plain old data; all-zero bytes are a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req
        .ifr_name
        .iter_mut()
        .zip(name.bytes().take(libc::IFNAMSIZ - 1))
    {
        *dst = src.cast_signed();
    }
    let call = |req: &mut libc::ifreq, op: libc::Ioctl| {
        // SAFETY: `sock` is an open socket and `req` a valid ifreq for these interface ioctls.
        if unsafe { libc::ioctl(sock.as_raw_fd(), op, std::ptr::from_mut(req)) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    };
    call(&mut req, libc::SIOCGIFINDEX)?;
    // SAFETY: SIOCGIFINDEX filled the ifindex member of the union.
    let index = unsafe { req.ifr_ifru.ifru_ifindex };
    if let Some(mtu) = mtu {
        req.ifr_ifru.ifru_mtu = i32::try_from(mtu)
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        call(&mut req, libc::SIOCSIFMTU)?;
    }
    call(&mut req, libc::SIOCGIFFLAGS)?;
    // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
    let flags = unsafe { req.ifr_ifru.ifru_flags };
    #[allow(clippy::cast_possible_truncation)]
    let up = libc::IFF_UP as c_short;
    req.ifr_ifru.ifru_flags = flags | up;
    call(&mut req, libc::SIOCSIFFLAGS)?;
    u32::try_from(index).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidData))
}

/// A fresh, detached procfs instance (`fsopen` + `fsmount`, attached nowhere), or `None` when
/// the kernel refuses. Its dentries are its own, so looking up `sys/net` there does not walk
/// the entries every other namespace left under the shared `/proc/sys` (a lookup of
/// `/proc/sys/net` compares against one cached entry per namespace, ~1.5 ms with 1000).
fn private_proc() -> Option<OwnedFd> {
    const FSOPEN_CLOEXEC: libc::c_uint = 1;
    const FSCONFIG_CMD_CREATE: libc::c_uint = 6;
    const FSMOUNT_CLOEXEC: libc::c_uint = 1;
    // SAFETY: fsopen(2) with a NUL-terminated file system name; the result is checked.
    let fs = unsafe { libc::syscall(libc::SYS_fsopen, c"proc".as_ptr(), FSOPEN_CLOEXEC) };
    let fs = i32::try_from(fs).ok().filter(|fd| *fd >= 0)?;
    // SAFETY: `fs` is a fresh descriptor we own.
    let fs = unsafe { OwnedFd::from_raw_fd(fs) };
    // SAFETY: fsconfig(2) CMD_CREATE takes no key, value or aux argument.
    let created = unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            fs.as_raw_fd(),
            FSCONFIG_CMD_CREATE,
            std::ptr::null::<libc::c_char>(),
            std::ptr::null::<libc::c_void>(),
            0,
        )
    };
    if created < 0 {
        return None;
    }
    // SAFETY: fsmount(2) on a configured fs context; the result is checked.
    let mnt = unsafe { libc::syscall(libc::SYS_fsmount, fs.as_raw_fd(), FSMOUNT_CLOEXEC, 0) };
    let mnt = i32::try_from(mnt).ok().filter(|fd| *fd >= 0)?;
    // SAFETY: `mnt` is a fresh descriptor we own.
    Some(unsafe { OwnedFd::from_raw_fd(mnt) })
}

/// `/proc/sys/net` of the calling thread's namespace, opened through a private procfs instance
/// when possible (see [`private_proc`]), else through `/proc`.
fn sysctl_net_dir() -> std::io::Result<File> {
    if let Some(proc) = private_proc()
        && let Ok(fd) = openat(
            &proc,
            "sys/net",
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
    {
        return Ok(File::from(fd));
    }
    File::open("/proc/sys/net")
}

/// Opens the sysctl files `paths` (under `/proc/sys`) of the calling thread's namespace with
/// `flags`, relative to one [`sysctl_net_dir`].
fn open_sysctls<'a>(
    paths: impl Iterator<Item = &'a str>,
    flags: OFlag,
) -> std::io::Result<Vec<(&'a str, std::io::Result<File>)>> {
    let net = sysctl_net_dir()?;
    Ok(paths
        .map(|p| {
            let file = match p.strip_prefix("net/") {
                Some(rel) => openat(&net, rel, flags | OFlag::O_CLOEXEC, Mode::empty())
                    .map(File::from)
                    .map_err(std::io::Error::from),
                None => OpenOptions::new()
                    .read(!flags.contains(OFlag::O_WRONLY))
                    .write(flags.contains(OFlag::O_WRONLY))
                    .open(format!("/proc/sys/{p}")),
            };
            (p, file)
        })
        .collect())
}

/// Writes each `(path under /proc/sys, value)` in the calling thread's namespace.
pub(super) fn write_sysctls(netns: &str, sysctls: &[(String, String)]) -> Result<(), NsError> {
    let err = |path: &str| {
        let (netns, path) = (netns.to_owned(), path.to_owned());
        move |source| NsError::Sysctl {
            netns,
            path,
            source,
        }
    };
    let files = open_sysctls(sysctls.iter().map(|(p, _)| p.as_str()), OFlag::O_WRONLY)
        .map_err(err("net"))?;
    for ((path, file), (_, value)) in files.into_iter().zip(sysctls) {
        file.and_then(|mut f| f.write_all(value.as_bytes()))
            .map_err(err(path))?;
    }
    Ok(())
}

/// Reads each sysctl path; returns the ones whose value differs from the wanted one.
pub(super) fn sysctls_differ(sysctls: &[(String, String)]) -> Vec<String> {
    let Ok(files) = open_sysctls(sysctls.iter().map(|(p, _)| p.as_str()), OFlag::O_RDONLY) else {
        return sysctls.iter().map(|(p, _)| p.clone()).collect();
    };
    files
        .into_iter()
        .zip(sysctls)
        .filter(|((_, file), (_, value))| {
            let read = file.as_ref().ok().and_then(|f| read_value(f).ok());
            read.is_none_or(|s| s.trim() != value)
        })
        .map(|((p, _), _)| p.to_owned())
        .collect()
}

/// A sysctl file's value: read until its closing newline (one `read` for the values vmnet
/// sets) or the end, at most a page.
fn read_value(mut f: &File) -> std::io::Result<String> {
    let mut buf = [0u8; 4096];
    let mut len = 0;
    while len < buf.len() {
        let n = f.read(&mut buf[len..])?;
        len += n;
        if n == 0 || buf[..len].ends_with(b"\n") {
            break;
        }
    }
    String::from_utf8(buf[..len].to_vec())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// The value of each sysctl path (under `/proc/sys`) in the calling thread's namespace, `None`
/// where it cannot be read (e.g. the link is gone).
pub(super) fn read_sysctls(paths: &[String]) -> Vec<Option<String>> {
    let Ok(files) = open_sysctls(paths.iter().map(String::as_str), OFlag::O_RDONLY) else {
        return vec![None; paths.len()];
    };
    files
        .into_iter()
        .map(|(_, file)| {
            file.ok()
                .and_then(|f| read_value(&f).ok())
                .map(|s| s.trim().to_owned())
        })
        .collect()
}

/// Runs one nft JSON transaction in the calling thread's namespace: in process through
/// libnftables when the library is present (no process start, see [`crate::pool::libnft`]),
/// else through `nft -j -f -`.
pub(super) fn run_nft(netns: &str, ruleset: &serde_json::Value) -> Result<(), NsError> {
    run_nft_body(
        netns,
        &serde_json::to_string(ruleset).expect("JSON values serialize"),
    )
}

/// [`run_nft`] with the transaction serialized already.
pub(super) fn run_nft_body(netns: &str, body: &str) -> Result<(), NsError> {
    match LibNft::here() {
        Ok(nft) => nft.run(body).map(drop).map_err(|e| NsError::Nft {
            netns: netns.to_owned(),
            message: e.to_string(),
        }),
        Err(LibNftError::Load(_)) => run_nft_process(netns, body),
        Err(e) => Err(NsError::Nft {
            netns: netns.to_owned(),
            message: e.to_string(),
        }),
    }
}

fn run_nft_process(netns: &str, body: &str) -> Result<(), NsError> {
    let fail = |message: String| NsError::Nft {
        netns: netns.to_owned(),
        message,
    };
    let mut child = Command::new("nft")
        .args(["-j", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| fail(format!("cannot run nft: {e}")))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(body.as_bytes())
            .map_err(|e| fail(format!("writing to nft: {e}")))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| fail(format!("waiting for nft: {e}")))?;
    if !out.status.success() {
        return Err(fail(String::from_utf8_lossy(&out.stderr).trim().to_owned()));
    }
    Ok(())
}

/// The nft JSON listing of table `family name` in the calling thread's namespace, `None` when
/// it does not exist.
pub(super) fn list_table(
    netns: &str,
    family: &str,
    table: &str,
) -> Result<Option<serde_json::Value>, NsError> {
    let bad = |message: String| NsError::Nft {
        netns: netns.to_owned(),
        message,
    };
    let cmd =
        serde_json::json!({"nftables": [{"list": {"table": {"family": family, "name": table}}}]})
            .to_string();
    let text = match LibNft::here() {
        Ok(nft) => match nft.run(&cmd) {
            Ok(out) => out,
            Err(LibNftError::Refused { .. }) => return Ok(None),
            Err(e) => return Err(bad(e.to_string())),
        },
        Err(LibNftError::Load(_)) => {
            let out = Command::new("nft")
                .args(["-j", "list", "table", family, table])
                .stdin(Stdio::null())
                .output()
                .map_err(|e| bad(format!("cannot run nft: {e}")))?;
            if !out.status.success() {
                return Ok(None);
            }
            String::from_utf8_lossy(&out.stdout).into_owned()
        }
        Err(e) => return Err(bad(e.to_string())),
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| bad(format!("unreadable nft output: {e}")))
}

/// One nft session in the calling thread's namespace: a libnftables context when the library
/// is present (several commands, one context), else one `nft` process per command.
pub(super) struct NftSession {
    netns: String,
    lib: Option<LibNft>,
}

impl NftSession {
    /// A session in the calling thread's namespace (`netns` names it in errors).
    pub(super) fn here(netns: &str) -> Result<Self, NsError> {
        let lib = match LibNft::here() {
            Ok(l) => Some(l),
            Err(LibNftError::Load(_)) => None,
            Err(e) => {
                return Err(NsError::Nft {
                    netns: netns.to_owned(),
                    message: e.to_string(),
                });
            }
        };
        Ok(Self {
            netns: netns.to_owned(),
            lib,
        })
    }

    /// The JSON listing of table `family name`, `None` when it does not exist.
    pub(super) fn list_table(
        &self,
        family: &str,
        table: &str,
    ) -> Result<Option<serde_json::Value>, NsError> {
        let Some(nft) = &self.lib else {
            return list_table(&self.netns, family, table);
        };
        let bad = |message: String| NsError::Nft {
            netns: self.netns.clone(),
            message,
        };
        let cmd = serde_json::json!({"nftables": [{"list": {"table": {"family": family, "name": table}}}]})
            .to_string();
        match nft.run(&cmd) {
            Ok(text) => serde_json::from_str(&text)
                .map(Some)
                .map_err(|e| bad(format!("unreadable nft output: {e}"))),
            Err(LibNftError::Refused { .. }) => Ok(None),
            Err(e) => Err(bad(e.to_string())),
        }
    }

    /// Runs one JSON transaction.
    pub(super) fn json(&self, ruleset: &serde_json::Value) -> Result<(), NsError> {
        match &self.lib {
            Some(nft) => {
                let body = serde_json::to_string(ruleset).expect("JSON values serialize");
                nft.run(&body).map(drop).map_err(|e| NsError::Nft {
                    netns: self.netns.clone(),
                    message: e.to_string(),
                })
            }
            None => run_nft(&self.netns, ruleset),
        }
    }
}

/// Deletes table `family name` in the calling thread's namespace if it exists.
pub(super) fn nft_delete_table(netns: &str, family: &str, table: &str) -> Result<(), NsError> {
    let t = serde_json::json!({"table": {"family": family, "name": table}});
    run_nft(
        netns,
        &serde_json::json!({"nftables": [{"add": t.clone()}, {"delete": t}]}),
    )
}
