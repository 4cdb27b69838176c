//! A simulated guest: a namespace whose `eth0` is a tap joined to a VM's tap by a [`Relay`],
//! configured as the guest image configures itself (spec: namespaced-vm-networking.md,
//! "Topology"): the guest MAC, 172.16.0.2/30, MTU 1380, default route via 172.16.0.1, and
//! optionally the mesh IPv6 /128 (no DAD, so it works at once) with IPv6 routes.

use std::net::{Ipv4Addr, Ipv6Addr};

use crate::relay::Relay;
use crate::{Sandbox, SandboxError, netns};

/// The guest's IPv4 address in every VM.
pub const GUEST_V4: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 2);
/// The gateway (the VM namespace's tap address).
pub const GATEWAY_V4: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 1);
/// The guest's MAC in every VM.
pub const GUEST_MAC: &str = "06:00:ac:10:00:02";
/// The guest MTU.
pub const GUEST_MTU: u32 = 1380;
/// The guest interface name.
pub const GUEST_IF: &str = "eth0";

/// An IPv6 route in the guest: `destination` (e.g. `"::/0"`, `"2000::/3"`) via `via`, or on-link
/// through `eth0` when `via` is `None`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestRoute6 {
    /// The destination prefix, as `ip` accepts it.
    pub destination: String,
    /// The next hop; `None` for an on-link route.
    pub via: Option<Ipv6Addr>,
}

/// How the guest configures `eth0`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestConfig {
    /// The MAC address.
    pub mac: String,
    /// The IPv4 address (a /30 is configured).
    pub ipv4: Ipv4Addr,
    /// The IPv4 default gateway; `None` for no IPv4 default route.
    pub gateway_v4: Option<Ipv4Addr>,
    /// The MTU in bytes.
    pub mtu: u32,
    /// The mesh address (configured as a /128 with `nodad`).
    pub mesh_ipv6: Option<Ipv6Addr>,
    /// IPv6 routes.
    pub routes_v6: Vec<GuestRoute6>,
}

impl Default for GuestConfig {
    /// The fixed guest of the spec: [`GUEST_MAC`], [`GUEST_V4`], default via [`GATEWAY_V4`],
    /// MTU [`GUEST_MTU`], no mesh address.
    fn default() -> Self {
        Self {
            mac: GUEST_MAC.into(),
            ipv4: GUEST_V4,
            gateway_v4: Some(GATEWAY_V4),
            mtu: GUEST_MTU,
            mesh_ipv6: None,
            routes_v6: Vec::new(),
        }
    }
}

/// Configures the interface `ifname` (already present, e.g. created by a relay) in `ns` as
/// `cfg` says: MAC, MTU, addresses, up, routes. DAD is switched off in `ns` first.
///
/// The addresses are in place before the link comes up, and the link announces them when it
/// does (`arp_notify`, `ndisc_notify`: a gratuitous ARP and an unsolicited neighbour
/// advertisement), as a booting guest makes itself known by its first packets: a VM netns that
/// already tried to resolve the guest (traffic arriving for it while it was still down) learns
/// it at once instead of at its next solicitation, a second later.
///
/// # Errors
/// The first `ip` command or sysctl that fails.
pub fn configure(ns: &str, ifname: &str, cfg: &GuestConfig) -> Result<(), SandboxError> {
    netns::sysctl(ns, "net/ipv6/conf/all/accept_dad", "0")?;
    netns::sysctl(ns, "net/ipv6/conf/default/accept_dad", "0")?;
    netns::sysctl(ns, &format!("net/ipv6/conf/{ifname}/accept_dad"), "0")?;
    netns::sysctl(ns, &format!("net/ipv4/conf/{ifname}/arp_notify"), "1")?;
    netns::sysctl(ns, &format!("net/ipv6/conf/{ifname}/ndisc_notify"), "1")?;
    netns::ip(
        ns,
        &[
            "link",
            "set",
            ifname,
            "address",
            &cfg.mac,
            "mtu",
            &cfg.mtu.to_string(),
        ],
    )?;
    netns::ip(
        ns,
        &["addr", "add", &format!("{}/30", cfg.ipv4), "dev", ifname],
    )?;
    if let Some(mesh) = cfg.mesh_ipv6 {
        netns::ip(
            ns,
            &[
                "-6",
                "addr",
                "add",
                &format!("{mesh}/128"),
                "dev",
                ifname,
                "nodad",
            ],
        )?;
    }
    netns::ip(ns, &["link", "set", ifname, "up"])?;
    if let Some(gw) = cfg.gateway_v4 {
        netns::ip(
            ns,
            &[
                "route",
                "add",
                "default",
                "via",
                &gw.to_string(),
                "dev",
                ifname,
            ],
        )?;
    }
    for r in &cfg.routes_v6 {
        let mut args = vec!["-6", "route", "add", r.destination.as_str()];
        let via = r.via.map(|v| v.to_string());
        if let Some(v) = &via {
            args.extend(["via", v.as_str()]);
        }
        args.extend(["dev", ifname]);
        netns::ip(ns, &args)?;
    }
    Ok(())
}

/// A simulated guest attached to a VM's tap by an in-process relay. Dropping it stops the
/// relay (the guest's `eth0` disappears); the namespace goes with the sandbox.
#[derive(Debug)]
pub struct SimGuest {
    netns: String,
    relay: Relay,
}

impl SimGuest {
    /// Creates the guest namespace `<prefix>x-g-<name>` in `sandbox`, attaches to the tap `tap`
    /// in `vm_ns` as a VMM does, and configures the guest's `eth0` with `cfg`.
    ///
    /// # Errors
    /// When the namespace, the taps or the configuration fail.
    pub fn attach(
        sandbox: &Sandbox,
        name: &str,
        vm_ns: &str,
        tap: &str,
        cfg: &GuestConfig,
    ) -> Result<Self, SandboxError> {
        let ns = sandbox.add_netns(&format!("g-{name}"))?;
        Self::attach_in(&ns, vm_ns, tap, cfg)
    }

    /// As [`SimGuest::attach`], into an existing guest namespace `guest_ns` (which must not have
    /// an `eth0` yet).
    ///
    /// # Errors
    /// When the taps or the configuration fail.
    pub fn attach_in(
        guest_ns: &str,
        vm_ns: &str,
        tap: &str,
        cfg: &GuestConfig,
    ) -> Result<Self, SandboxError> {
        let relay = Relay::start(vm_ns, tap, guest_ns, GUEST_IF)?;
        configure(guest_ns, GUEST_IF, cfg)?;
        Ok(Self {
            netns: guest_ns.to_owned(),
            relay,
        })
    }

    /// The guest's namespace (run traffic checks here).
    #[must_use]
    pub fn netns(&self) -> &str {
        &self.netns
    }

    /// The relay, for its frame counters.
    #[must_use]
    pub fn relay(&self) -> &Relay {
        &self.relay
    }
}
