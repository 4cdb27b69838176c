//! Namespace mode planning: one VM config → the desired kernel state for that VM ([`VmPlan`]).
//!
//! Spec: namespaced-vm-networking.md, "Topology", "Routes", the MTU/MSS paragraph, "Design notes".
//!
//! # Design
//! Everything derives from the settings and the VM user id (no allocator, see [`names`]):
//!
//! - a netns `<prefix>n<uid>` with a persistent tap `<prefix>t<uid>` (MTU 1380, 172.16.0.1/30 and
//!   `fe80::1/64`) for the VMM; the guest is 172.16.0.2/30, MAC 06:00:ac:10:00:02, gateways
//!   172.16.0.1 and `fe80::1`;
//! - with a mesh address, a veth pair `<prefix>h<uid>` (host) / `<prefix>p<uid>` (netns), MTU
//!   1380, the transit /30 `transit_ipv4 + 4·uid` (host `.1`, netns `.2`) and the link-locals
//!   `fe80::1:<uid>` (host, see [`host_veth_link_local`]) / `fe80::2` (netns), both without DAD
//!   so they work at once;
//! - mesh path: host `mesh/128 via fe80::2 dev <host veth>`; netns `mesh/128 dev <tap>`; netns
//!   `fdaa::/16 via fe80::1:<uid> dev <peer>` (mesh peers, always); netns rule `iif <peer>` →
//!   [`names::NS_INBOUND_TABLE`] with `::/0 via mesh dev <tap> onlink`, so anything the host routes
//!   into the VM (its mesh address, or traffic for which it is a gateway VM) reaches the guest;
//! - routes: in the netns every route destination goes to the host (IPv4 `via <host transit>`,
//!   IPv6 `via fe80::1:<uid>`); a VM without routes has only the mesh route. On the host, a VM with a
//!   mesh-via route gets its own table (`host_table_base + uid`) selected by `iif <host veth>`:
//!   mesh-via destinations are unicast via the gateway's mesh address (resolved by the kernel
//!   layer to the next hop that reaches it), `host` destinations and `fdaa::/16` are `throw`
//!   (continue with the main table). Longest prefix wins within the table, and one VM's table
//!   never affects another's.
//! - nftables: one table `inet <prefix>` per netns, replaced atomically: the TCP MSS clamp on
//!   forwarded SYNs both ways (MTU − 40 for IPv4, MTU − 60 for IPv6) and, only when an IPv4 route
//!   uses `host`, SNAT of the guest /30 to the netns transit address.
//! - host-wide ([`HostPlan`]): IPv4/IPv6 forwarding and masquerade of the transit range leaving
//!   the host (so the far end sees the host's uplink address).
//!
//! - public addresses ([`public`]): the host table `inet <prefix>_pub` (part of [`HostPlan`]) with
//!   DNAT/SNAT maps, each VM's elements and proxy neighbour entries in [`VmPlan::public`], its
//!   public /32 and routed block in the host and netns routes, and the netns DNAT of its transit
//!   address to the guest in its table.
//!
//! Later features slot in as more optional sections of [`VmPlan`] (throughput: tc on the host
//! veth; firewall: more chains in the same netns table; metadata: a document; WireGuard: a host
//! section).
//!
//! # Limitations
//! The guest's IPv6 gateway is the link-local `fe80::1` on the tap; the guest image must use it.

pub mod names;
pub(crate) mod nft;
pub mod public;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use serde::{Deserialize, Serialize};
use vmnet_model::Error;
use vmnet_model::vm::{MAX_USER_ID, Route, Via, VmConfig};

pub use names::{NameKind, name, parse_uid};
pub use nft::FINGERPRINT_PREFIX;
pub use public::{PublicNeighbors, PublicPlan};

/// The guest's IPv4 address (the same in every VM).
pub const GUEST_IPV4: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 2);
/// The gateway address on the tap (the same in every VM).
pub const GATEWAY_IPV4: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 1);
/// The prefix length of the tap /30.
pub const TAP_PREFIX_LEN: u8 = 30;
/// The guest MAC, which encodes 172.16.0.2.
pub const GUEST_MAC: [u8; 6] = [0x06, 0x00, 0xac, 0x10, 0x00, 0x02];
/// The link-local address of every tap (the guest's IPv6 gateway, the same in every VM).
pub const HOST_LINK_LOCAL: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);

/// The link-local address of the host end of VM `uid`'s veth: `fe80::1:<uid>`. Unique per VM
/// because all host ends share one namespace, where the kernel hashes IPv6 addresses by value:
/// one address on thousands of links would make every address add walk one long chain.
#[must_use]
pub fn host_veth_link_local(uid: u32) -> Ipv6Addr {
    let hi = u16::try_from(uid >> 16).unwrap_or(u16::MAX);
    let lo = u16::try_from(uid & 0xffff).unwrap_or(u16::MAX);
    Ipv6Addr::new(0xfe80, 0, 0, 0, 0, hi, 1, lo)
}
/// The link-local address of the netns end of every veth.
pub const PEER_LINK_LOCAL: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 2);
/// The routing table number of the main table.
pub const MAIN_TABLE: u32 = 254;

/// Host-level settings of namespace mode.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NsSettings {
    /// The prefix of every derived name (`--name-prefix`), see [`names::check_prefix`]. Default `vmn`.
    pub name_prefix: String,
    /// The transit range; VM `uid` gets the /30 at offset `4·uid`. Default `10.200.0.0/14`, which
    /// holds one /30 for each of the 2^16 supported user ids. A smaller range supports fewer ids.
    pub transit_ipv4: Ipv4Net,
    /// The owner uid of each tap (the VMM's user); `None` leaves it root-only.
    pub tap_owner_uid: Option<u32>,
    /// The owner gid of each tap; `None` sets none.
    pub tap_owner_gid: Option<u32>,
    /// The MTU of the veth pair and the tap, bytes. Default 1380.
    pub mtu: u32,
    /// VM `uid` uses host routing table `host_table_base + uid`. Default `0x0100_0000`.
    pub host_table_base: u32,
    /// The priority of the per-VM host rules. Default 10000.
    pub host_rule_priority: u32,
    /// Whether the driver enables forwarding and masquerades the transit range in the host
    /// netns ([`HostPlan`]). Default true.
    pub manage_host: bool,
    /// The uplink interface (`--uplink`), where proxy ARP/NDP entries live. Default none.
    pub uplink: Option<String>,
    /// How the upstream reaches public addresses (`--public-neighbors`). Default routed.
    pub public_neighbors: PublicNeighbors,
}

impl Default for NsSettings {
    fn default() -> Self {
        Self {
            name_prefix: "vmn".into(),
            transit_ipv4: Ipv4Net::new(Ipv4Addr::new(10, 200, 0, 0), 14).expect("valid prefix"),
            tap_owner_uid: None,
            tap_owner_gid: None,
            mtu: 1380,
            host_table_base: 0x0100_0000,
            host_rule_priority: 10000,
            manage_host: true,
            uplink: None,
            public_neighbors: PublicNeighbors::Routed,
        }
    }
}

impl NsSettings {
    /// The largest user id these settings support: limited by the names (0xffff) and by the
    /// number of /30s in the transit range.
    #[must_use]
    pub fn max_user_id(&self) -> u32 {
        let slots_log2 = 30u32.saturating_sub(u32::from(self.transit_ipv4.prefix_len()));
        let by_range = if slots_log2 >= 32 {
            u32::MAX
        } else {
            (1u32 << slots_log2) - 1
        };
        by_range.min(MAX_USER_ID)
    }

    /// Checks the settings.
    ///
    /// # Errors
    /// `INVALID_INPUT` naming the setting.
    pub fn validate(&self) -> Result<(), Error> {
        names::check_prefix(&self.name_prefix)
            .map_err(|m| Error::invalid(format!("settings: {m}")))?;
        if self.transit_ipv4.trunc() != self.transit_ipv4 || self.transit_ipv4.prefix_len() > 30 {
            return Err(Error::invalid(format!(
                "settings: transit_ipv4 {} must be a canonical prefix of length 30 or shorter",
                self.transit_ipv4
            )));
        }
        let guest_net = Ipv4Net::new(GATEWAY_IPV4, TAP_PREFIX_LEN)
            .expect("valid")
            .trunc();
        if self.transit_ipv4.contains(&guest_net)
            || guest_net.contains(&self.transit_ipv4.network())
        {
            return Err(Error::invalid(format!(
                "settings: transit_ipv4 {} overlaps the guest network {guest_net}",
                self.transit_ipv4
            )));
        }
        if self.public_neighbors == PublicNeighbors::Proxy && self.uplink.is_none() {
            return Err(Error::invalid(
                "settings: public_neighbors proxy needs an uplink (--uplink IFACE) to answer ARP/NDP on",
            ));
        }
        if let Some(u) = &self.uplink
            && (u.is_empty() || u.len() > names::IFNAME_MAX || u.contains(['/', ' ']))
        {
            return Err(Error::invalid(format!(
                "settings: uplink {u:?} is not an interface name (1..=15 bytes, no '/' or space)"
            )));
        }
        if !(1280..=9000).contains(&self.mtu) {
            return Err(Error::invalid(format!(
                "settings: mtu {} must be in 1280..=9000",
                self.mtu
            )));
        }
        if self
            .host_table_base
            .checked_add(MAX_USER_ID)
            .is_none_or(|t| t >= 0xffff_ff00)
            || self.host_table_base <= MAIN_TABLE
        {
            return Err(Error::invalid(format!(
                "settings: host_table_base {} leaves no room for 65536 tables above 255",
                self.host_table_base
            )));
        }
        Ok(())
    }

    /// The transit /30 of `uid` (network address `transit + 4·uid`).
    #[must_use]
    pub fn transit_of(&self, uid: u32) -> Ipv4Net {
        let base = u32::from(self.transit_ipv4.network());
        Ipv4Net::new(Ipv4Addr::from(base + 4 * uid), 30).expect("30 is a valid length")
    }
}

/// One route the kernel layer installs.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PlannedRoute {
    /// Routing table number ([`MAIN_TABLE`] for main).
    pub table: u32,
    /// Destination prefix.
    pub destination: IpNet,
    /// What the route does.
    pub kind: RouteKind,
}

/// What a [`PlannedRoute`] does.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum RouteKind {
    /// Directly on a link (`dev X`, scope link).
    Dev {
        /// The interface name.
        dev: String,
    },
    /// Via a next hop on a link (`via G dev X`, optionally `onlink`).
    Via {
        /// The next hop.
        gateway: IpAddr,
        /// The interface name.
        dev: String,
        /// Whether the next hop is taken as on-link without a covering route.
        onlink: bool,
    },
    /// Via a gateway VM's mesh address: the kernel layer resolves the next hop and device that
    /// reach `mesh` at apply time (on one host: that VM's veth), or installs `unreachable` while
    /// it cannot, and keeps an `unreachable` route of the same destination at a worse metric
    /// beside it, so the traffic never falls through to the uplink.
    ViaMesh {
        /// The gateway VM's mesh address.
        mesh: Ipv6Addr,
    },
    /// `throw`: end the lookup in this table and continue with the next rule (main).
    Throw,
}

/// An IPv6 policy routing rule `iif <iif> lookup <table>` at `priority`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PlannedRule {
    /// The input interface name.
    pub iif: String,
    /// The table to look up.
    pub table: u32,
    /// The rule priority (lower first).
    pub priority: u32,
}

/// The tap inside the VM netns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TapPlan {
    /// Interface name, e.g. `vmnt0007`.
    pub name: String,
    /// Owner uid (`TUNSETOWNER`).
    pub owner_uid: Option<u32>,
    /// Owner gid (`TUNSETGROUP`).
    pub owner_gid: Option<u32>,
    /// MTU, bytes.
    pub mtu: u32,
    /// 172.16.0.1/30.
    pub ipv4: Ipv4Net,
    /// `fe80::1/64`, the guest's IPv6 gateway.
    pub ipv6_link_local: Ipv6Net,
}

/// The veth pair between host and VM netns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VethPlan {
    /// Host end name, e.g. `vmnh0007`.
    pub host_name: String,
    /// Netns end name, e.g. `vmnp0007` (created directly in the netns).
    pub peer_name: String,
    /// MTU of both ends, bytes.
    pub mtu: u32,
    /// The transit /30.
    pub transit: Ipv4Net,
    /// Host end address (`.1/30`).
    pub host_ipv4: Ipv4Net,
    /// Netns end address (`.2/30`), the NAT source.
    pub peer_ipv4: Ipv4Net,
    /// Host end link-local (`fe80::1:<uid>/64`).
    pub host_ipv6_link_local: Ipv6Net,
    /// Netns end link-local (`fe80::2/64`).
    pub peer_ipv6_link_local: Ipv6Net,
}

/// What the guest is configured with (reported in status; the guest image/metadata applies it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestPlan {
    /// 172.16.0.2/30.
    pub ipv4: Ipv4Net,
    /// 172.16.0.1.
    pub ipv4_gateway: Ipv4Addr,
    /// `06:00:ac:10:00:02`.
    pub mac: String,
    /// MTU of the guest's eth0, bytes.
    pub mtu: u32,
    /// The mesh address (/128), if any.
    pub mesh_ipv6: Option<Ipv6Addr>,
    /// `fe80::1`, the guest's IPv6 gateway.
    pub ipv6_gateway: Ipv6Addr,
}

/// The desired kernel state of one VM: plain data, built by [`plan_vm`], applied by the kernel
/// layer (`vmnet_kernel::ns`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmPlan {
    /// The VM id.
    pub vm_id: String,
    /// The VM user id.
    pub user_id: u32,
    /// The tenant.
    pub tenant: u32,
    /// The netns name.
    pub netns: String,
    /// The tap.
    pub tap: TapPlan,
    /// The veth pair; `None` for a VM without a mesh address.
    pub veth: Option<VethPlan>,
    /// The guest's configuration.
    pub guest: GuestPlan,
    /// The configured routes, as given.
    pub routes: Vec<Route>,
    /// Whether the netns NATs IPv4 (an IPv4 route uses `host`).
    pub nat: bool,
    /// Sysctls inside the netns, as (path under `/proc/sys`, value).
    pub ns_sysctls: Vec<(String, String)>,
    /// Routes inside the netns (main and inbound tables), sorted.
    pub ns_routes: Vec<PlannedRoute>,
    /// Rules inside the netns (IPv6).
    pub ns_rules: Vec<PlannedRule>,
    /// Routes in the host netns (the mesh /128 in main, the VM's own table), sorted.
    pub host_routes: Vec<PlannedRoute>,
    /// Rules in the host netns (IPv6), at most one.
    pub host_rules: Vec<PlannedRule>,
    /// The nftables transaction for the netns (`nft -j` input), replacing table `inet <prefix>`.
    pub nft: serde_json::Value,
    /// A fingerprint of [`Self::nft`], stored as the first rule's comment for read-back.
    pub nft_fingerprint: String,
    /// The host table of this VM (`host_table_base + uid`).
    pub host_table: u32,
    /// The name prefix (for the nft table name).
    pub name_prefix: String,
    /// The VM's public addresses on the host (`None` without any).
    #[serde(default)]
    pub public: Option<PublicPlan>,
}

/// The fields the API reports for a VM (spec item 5: netns, veth names, transit /30, tap, guest
/// address and MAC, mesh address, applied routes).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmStatus {
    /// The netns name.
    pub netns: String,
    /// Host veth name (`None` without a mesh address).
    pub host_veth: Option<String>,
    /// Netns veth name.
    pub peer_veth: Option<String>,
    /// The transit /30.
    pub transit: Option<Ipv4Net>,
    /// The tap name.
    pub tap: String,
    /// The guest address (`172.16.0.2/30`).
    pub guest_ipv4: Ipv4Net,
    /// The guest gateway (`172.16.0.1`).
    pub gateway_ipv4: Ipv4Addr,
    /// The guest MAC.
    pub guest_mac: String,
    /// The guest's IPv6 gateway (`fe80::1`).
    pub gateway_ipv6: Ipv6Addr,
    /// The mesh address.
    pub mesh_ipv6: Option<Ipv6Addr>,
    /// The MTU, bytes.
    pub mtu: u32,
    /// Whether IPv4 is NATed in the netns.
    pub nat: bool,
    /// The routes (as applied when the apply succeeded).
    pub routes: Vec<Route>,
    /// The public IPv4 address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public_ipv4: Option<Ipv4Addr>,
    /// The public IPv6: an address (mapped to the mesh address) or a routed block.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public_ipv6: Option<String>,
}

impl VmPlan {
    /// The status fields of this plan.
    #[must_use]
    pub fn status(&self) -> VmStatus {
        VmStatus {
            netns: self.netns.clone(),
            host_veth: self.veth.as_ref().map(|v| v.host_name.clone()),
            peer_veth: self.veth.as_ref().map(|v| v.peer_name.clone()),
            transit: self.veth.as_ref().map(|v| v.transit),
            tap: self.tap.name.clone(),
            guest_ipv4: self.guest.ipv4,
            gateway_ipv4: self.guest.ipv4_gateway,
            guest_mac: self.guest.mac.clone(),
            gateway_ipv6: self.guest.ipv6_gateway,
            mesh_ipv6: self.guest.mesh_ipv6,
            mtu: self.tap.mtu,
            nat: self.nat,
            routes: self.routes.clone(),
            public_ipv4: self.public.as_ref().and_then(|p| p.ipv4),
            public_ipv6: self.public.as_ref().and_then(|p| {
                p.ipv6
                    .map(|a| a.to_string())
                    .or_else(|| p.ipv6_block.map(|b| b.to_string()))
            }),
        }
    }
}

/// Host-wide state of namespace mode (not per VM).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostPlan {
    /// Sysctls in the host netns (forwarding).
    pub sysctls: Vec<(String, String)>,
    /// The nftables transaction replacing table `ip <prefix>_host` (transit masquerade).
    pub nft: serde_json::Value,
    /// A fingerprint of [`Self::nft`], stored as the masquerade rule's comment for read-back.
    pub nft_fingerprint: String,
    /// The name of that table.
    pub nft_table: String,
    /// The transaction replacing table `inet <prefix>_pub` (public addresses, without any VM's
    /// elements: see [`public::host_ruleset`]).
    #[serde(default)]
    pub pub_nft: serde_json::Value,
    /// The name of that table.
    #[serde(default)]
    pub pub_table: String,
    /// The uplink where proxy neighbour entries live, and `proxy_ndp` is turned on, in proxy mode.
    #[serde(default)]
    pub proxy_uplink: Option<String>,
}

/// The host-wide plan, or `None` when `settings.manage_host` is false.
#[must_use]
pub fn plan_host(settings: &NsSettings) -> Option<HostPlan> {
    settings.manage_host.then(|| {
        let nft_table = names::host_nft_table(&settings.name_prefix);
        let (nft, nft_fingerprint) = nft::host_ruleset(&nft_table, settings.transit_ipv4);
        let pub_table = names::pub_nft_table(&settings.name_prefix);
        let proxy_uplink = settings
            .uplink
            .clone()
            .filter(|_| settings.public_neighbors == PublicNeighbors::Proxy);
        let mut sysctls = vec![
            ("net/ipv4/ip_forward".into(), "1".into()),
            ("net/ipv6/conf/all/forwarding".into(), "1".into()),
        ];
        if let Some(u) = &proxy_uplink {
            // NDP proxying on, and proxied answers sent at once (the default delays each by up
            // to 0.8 s).
            sysctls.push((format!("net/ipv6/conf/{u}/proxy_ndp"), "1".into()));
            sysctls.push((format!("net/ipv4/neigh/{u}/proxy_delay"), "0".into()));
            sysctls.push((format!("net/ipv6/neigh/{u}/proxy_delay"), "0".into()));
        }
        HostPlan {
            sysctls,
            nft,
            nft_fingerprint,
            nft_table,
            pub_nft: public::host_ruleset(&pub_table, settings.transit_ipv4),
            pub_table,
            proxy_uplink,
        }
    })
}

fn fmt_mac(m: [u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// Plans one VM.
///
/// # Errors
/// `INVALID_INPUT` when the config breaks a validation rule, the settings are invalid, or the
/// user id is beyond what the transit range supports.
pub fn plan_vm(cfg: &VmConfig, settings: &NsSettings) -> Result<VmPlan, Error> {
    cfg.validate()?;
    settings.validate()?;
    let uid = cfg.user_id;
    if uid > settings.max_user_id() {
        return Err(Error::invalid(format!(
            "vm {}: user_id {uid} is outside the range 0..={} supported by transit range {}",
            cfg.id,
            settings.max_user_id(),
            settings.transit_ipv4
        )));
    }
    let p = settings.name_prefix.as_str();
    let tap = TapPlan {
        name: name(p, NameKind::Tap, uid),
        owner_uid: settings.tap_owner_uid,
        owner_gid: settings.tap_owner_gid,
        mtu: settings.mtu,
        ipv4: Ipv4Net::new(GATEWAY_IPV4, TAP_PREFIX_LEN).expect("valid"),
        ipv6_link_local: Ipv6Net::new(HOST_LINK_LOCAL, 64).expect("valid"),
    };
    let guest = GuestPlan {
        ipv4: Ipv4Net::new(GUEST_IPV4, TAP_PREFIX_LEN).expect("valid"),
        ipv4_gateway: GATEWAY_IPV4,
        mac: fmt_mac(GUEST_MAC),
        mtu: settings.mtu,
        mesh_ipv6: cfg.mesh_ipv6,
        ipv6_gateway: HOST_LINK_LOCAL,
    };
    let veth = cfg.mesh_ipv6.map(|_| {
        let transit = settings.transit_of(uid);
        let net = u32::from(transit.network());
        VethPlan {
            host_name: name(p, NameKind::HostVeth, uid),
            peer_name: name(p, NameKind::PeerVeth, uid),
            mtu: settings.mtu,
            transit,
            host_ipv4: Ipv4Net::new(Ipv4Addr::from(net + 1), 30).expect("valid"),
            peer_ipv4: Ipv4Net::new(Ipv4Addr::from(net + 2), 30).expect("valid"),
            host_ipv6_link_local: Ipv6Net::new(host_veth_link_local(uid), 64).expect("valid"),
            peer_ipv6_link_local: Ipv6Net::new(PEER_LINK_LOCAL, 64).expect("valid"),
        }
    });
    let nat = veth.is_some() && cfg.ipv4_via_host();
    if let Some(a) = cfg.public_ipv4
        && settings.transit_ipv4.contains(&a)
    {
        return Err(Error::invalid(format!(
            "vm {}: public_ipv4 {a} lies in the transit range {}",
            cfg.id, settings.transit_ipv4
        )));
    }
    let host_table = settings.host_table_base + uid;
    let (mut ns_routes, ns_rules, mut host_routes, host_rules) = match (&veth, cfg.mesh_ipv6) {
        (Some(v), Some(mesh)) => {
            route_plan(cfg, v, &tap, mesh, host_table, settings.host_rule_priority)
        }
        _ => (Vec::new(), Vec::new(), Vec::new(), Vec::new()),
    };
    let public = match (&veth, cfg.mesh_ipv6) {
        (Some(v), Some(mesh)) => public::plan(
            cfg,
            settings,
            v,
            &tap,
            mesh,
            &mut ns_routes,
            &mut host_routes,
        ),
        _ => None,
    };
    let table = names::vm_nft_table(p);
    let (nft, nft_fingerprint) = nft::vm_ruleset(
        &table,
        settings.mtu,
        veth.as_ref()
            .filter(|_| nat)
            .map(|v| (v.peer_name.as_str(), v.peer_ipv4.addr())),
        veth.as_ref()
            .filter(|_| cfg.public_ipv4.is_some())
            .map(|v| (v.peer_name.as_str(), v.peer_ipv4.addr())),
    );
    Ok(VmPlan {
        vm_id: cfg.id.clone(),
        user_id: uid,
        tenant: cfg.tenant,
        netns: name(p, NameKind::Netns, uid),
        tap,
        veth,
        guest,
        routes: cfg.network.routes.clone(),
        nat,
        ns_sysctls: vec![
            ("net/ipv4/ip_forward".into(), "1".into()),
            ("net/ipv6/conf/all/forwarding".into(), "1".into()),
        ],
        ns_routes,
        ns_rules,
        host_routes,
        host_rules,
        nft,
        nft_fingerprint,
        host_table,
        name_prefix: p.to_owned(),
        public,
    })
}

type RoutePlan = (
    Vec<PlannedRoute>,
    Vec<PlannedRule>,
    Vec<PlannedRoute>,
    Vec<PlannedRule>,
);

fn route_plan(
    cfg: &VmConfig,
    v: &VethPlan,
    tap: &TapPlan,
    mesh: Ipv6Addr,
    host_table: u32,
    host_rule_priority: u32,
) -> RoutePlan {
    let mesh_range = IpNet::V6(vmnet_model::vm::MESH_RANGE);
    let mesh128 = IpNet::V6(Ipv6Net::new(mesh, 128).expect("valid"));
    let to_host_v6 = |destination| PlannedRoute {
        table: MAIN_TABLE,
        destination,
        kind: RouteKind::Via {
            gateway: IpAddr::V6(v.host_ipv6_link_local.addr()),
            dev: v.peer_name.clone(),
            onlink: false,
        },
    };
    let mut ns = vec![
        PlannedRoute {
            table: MAIN_TABLE,
            destination: mesh128,
            kind: RouteKind::Dev {
                dev: tap.name.clone(),
            },
        },
        to_host_v6(mesh_range),
        PlannedRoute {
            table: names::NS_INBOUND_TABLE,
            destination: "::/0".parse().expect("valid"),
            kind: RouteKind::Via {
                gateway: IpAddr::V6(mesh),
                dev: tap.name.clone(),
                onlink: true,
            },
        },
    ];
    for r in &cfg.network.routes {
        if r.destination == mesh_range {
            continue;
        }
        ns.push(match r.destination {
            IpNet::V4(_) => PlannedRoute {
                table: MAIN_TABLE,
                destination: r.destination,
                kind: RouteKind::Via {
                    gateway: IpAddr::V4(v.host_ipv4.addr()),
                    dev: v.peer_name.clone(),
                    onlink: false,
                },
            },
            IpNet::V6(_) => to_host_v6(r.destination),
        });
    }
    let ns_rules = vec![PlannedRule {
        iif: v.peer_name.clone(),
        table: names::NS_INBOUND_TABLE,
        priority: names::NS_INBOUND_RULE_PRIORITY,
    }];
    let mut host = vec![PlannedRoute {
        table: MAIN_TABLE,
        destination: mesh128,
        kind: RouteKind::Via {
            gateway: IpAddr::V6(PEER_LINK_LOCAL),
            dev: v.host_name.clone(),
            onlink: false,
        },
    }];
    let mut host_rules = Vec::new();
    if cfg
        .network
        .routes
        .iter()
        .any(|r| matches!(r.via, Via::Mesh(_)))
    {
        for r in cfg
            .network
            .routes
            .iter()
            .filter(|r| matches!(r.destination, IpNet::V6(_)))
        {
            let kind = match r.via {
                Via::Host => RouteKind::Throw,
                Via::Mesh(g) => RouteKind::ViaMesh { mesh: g },
            };
            host.push(PlannedRoute {
                table: host_table,
                destination: r.destination,
                kind,
            });
        }
        if !cfg
            .network
            .routes
            .iter()
            .any(|r| r.destination == mesh_range)
        {
            host.push(PlannedRoute {
                table: host_table,
                destination: mesh_range,
                kind: RouteKind::Throw,
            });
        }
        host_rules.push(PlannedRule {
            iif: v.host_name.clone(),
            table: host_table,
            priority: host_rule_priority,
        });
    }
    ns.sort();
    host.sort();
    (ns, ns_rules, host, host_rules)
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod public_tests;
