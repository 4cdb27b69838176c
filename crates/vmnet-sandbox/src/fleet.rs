//! Several sandbox hosts sharing one fake internet and one private network, with a cleanup
//! guard: the topology of the multi-host sandbox (`vmnet-lab up --sandbox examples/fleet.json`) and
//! of multi-host tests ([`Fleet::new`]).
//!
//! Layout for host `i` (1 to [`MAX_HOSTS`]; every address is a documentation or private range):
//!
//! ```text
//!  <prefix><i>host                          <prefix>inet (shared)
//!  ┌───────────────────────────────┐ veth  ┌──────────────────────────────────────────┐
//!  │ uplink 192.0.2.(8i+2)/29      ├───────┤ up<i> 192.0.2.(8i+1)/29                  │
//!  │        2001:db8:0:<i>::2/64   │       │       2001:db8:0:<i>::1/64               │
//!  │ default via the fake internet │       │ lo 198.51.100.10, 2001:db8:100::10 (echo)│
//!  │ forwarding on (v4, v6)        │       │ forwarding on; public block of host i:   │
//!  │                               │       │   203.0.113.(48+16i)/28, 2001:db8:<i>::/48│
//!  │ priv 10.10.0.<i>/24           │       │   routed: via the host's uplink address  │
//!  │      fd00:10::<i>/64          │       │   proxy:  on-link on up<i> (ARP/NDP)     │
//!  └──────────────┬────────────────┘       └──────────────────────────────────────────┘
//!                 │ veth (MTU 1500)
//!  <prefix>x-priv: bridge br0 (MTU 1500), port h<i> per host
//! ```
//!
//! Host 1's public block is 203.0.113.64/28 and 2001:db8:1::/48, host 2's 203.0.113.80/28 and
//! 2001:db8:2::/48, and so on. With [`PublicNeighbors::Routed`] the fake internet routes the
//! block to the host's uplink address; with [`PublicNeighbors::Proxy`] it treats the block as
//! on-link on the uplink, so it resolves each address with ARP/NDP there and the host has to
//! answer for them (proxy ARP/NDP). The private network is the one a mesh between the hosts
//! runs over.
//!
//! # Names
//! Every namespace starts with the fleet prefix `P` (at most 9 bytes): `Pinet`, `Px-priv`, and
//! `P<i>host` per host. Host `i`'s agent prefix is `P<i>` (at most 10 bytes); the host prefixes
//! have one length and differ in their last byte, so they are prefix-free. Everything an agent
//! derives (`P<i><kind><4 hex>`) and the host namespace are names of the sandbox prefix `P<i>`
//! ([`crate::sandbox::owns`]), so [`owned`] finds them by exact prefix.
//!
//! # Cleanup
//! `Drop` deletes every namespace of [`owned`], also while unwinding; [`Fleet::keep`] disarms it
//! and [`cleanup`] removes a kept fleet later.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use ipnet::{Ipv4Net, Ipv6Net};
use serde::{Deserialize, Serialize};
use vmnet_model::error::chain;

use crate::echo::EchoService;
use crate::sandbox::{ECHO_PORT, ECHO_V4, ECHO_V6, HOST_UPLINK_IF};
use crate::{SandboxError, netns, sandbox};

/// The most hosts a fleet has (the host index is one digit of the agent prefix).
pub const MAX_HOSTS: usize = 4;
/// The longest fleet prefix: a host prefix adds one byte and must stay within 10.
pub const MAX_PREFIX_LEN: usize = 9;
/// The host's leg on the private network.
pub const PRIVATE_IF: &str = "priv";
/// The private network's bridge (in `<prefix>x-priv`).
pub const PRIVATE_BRIDGE: &str = "br0";
/// The MTU of the private network.
pub const PRIVATE_MTU: u32 = 1500;
/// Prefix length of a host's uplink subnet (IPv4).
pub const UPLINK_V4_LEN: u8 = 29;
/// Prefix length of a host's uplink subnet (IPv6).
pub const UPLINK_V6_LEN: u8 = 64;
/// Prefix length of the private network (IPv4, 10.10.0.0/24).
pub const PRIVATE_V4_LEN: u8 = 24;
/// Prefix length of the private network (IPv6, fd00:10::/64).
pub const PRIVATE_V6_LEN: u8 = 64;

/// How the fake internet reaches a host's public block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PublicNeighbors {
    /// Routed to the host's uplink address.
    #[default]
    Routed,
    /// On-link on the uplink: the host must answer ARP/NDP for the addresses.
    Proxy,
}

impl PublicNeighbors {
    /// `"routed"` or `"proxy"`, as in the spec file.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Routed => "routed",
            Self::Proxy => "proxy",
        }
    }
}

/// One host of a fleet: its names and addresses (pure data, see [`host_net`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HostNet {
    /// 1-based index.
    pub index: u8,
    /// The agent's name prefix, `<fleet prefix><index>`.
    pub prefix: String,
    /// The host namespace, `<prefix>host`.
    pub ns: String,
    /// The uplink's name in the fake internet.
    pub inet_if: String,
    /// The host's uplink address: what the internet sees from it (and from its VMs after NAT).
    pub uplink_v4: Ipv4Addr,
    /// The fake internet's end of the uplink.
    pub inet_v4: Ipv4Addr,
    /// The host's uplink address (IPv6).
    pub uplink_v6: Ipv6Addr,
    /// The fake internet's end of the uplink (IPv6).
    pub inet_v6: Ipv6Addr,
    /// The host's public IPv4 block.
    pub public_v4: Ipv4Net,
    /// The host's public IPv6 block.
    pub public_v6: Ipv6Net,
    /// How the fake internet reaches the public block.
    pub public_neighbors: PublicNeighbors,
    /// The host's address on the private network.
    pub private_v4: Ipv4Addr,
    /// The host's address on the private network (IPv6 ULA).
    pub private_v6: Ipv6Addr,
}

/// The names and addresses of host `index` (1..=[`MAX_HOSTS`]) of the fleet `prefix`.
///
/// # Panics
/// When `index` is out of range.
#[must_use]
pub fn host_net(prefix: &str, index: u8, public_neighbors: PublicNeighbors) -> HostNet {
    assert!(
        (1..=MAX_HOSTS).contains(&usize::from(index)),
        "fleet host index {index} is not in 1..={MAX_HOSTS}"
    );
    let i = index;
    let i16 = u16::from(i);
    let host_prefix = format!("{prefix}{i}");
    HostNet {
        index: i,
        ns: format!("{host_prefix}host"),
        prefix: host_prefix,
        inet_if: format!("up{i}"),
        uplink_v4: Ipv4Addr::new(192, 0, 2, 8 * i + 2),
        inet_v4: Ipv4Addr::new(192, 0, 2, 8 * i + 1),
        uplink_v6: Ipv6Addr::new(0x2001, 0xdb8, 0, i16, 0, 0, 0, 2),
        inet_v6: Ipv6Addr::new(0x2001, 0xdb8, 0, i16, 0, 0, 0, 1),
        public_v4: Ipv4Net::new(Ipv4Addr::new(203, 0, 113, 48 + 16 * i), 28)
            .expect("a /28 is a valid prefix length"),
        public_v6: Ipv6Net::new(Ipv6Addr::new(0x2001, 0xdb8, i16, 0, 0, 0, 0, 0), 48)
            .expect("a /48 is a valid prefix length"),
        public_neighbors,
        private_v4: Ipv4Addr::new(10, 10, 0, i),
        private_v6: Ipv6Addr::new(0xfd00, 0x10, 0, 0, 0, 0, 0, i16),
    }
}

/// Whether `prefix` can name a fleet: a valid agent name prefix of at most
/// [`MAX_PREFIX_LEN`] bytes.
///
/// # Errors
/// What is wrong with it.
pub fn check_prefix(prefix: &str) -> Result<(), String> {
    vmnet_plan::ns::names::check_prefix(prefix)?;
    if prefix.len() > MAX_PREFIX_LEN {
        return Err(format!(
            "fleet name {prefix:?} is longer than {MAX_PREFIX_LEN} bytes (each host's agent prefix adds one)"
        ));
    }
    Ok(())
}

/// A fleet of sandbox hosts, deleted on drop (see the module docs).
#[derive(Debug)]
pub struct Fleet {
    prefix: String,
    hosts: Vec<HostNet>,
    armed: bool,
}

impl Fleet {
    /// Creates `n` hosts (1..=[`MAX_HOSTS`]) with routed public blocks under a fresh prefix
    /// (tag `f`, 9 bytes).
    ///
    /// # Errors
    /// As [`Fleet::with_prefix`].
    pub fn new(n: usize) -> Result<Self, SandboxError> {
        Self::with_prefix(
            &sandbox::unique_prefix("f"),
            &vec![PublicNeighbors::Routed; n],
        )
    }

    /// Creates one host per entry of `hosts` (1..=[`MAX_HOSTS`]), each with that public-block
    /// mode, under `prefix` (see [`check_prefix`]).
    ///
    /// # Errors
    /// [`SandboxError::Unexpected`] for a bad prefix or host count, or when namespaces in the
    /// way of this prefix exist ([`sandbox::prefix_conflicts`]); otherwise when a namespace,
    /// link, address, route or sysctl cannot be set up, after deleting whatever was made.
    pub fn with_prefix(prefix: &str, hosts: &[PublicNeighbors]) -> Result<Self, SandboxError> {
        check_prefix(prefix).map_err(SandboxError::Unexpected)?;
        if hosts.is_empty() || hosts.len() > MAX_HOSTS {
            return Err(SandboxError::Unexpected(format!(
                "fleet {prefix}: {} hosts; 1 to {MAX_HOSTS} are possible",
                hosts.len()
            )));
        }
        let existing = sandbox::prefix_conflicts(prefix);
        if !existing.is_empty() {
            return Err(SandboxError::Unexpected(format!(
                "fleet {prefix}: namespaces exist already: {}",
                existing.join(", ")
            )));
        }
        let fleet = Self {
            prefix: prefix.to_owned(),
            hosts: (1..)
                .zip(hosts)
                .map(|(i, pn)| host_net(prefix, i, *pn))
                .collect(),
            armed: true,
        };
        // On an error the guard drops here and deletes what was made.
        fleet.build()?;
        Ok(fleet)
    }

    fn build(&self) -> Result<(), SandboxError> {
        let (inet, private) = (self.inet(), self.private_ns());
        for ns in [&inet, &private] {
            netns::create(ns)?;
            no_dad(ns)?;
        }
        // The fake internet routes between the hosts' uplinks (a VM reaches another host's VM
        // at its public address through it, as through any Internet path).
        netns::sysctl(&inet, "net/ipv4/ip_forward", "1")?;
        netns::sysctl(&inet, "net/ipv6/conf/all/forwarding", "1")?;
        netns::ip(
            &inet,
            &["addr", "add", &format!("{ECHO_V4}/32"), "dev", "lo"],
        )?;
        let echo6 = format!("{ECHO_V6}/128");
        netns::ip(&inet, &["addr", "add", &echo6, "dev", "lo", "nodad"])?;
        let mtu = PRIVATE_MTU.to_string();
        netns::ip(
            &private,
            &["link", "add", PRIVATE_BRIDGE, "mtu", &mtu, "type", "bridge"],
        )?;
        netns::ip(&private, &["link", "set", PRIVATE_BRIDGE, "up"])?;
        for h in &self.hosts {
            self.build_host(h)?;
        }
        Ok(())
    }

    fn build_host(&self, h: &HostNet) -> Result<(), SandboxError> {
        let (inet, private, ns) = (self.inet(), self.private_ns(), h.ns.as_str());
        netns::create(ns)?;
        no_dad(ns)?;
        netns::sysctl(ns, "net/ipv4/ip_forward", "1")?;
        netns::sysctl(ns, "net/ipv6/conf/all/forwarding", "1")?;
        // The uplink to the fake internet.
        let up = HOST_UPLINK_IF;
        netns::ip(
            ns,
            &[
                "link", "add", up, "type", "veth", "peer", "name", &h.inet_if, "netns", &inet,
            ],
        )?;
        crate::sandbox::keep_addr_on_down(ns, up)?;
        crate::sandbox::keep_addr_on_down(&inet, &h.inet_if)?;
        let a = |ip: IpAddr, len: u8| format!("{ip}/{len}");
        let v4 = |ip: Ipv4Addr| IpAddr::V4(ip);
        let v6 = |ip: Ipv6Addr| IpAddr::V6(ip);
        netns::ip(
            ns,
            &["addr", "add", &a(v4(h.uplink_v4), UPLINK_V4_LEN), "dev", up],
        )?;
        let addr6 = a(v6(h.uplink_v6), UPLINK_V6_LEN);
        netns::ip(ns, &["addr", "add", &addr6, "dev", up, "nodad"])?;
        netns::ip(ns, &["link", "set", up, "up"])?;
        let iif = h.inet_if.as_str();
        netns::ip(
            &inet,
            &["addr", "add", &a(v4(h.inet_v4), UPLINK_V4_LEN), "dev", iif],
        )?;
        let addr6 = a(v6(h.inet_v6), UPLINK_V6_LEN);
        netns::ip(&inet, &["addr", "add", &addr6, "dev", iif, "nodad"])?;
        netns::ip(&inet, &["link", "set", iif, "up"])?;
        netns::ip(
            ns,
            &["route", "add", "default", "via", &h.inet_v4.to_string()],
        )?;
        let gw6 = h.inet_v6.to_string();
        netns::ip(ns, &["-6", "route", "add", "default", "via", &gw6])?;
        // The public block, routed or on-link.
        let (b4, b6) = (h.public_v4.to_string(), h.public_v6.to_string());
        match h.public_neighbors {
            PublicNeighbors::Routed => {
                netns::ip(
                    &inet,
                    &["route", "add", &b4, "via", &h.uplink_v4.to_string()],
                )?;
                let via6 = h.uplink_v6.to_string();
                netns::ip(&inet, &["-6", "route", "add", &b6, "via", &via6])?;
            }
            PublicNeighbors::Proxy => {
                netns::ip(&inet, &["route", "add", &b4, "dev", iif])?;
                netns::ip(&inet, &["-6", "route", "add", &b6, "dev", iif])?;
            }
        }
        // The leg on the private network.
        let port = format!("h{}", h.index);
        let mtu = PRIVATE_MTU.to_string();
        netns::ip(
            ns,
            &[
                "link", "add", PRIVATE_IF, "mtu", &mtu, "type", "veth", "peer", "name", &port,
                "mtu", &mtu, "netns", &private,
            ],
        )?;
        netns::ip(&private, &["link", "set", &port, "master", PRIVATE_BRIDGE])?;
        netns::ip(&private, &["link", "set", &port, "up"])?;
        let p4 = a(v4(h.private_v4), PRIVATE_V4_LEN);
        netns::ip(ns, &["addr", "add", &p4, "dev", PRIVATE_IF])?;
        let p6 = a(v6(h.private_v6), PRIVATE_V6_LEN);
        netns::ip(ns, &["addr", "add", &p6, "dev", PRIVATE_IF, "nodad"])?;
        netns::ip(ns, &["link", "set", PRIVATE_IF, "up"])?;
        Ok(())
    }

    /// The fleet prefix every namespace name starts with.
    #[must_use]
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The hosts, in index order.
    #[must_use]
    pub fn hosts(&self) -> &[HostNet] {
        &self.hosts
    }

    /// The shared fake internet namespace.
    #[must_use]
    pub fn inet(&self) -> String {
        format!("{}inet", self.prefix)
    }

    /// The private network's namespace (holding the bridge).
    #[must_use]
    pub fn private_ns(&self) -> String {
        format!("{}x-priv", self.prefix)
    }

    /// Routes `mesh` (a VM's mesh address on `host`) from the fake internet to that host's
    /// uplink, so IPv6 from the VM to the internet gets its replies.
    ///
    /// # Errors
    /// When the route cannot be added (e.g. another host routes the address already).
    pub fn route_mesh(&self, host: &HostNet, mesh: Ipv6Addr) -> Result<(), SandboxError> {
        route_mesh(&self.inet(), host, mesh)
    }

    /// Starts the echo service in the fake internet ([`ECHO_V4`], [`ECHO_V6`], port
    /// [`ECHO_PORT`], TCP and UDP).
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

    /// Disarms the guard; returns the prefix, for a later [`cleanup`].
    #[must_use]
    pub fn keep(mut self) -> String {
        self.armed = false;
        self.prefix.clone()
    }

    /// What is left of this fleet (see [`leftovers`]).
    #[must_use]
    pub fn leftovers(&self) -> Vec<String> {
        leftovers(&self.prefix)
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        if self.armed
            && let Err(e) = cleanup(&self.prefix)
        {
            eprintln!("fleet {}: cleanup failed: {}", self.prefix, chain(&e));
        }
    }
}

/// Routes `mesh` from the fake internet namespace `inet` to `host`'s uplink (see
/// [`Fleet::route_mesh`]).
///
/// # Errors
/// When the route cannot be added.
pub fn route_mesh(inet: &str, host: &HostNet, mesh: Ipv6Addr) -> Result<(), SandboxError> {
    let dst = format!("{mesh}/128");
    let via = host.uplink_v6.to_string();
    netns::ip(inet, &["-6", "route", "add", &dst, "via", &via])?;
    Ok(())
}

fn no_dad(ns: &str) -> Result<(), SandboxError> {
    netns::sysctl(ns, "net/ipv6/conf/all/accept_dad", "0")?;
    netns::sysctl(ns, "net/ipv6/conf/default/accept_dad", "0")
}

/// The prefixes whose names belong to the fleet `prefix`: the prefix itself and every host
/// prefix `<prefix>1` to `<prefix>4`.
#[must_use]
pub fn prefixes(prefix: &str) -> Vec<String> {
    std::iter::once(prefix.to_owned())
        .chain((1..=MAX_HOSTS).map(|i| format!("{prefix}{i}")))
        .collect()
}

/// The named namespaces of the fleet `prefix`: [`sandbox::owned`] of each of [`prefixes`],
/// sorted.
#[must_use]
pub fn owned(prefix: &str) -> Vec<String> {
    let mut out: Vec<String> = prefixes(prefix)
        .iter()
        .flat_map(|p| sandbox::owned(p))
        .collect();
    out.sort();
    out
}

/// Whether the namespaces of a fleet `prefix` exist (its private network does).
#[must_use]
pub fn exists(prefix: &str) -> bool {
    netns::exists(&format!("{prefix}x-priv"))
}

/// Deletes the namespaces of the fleet `prefix` ([`owned`]); goes on past failures.
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

/// Everything of the fleet `prefix` that still exists ([`sandbox::leftovers`] of each of
/// [`prefixes`]). Empty after a clean teardown.
#[must_use]
pub fn leftovers(prefix: &str) -> Vec<String> {
    prefixes(prefix)
        .iter()
        .flat_map(|p| sandbox::leftovers(p))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_get_distinct_documented_addresses() {
        let h1 = host_net("fq", 1, PublicNeighbors::Routed);
        assert_eq!(h1.prefix, "fq1");
        assert_eq!(h1.ns, "fq1host");
        assert_eq!(h1.public_v4.to_string(), "203.0.113.64/28");
        assert_eq!(h1.public_v6.to_string(), "2001:db8:1::/48");
        assert_eq!(h1.uplink_v4.to_string(), "192.0.2.10");
        assert_eq!(h1.inet_v4.to_string(), "192.0.2.9");
        assert_eq!(h1.uplink_v6.to_string(), "2001:db8:0:1::2");
        assert_eq!(h1.private_v4.to_string(), "10.10.0.1");
        assert_eq!(h1.private_v6.to_string(), "fd00:10::1");
        let all: Vec<HostNet> = (1..=4)
            .map(|i| host_net("fq", i, PublicNeighbors::Proxy))
            .collect();
        assert_eq!(all[3].public_v4.to_string(), "203.0.113.112/28");
        assert_eq!(all[3].uplink_v4.to_string(), "192.0.2.34");
        for (i, a) in all.iter().enumerate() {
            let up4 = Ipv4Net::new(a.uplink_v4, UPLINK_V4_LEN).unwrap().trunc();
            for b in &all[i + 1..] {
                assert!(!a.public_v4.contains(&b.public_v4.network()));
                assert!(!a.public_v6.contains(&b.public_v6.network()));
                assert!(!up4.contains(&b.uplink_v4), "{a:?} {b:?}");
                assert!(!b.prefix.starts_with(&a.prefix) && !a.prefix.starts_with(&b.prefix));
            }
        }
    }

    #[test]
    fn prefixes_are_limited_so_host_prefixes_fit() {
        assert!(check_prefix("vmsbx").is_ok());
        assert!(check_prefix("abcdefghi").is_ok());
        assert!(check_prefix("abcdefghij").unwrap_err().contains("9 bytes"));
        assert!(check_prefix("1abc").is_err());
        assert_eq!(
            prefixes("fq"),
            vec!["fq", "fq1", "fq2", "fq3", "fq4"]
                .into_iter()
                .map(String::from)
                .collect::<Vec<_>>()
        );
        // The host namespaces and an agent's names are those of the host prefix, not of the
        // fleet prefix, and no host owns another's.
        assert!(sandbox::owns("fq1", "fq1host"));
        assert!(sandbox::owns("fq1", "fq1n0007"));
        assert!(!sandbox::owns("fq", "fq1host"));
        assert!(!sandbox::owns("fq2", "fq1n0007"));
        assert!(sandbox::owns("fq", "fqx-priv"));
    }
}
