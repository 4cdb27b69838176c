//! The public address checks of the sandbox jobs: for a VM with `public_ipv4` or a mapped
//! `public_ipv6`, the fake internet reaches its guest at them with the client's own address
//! (TCP and UDP), and the guest reaches its own public addresses (seen from them).
//!
//! | check | expected |
//! |---|---|
//! | `public ipv4 tcp from internet` / `… udp …` | `from <the fake internet's address on the host's link>` |
//! | `public ipv6 tcp from internet` | the same, IPv6 (the /128 arrives at the guest's mesh address) |
//! | `own public ipv4` / `own public ipv6` | `from <the public address>` |
//!
//! With public addresses the guest's own connections to the internet are expected from them
//! ([`super::checks`]: `ipv4 tcp echo` from the public IPv4, `ipv6 tcp echo` from the /128).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use vmnet_model::vm::VmConfig;

use super::checks::{CheckPlan, GuestInfo, Probe};
use crate::guest::GUEST_V4;
use crate::sandbox::ECHO_PORT;

/// What the public checks of one VM need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicCheck {
    /// The fake internet's namespace (the client runs there).
    pub inet_ns: String,
    /// The fake internet's IPv4 address towards the VM's host (the client's source).
    pub inet_v4: Ipv4Addr,
    /// The fake internet's IPv6 address towards the VM's host.
    pub inet_v6: Ipv6Addr,
    /// The VM's public IPv4.
    pub ipv4: Option<Ipv4Addr>,
    /// The VM's mapped public IPv6 (a /128; a routed block needs the guest to configure it).
    pub ipv6: Option<Ipv6Addr>,
}

/// The public checks of `cfg`, run from `inet_ns` whose addresses towards the VM's host are
/// `inet_v4` / `inet_v6`; `None` when the VM has no public IPv4 or mapped IPv6.
#[must_use]
pub fn public_check(
    cfg: &VmConfig,
    inet_ns: &str,
    inet_v4: Ipv4Addr,
    inet_v6: Ipv6Addr,
) -> Option<PublicCheck> {
    let ipv6 = cfg.public_ipv6_mapped();
    (cfg.public_ipv4.is_some() || ipv6.is_some()).then(|| PublicCheck {
        inet_ns: inet_ns.to_owned(),
        inet_v4,
        inet_v6,
        ipv4: cfg.public_ipv4,
        ipv6,
    })
}

fn from(ip: impl Into<IpAddr>) -> String {
    format!("from {}", ip.into())
}

/// The public checks of VM `i`.
pub(super) fn plan(i: usize, v: &GuestInfo) -> Vec<CheckPlan> {
    let Some(p) = &v.public else {
        return Vec::new();
    };
    let at = |ip: IpAddr| SocketAddr::new(ip, ECHO_PORT);
    let mut out = Vec::new();
    let mut add = |name: &str, expected: String, probe: Probe| {
        out.push(CheckPlan {
            vm: i,
            name: name.into(),
            expected,
            probe,
        });
    };
    if let Some(a) = p.ipv4 {
        let t = at(IpAddr::V4(a));
        add(
            "public ipv4 tcp from internet",
            from(p.inet_v4),
            Probe::InetTcp(t),
        );
        add(
            "public ipv4 udp from internet",
            from(p.inet_v4),
            Probe::InetUdp(t),
        );
        add("own public ipv4", from(a), Probe::Tcp(t));
    }
    if let Some(a) = p.ipv6 {
        let t = at(IpAddr::V6(a));
        add(
            "public ipv6 tcp from internet",
            from(p.inet_v6),
            Probe::InetTcp(t),
        );
        add("own public ipv6", from(a), Probe::Tcp(t));
    }
    out
}

/// The addresses the guest's echo service listens on for the public checks (its IPv4, which
/// the public IPv4 reaches; the mesh address, which the /128 reaches, is served already).
pub(super) fn echo_addrs(v: &GuestInfo) -> Vec<SocketAddr> {
    v.public
        .as_ref()
        .filter(|p| p.ipv4.is_some())
        .map(|_| SocketAddr::new(IpAddr::V4(GUEST_V4), ECHO_PORT))
        .into_iter()
        .collect()
}
