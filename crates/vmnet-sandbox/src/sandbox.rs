//! A sandbox host namespace and a fake internet namespace joined by an uplink veth, with a
//! cleanup guard.
//!
//! Layout (all addresses are documentation ranges):
//!
//! ```text
//!  <prefix>host                                   <prefix>inet
//!  ┌──────────────────────────────┐  veth   ┌──────────────────────────────────┐
//!  │ uplink 203.0.113.2/24        ├─────────┤ sbhost 203.0.113.1/24            │
//!  │        2001:db8:0:1::2/64    │         │        2001:db8:0:1::1/64        │
//!  │ default via 203.0.113.1      │         │ lo 198.51.100.10/32 (echo)       │
//!  │ ::/0 via 2001:db8:0:1::1     │         │    2001:db8:100::10/128 (echo)   │
//!  │ forwarding on (v4, v6)       │         │ fdaa::/16 via 2001:db8:0:1::2    │
//!  └──────────────────────────────┘         └──────────────────────────────────┘
//! ```
//!
//! The fake internet routes the mesh range `fdaa::/16` back to the sandbox host, standing in
//! for the mesh and public IPv6 routing of a real host, so IPv6 from a guest's mesh address to
//! the internet gets its replies. Forwarding is on in the sandbox host only.
//!
//! # Names
//! Every namespace of one sandbox starts with its prefix: `<prefix>host`, `<prefix>inet`,
//! `<prefix>x-<name>` for extras ([`Sandbox::add_netns`]). The prefix is also the name prefix to
//! give an agent or driver running in the sandbox ([`Sandbox::agent_prefix`]; vmnet's derived
//! names are `<prefix><kind letter><4 hex digits>`, which none of the sandbox's own names match),
//! so the guard removes what they made too.
//!
//! A generated prefix is `<tag><pid:06x><counter:02x>`: a 1-2 letter tag naming the caller, the
//! pid (at most `0x3fffff`, so the first hex digit is a decimal digit) and a per-process counter,
//! at most 10 bytes of lowercase letters and digits, as vmnet's `--name-prefix` requires. The
//! fixed widths make prefixes of live sandboxes prefix-free: no prefix starts another.
//!
//! A name belongs to a sandbox only when it is the prefix followed by one of these suffix forms
//! ([`owns`]): `host`, `inet`, `x-…`, or one lowercase letter and four lowercase hex digits.
//! Nothing longer: the namespaces of a sandbox `ab1x` (`ab1xhost`, …) are not those of `ab1`.
//! [`Sandbox::with_prefix`] also refuses a prefix when a sandbox whose prefix starts it, or is
//! started by it, exists ([`prefix_conflicts`]), so live prefixes stay prefix-free.
//!
//! # Cleanup
//! `Drop` deletes every named namespace of the sandbox ([`owned`]; links inside go with them),
//! also while unwinding from a panic. [`Sandbox::keep`] disarms the guard (for `vmnet-lab up`);
//! [`cleanup`] removes a kept sandbox later, from another process.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};

use vmnet_model::error::chain;

use crate::SandboxError;
use crate::echo::EchoService;
use crate::netns;

/// The fake internet's end of the uplink.
pub const INET_UPLINK_V4: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);
/// The sandbox host's uplink address: what the internet sees after NAT.
pub const HOST_UPLINK_V4: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 2);
/// Prefix length of the IPv4 uplink.
pub const UPLINK_V4_LEN: u8 = 24;
/// The fake internet's end of the uplink (IPv6).
pub const INET_UPLINK_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 1, 0, 0, 0, 1);
/// The sandbox host's uplink address (IPv6).
pub const HOST_UPLINK_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 1, 0, 0, 0, 2);
/// Prefix length of the IPv6 uplink.
pub const UPLINK_V6_LEN: u8 = 64;
/// A fake internet address, beyond the uplink subnet, where the echo service listens.
pub const ECHO_V4: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 10);
/// The IPv6 fake internet address of the echo service.
pub const ECHO_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x100, 0, 0, 0, 0, 0x10);
/// The echo port (TCP and UDP).
pub const ECHO_PORT: u16 = 7;
/// The uplink's name in the sandbox host.
pub const HOST_UPLINK_IF: &str = "uplink";
/// The uplink's name in the fake internet.
pub const INET_UPLINK_IF: &str = "sbhost";
/// The mesh range routed from the fake internet back to the sandbox host.
pub const MESH_RANGE: &str = "fdaa::/16";

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A sandbox host and fake internet, deleted on drop (see the module docs).
#[derive(Debug)]
pub struct Sandbox {
    prefix: String,
    extra: Mutex<Vec<String>>,
    armed: bool,
}

/// A fresh prefix `<tag><pid:06x><counter:02x>` (see the module docs).
///
/// # Panics
/// When `tag` is not 1-2 lowercase ASCII letters.
#[must_use]
pub fn unique_prefix(tag: &str) -> String {
    assert!(
        !tag.is_empty() && tag.len() <= 2 && tag.bytes().all(|b| b.is_ascii_lowercase()),
        "sandbox tag {tag:?} must be 1-2 lowercase letters"
    );
    let n = COUNTER.fetch_add(1, Ordering::Relaxed) % 256;
    format!("{tag}{:06x}{n:02x}", std::process::id() & 0x3f_ffff)
}

impl Sandbox {
    /// Creates a sandbox with a fresh prefix from `tag` (1-2 lowercase letters naming the caller,
    /// e.g. `"ns"` for the namespace driver's tests).
    ///
    /// # Errors
    /// When a namespace, link, address, route or sysctl cannot be set up; whatever was made is
    /// deleted again.
    ///
    /// # Panics
    /// On a bad tag (see [`unique_prefix`]).
    pub fn new(tag: &str) -> Result<Self, SandboxError> {
        Self::with_prefix(&unique_prefix(tag))
    }

    /// Creates a sandbox whose names start with `prefix` (lowercase letters and digits, at most
    /// 10 bytes if an agent is to use it as its name prefix).
    ///
    /// # Errors
    /// [`SandboxError::Unexpected`] when namespaces with this prefix exist already; otherwise as
    /// [`Sandbox::new`].
    pub fn with_prefix(prefix: &str) -> Result<Self, SandboxError> {
        let existing = prefix_conflicts(prefix);
        if !existing.is_empty() {
            return Err(SandboxError::Unexpected(format!(
                "sandbox {prefix}: namespaces exist already: {}",
                existing.join(", ")
            )));
        }
        let sb = Self {
            prefix: prefix.to_owned(),
            extra: Mutex::new(Vec::new()),
            armed: true,
        };
        sb.build()?;
        Ok(sb)
    }

    /// Takes charge of an existing sandbox by prefix (e.g. one kept by `vmnet-lab up`), so that
    /// dropping the value removes it.
    #[must_use]
    pub fn adopt(prefix: &str) -> Self {
        Self {
            prefix: prefix.to_owned(),
            extra: Mutex::new(Vec::new()),
            armed: true,
        }
    }

    fn build(&self) -> Result<(), SandboxError> {
        let (host, inet) = (self.host(), self.inet());
        netns::create(&host)?;
        netns::create(&inet)?;
        // Addresses must work at once: no duplicate address detection in either namespace.
        for ns in [&host, &inet] {
            netns::sysctl(ns, "net/ipv6/conf/all/accept_dad", "0")?;
            netns::sysctl(ns, "net/ipv6/conf/default/accept_dad", "0")?;
        }
        netns::ip(
            &host,
            &[
                "link",
                "add",
                HOST_UPLINK_IF,
                "type",
                "veth",
                "peer",
                "name",
                INET_UPLINK_IF,
                "netns",
                &inet,
            ],
        )?;
        // A flap keeps the uplink's IPv6 addresses ([`crate::uplink`] puts the routes back).
        keep_addr_on_down(&host, HOST_UPLINK_IF)?;
        keep_addr_on_down(&inet, INET_UPLINK_IF)?;
        let h4 = format!("{HOST_UPLINK_V4}/{UPLINK_V4_LEN}");
        let h6 = format!("{HOST_UPLINK_V6}/{UPLINK_V6_LEN}");
        let i4 = format!("{INET_UPLINK_V4}/{UPLINK_V4_LEN}");
        let i6 = format!("{INET_UPLINK_V6}/{UPLINK_V6_LEN}");
        netns::ip(&host, &["addr", "add", &h4, "dev", HOST_UPLINK_IF])?;
        netns::ip(&host, &["addr", "add", &h6, "dev", HOST_UPLINK_IF, "nodad"])?;
        netns::ip(&host, &["link", "set", HOST_UPLINK_IF, "up"])?;
        netns::ip(&inet, &["addr", "add", &i4, "dev", INET_UPLINK_IF])?;
        netns::ip(&inet, &["addr", "add", &i6, "dev", INET_UPLINK_IF, "nodad"])?;
        netns::ip(&inet, &["link", "set", INET_UPLINK_IF, "up"])?;
        netns::ip(
            &inet,
            &["addr", "add", &format!("{ECHO_V4}/32"), "dev", "lo"],
        )?;
        netns::ip(
            &inet,
            &[
                "addr",
                "add",
                &format!("{ECHO_V6}/128"),
                "dev",
                "lo",
                "nodad",
            ],
        )?;
        netns::ip(
            &host,
            &[
                "route",
                "add",
                "default",
                "via",
                &INET_UPLINK_V4.to_string(),
            ],
        )?;
        netns::ip(
            &host,
            &[
                "-6",
                "route",
                "add",
                "default",
                "via",
                &INET_UPLINK_V6.to_string(),
            ],
        )?;
        netns::ip(
            &inet,
            &[
                "-6",
                "route",
                "add",
                MESH_RANGE,
                "via",
                &HOST_UPLINK_V6.to_string(),
            ],
        )?;
        netns::sysctl(&host, "net/ipv4/ip_forward", "1")?;
        netns::sysctl(&host, "net/ipv6/conf/all/forwarding", "1")?;
        Ok(())
    }

    /// The prefix every name of this sandbox starts with.
    #[must_use]
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The sandbox host namespace (where an agent runs).
    #[must_use]
    pub fn host(&self) -> String {
        format!("{}host", self.prefix)
    }

    /// The fake internet namespace.
    #[must_use]
    pub fn inet(&self) -> String {
        format!("{}inet", self.prefix)
    }

    /// The name prefix for an agent or driver working in this sandbox: the sandbox prefix
    /// itself, so the guard removes what they create; their derived names
    /// (`<prefix><kind><4 hex>`) never match the sandbox's own namespaces.
    #[must_use]
    pub fn agent_prefix(&self) -> String {
        self.prefix.clone()
    }

    /// Creates one more namespace, `<prefix>x-<name>`, deleted with the sandbox; its loopback is
    /// up and IPv6 duplicate address detection is off. Returns its full name.
    ///
    /// # Errors
    /// When it cannot be created.
    pub fn add_netns(&self, name: &str) -> Result<String, SandboxError> {
        let full = format!("{}x-{name}", self.prefix);
        netns::create(&full)?;
        self.extra
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(full.clone());
        netns::sysctl(&full, "net/ipv6/conf/all/accept_dad", "0")?;
        netns::sysctl(&full, "net/ipv6/conf/default/accept_dad", "0")?;
        Ok(full)
    }

    /// Starts the echo service in the fake internet on [`ECHO_V4`] and [`ECHO_V6`], port
    /// [`ECHO_PORT`], TCP and UDP.
    ///
    /// # Errors
    /// When the listeners cannot be opened.
    pub fn start_echo(&self) -> Result<EchoService, SandboxError> {
        EchoService::start(
            &self.inet(),
            &[
                SocketAddr::new(IpAddr::V4(ECHO_V4), ECHO_PORT),
                SocketAddr::new(IpAddr::V6(ECHO_V6), ECHO_PORT),
            ],
        )
    }

    /// Disarms the guard: the sandbox stays after the value is dropped. Returns the prefix, for
    /// a later [`cleanup`].
    #[must_use]
    pub fn keep(mut self) -> String {
        self.armed = false;
        self.prefix.clone()
    }

    /// What is left of this sandbox (see [`leftovers`]).
    #[must_use]
    pub fn leftovers(&self) -> Vec<String> {
        leftovers(&self.prefix)
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Err(e) = cleanup(&self.prefix) {
            eprintln!("sandbox {}: cleanup failed: {}", self.prefix, chain(&e));
        }
    }
}

/// Sets `net.ipv6.conf.<link>.keep_addr_on_down=1` in namespace `ns`: the link keeps its IPv6
/// addresses while it is down, as IPv4 does.
///
/// # Errors
/// When the sysctl cannot be written.
pub fn keep_addr_on_down(ns: &str, link: &str) -> Result<(), SandboxError> {
    netns::sysctl(ns, &format!("net/ipv6/conf/{link}/keep_addr_on_down"), "1")
}

/// Whether `name` (a namespace or link) belongs to the sandbox or agent with `prefix`: the
/// prefix followed by `host`, `inet`, `x-…`, or exactly one lowercase letter and four lowercase
/// hex digits (vmnet's derived names). A name of a sandbox with a longer prefix never matches.
#[must_use]
pub fn owns(prefix: &str, name: &str) -> bool {
    let Some(rest) = name.strip_prefix(prefix) else {
        return false;
    };
    if rest == "host" || rest == "inet" || rest.starts_with("x-") {
        return true;
    }
    let b = rest.as_bytes();
    b.len() == 5
        && b[0].is_ascii_lowercase()
        && b[1..]
            .iter()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
}

/// The named namespaces of the sandbox with `prefix` (see [`owns`]), sorted.
#[must_use]
pub fn owned(prefix: &str) -> Vec<String> {
    netns::list(prefix)
        .into_iter()
        .filter(|n| owns(prefix, n))
        .collect()
}

/// Existing namespaces that stand in the way of a sandbox with `prefix`: every one whose name
/// starts with `prefix` (its own, or a sandbox's with a longer prefix), and the host or fake
/// internet namespace of a sandbox whose prefix is a proper prefix of `prefix`. Empty when
/// `prefix` is free.
#[must_use]
pub fn prefix_conflicts(prefix: &str) -> Vec<String> {
    let mut out = netns::list(prefix);
    for end in 1..prefix.len() {
        let Some(shorter) = prefix.get(..end) else {
            continue;
        };
        for suffix in ["host", "inet"] {
            let ns = format!("{shorter}{suffix}");
            if netns::path(&ns).exists() {
                out.push(ns);
            }
        }
    }
    out
}

/// Deletes the named namespaces of the sandbox with `prefix` ([`owned`]; their links,
/// addresses, routes and rules go with them), never those of a sandbox with a longer prefix.
/// Goes on past failures and returns the first one.
///
/// # Errors
/// The first namespace that could not be deleted.
pub fn cleanup(prefix: &str) -> Result<(), SandboxError> {
    let mut first = None;
    for ns in owned(prefix) {
        if let Err(e) = netns::delete(&ns) {
            first.get_or_insert(e);
        }
    }
    first.map_or(Ok(()), Err)
}

/// Everything of the sandbox with `prefix` (see [`owns`]) that still exists: named namespaces,
/// and links of the calling process's namespace (read from `/sys/class/net`, which shows the
/// namespace sysfs was mounted in). Empty after a clean teardown.
#[must_use]
pub fn leftovers(prefix: &str) -> Vec<String> {
    let mut out: Vec<String> = owned(prefix)
        .into_iter()
        .map(|n| format!("netns {n}"))
        .collect();
    if let Ok(entries) = std::fs::read_dir("/sys/class/net") {
        for e in entries.filter_map(Result::ok) {
            if let Ok(name) = e.file_name().into_string()
                && owns(prefix, &name)
            {
                out.push(format!("link {name}"));
            }
        }
    }
    out
}

/// The pid a generated prefix names (`<tag><pid:06x><counter:02x>`, see [`unique_prefix`]);
/// `None` for any other name.
#[must_use]
pub fn prefix_pid(prefix: &str) -> Option<u32> {
    let b = prefix.as_bytes();
    let tag = b.iter().take_while(|c| c.is_ascii_lowercase()).count();
    let hex = |s: &[u8]| {
        s.iter()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
    };
    // The pid's first hex digit is a decimal digit (pid ≤ 0x3fffff), which ends the tag.
    if !(1..=2).contains(&tag) || b.len() != tag + 8 || !hex(&b[tag..]) {
        return None;
    }
    u32::from_str_radix(prefix.get(tag..tag + 6)?, 16).ok()
}

/// Whether process `pid` runs: `/proc/<pid>` exists and the process is not a zombie (a killed
/// process whose parent has not reaped it yet still has a `/proc` entry, state `Z`).
#[must_use]
pub fn process_runs(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // `pid (comm) state …`: the command may hold spaces and parentheses, the state follows the
    // last `)`.
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .is_some_and(|state| state != "Z" && state != "X")
}

/// Removes the packet-activity pin roots `<temp dir>/<prefix>-bpf` of tests and benchmarks
/// whose process is gone (killed before its guard ran): such a root keeps the activity program
/// attached to the kernel's tracepoint. A root whose prefix is not a generated one, or whose pid
/// runs ([`process_runs`]; maybe reused, then left alone), is kept. Returns the roots removed.
#[must_use]
pub fn sweep_stale_pin_roots() -> Vec<std::path::PathBuf> {
    let dir = std::env::temp_dir();
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for e in entries.filter_map(Result::ok) {
        let Ok(name) = e.file_name().into_string() else {
            continue;
        };
        let Some(pid) = name.strip_suffix("-bpf").and_then(prefix_pid) else {
            continue;
        };
        if process_runs(pid) {
            continue;
        }
        let path = e.path();
        if vmnet_kernel::activity::remove_root(&path).is_ok() {
            removed.push(path);
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::{owns, prefix_pid, process_runs, unique_prefix};

    #[test]
    fn a_zombie_or_reaped_process_does_not_run() {
        assert!(process_runs(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        // Not reaped yet: a zombie once it has exited.
        let t0 = std::time::Instant::now();
        while process_runs(pid) {
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(5),
                "still running"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(
            std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "a zombie"
        );
        child.wait().unwrap();
        assert!(!process_runs(pid), "reaped");
    }

    #[test]
    fn a_generated_prefix_names_its_pid_and_nothing_else_does() {
        let mine = unique_prefix("ns");
        assert_eq!(prefix_pid(&mine), Some(std::process::id() & 0x3f_ffff));
        assert_eq!(prefix_pid("ba00420900"), Some(0x4209));
        assert_eq!(prefix_pid("x0000ff01"), Some(0xff));
        for other in [
            "vmsbx",
            "ns0042090",
            "ns004209001",
            "abc0042090",
            "ns00420g00",
            "",
        ] {
            assert_eq!(prefix_pid(other), None, "{other}");
        }
    }

    #[test]
    fn owns_only_the_documented_suffix_forms_of_the_exact_prefix() {
        for name in [
            "fuq1host",
            "fuq1inet",
            "fuq1x-g0",
            "fuq1x-extra",
            "fuq1n0007",
            "fuq1g00ff",
            "fuq1hffff",
        ] {
            assert!(owns("fuq1", name), "{name}");
        }
        for name in [
            // Another sandbox's, whose prefix merely starts with ours.
            "fuq1xhost",
            "fuq1xinet",
            "fuq1xx-g0",
            "fuq1xn0007",
            "fuq1ahost",
            "fuq1an0007",
            // Not a derived name: wrong length, upper case, not hex, no letter.
            "fuq1n007",
            "fuq1n00070",
            "fuq1N0007",
            "fuq1n00g7",
            "fuq100007",
            "fuq1",
            "fuq1hostx",
            "fuqhost",
        ] {
            assert!(!owns("fuq1", name), "{name}");
        }
    }
}
