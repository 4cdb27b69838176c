//! The plan as data: what the kernel layer makes for one VM ([`VmPlan`]) and for the host
//! ([`HostPlan`]).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use serde::{Deserialize, Serialize};
use vmnet_model::vm::Route;

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
    /// `169.254.169.254/32`, where the agent serves the VM's metadata ([`super::metadata`]).
    #[serde(default = "metadata_ipv4")]
    pub metadata_ipv4: Ipv4Net,
}

fn metadata_ipv4() -> Ipv4Net {
    Ipv4Net::from(super::metadata::METADATA_IPV4)
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
    /// The netns's IPv6 next hop to the host (`fe80::1:<uid>/128`). Not an address of the host
    /// end: the netns keeps a permanent neighbour entry mapping it to `host_mac` on the netns
    /// end, so nothing has to be resolved (see [`crate::ns`]).
    pub host_ipv6_link_local: Ipv6Net,
    /// Netns end link-local (`fe80::2/64`), the host's next hop to the VM; the host keeps a
    /// permanent neighbour entry mapping it to `peer_mac` on the host end.
    pub peer_ipv6_link_local: Ipv6Net,
    /// Host end MAC, set when the pair is made ([`super::veth_macs`]).
    pub host_mac: [u8; 6],
    /// Netns end MAC, set when the pair is made ([`super::veth_macs`]).
    pub peer_mac: [u8; 6],
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
    /// Sysctls inside the netns, as (path under `/proc/sys`, value), written before any link
    /// is made there ([`super::sysctls::ns_sysctls`]).
    pub ns_sysctls: Vec<(String, String)>,
    /// The tap's own sysctls that count ([`super::sysctls::tap_sysctls`]): inherited from the
    /// netns defaults at create, read back and repaired.
    #[serde(default)]
    pub tap_sysctls: Vec<(String, String)>,
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
    /// A fingerprint of all of [`Self::nft`] (16 hex digits).
    pub nft_fingerprint: String,
    /// A fingerprint of [`Self::nft`] without the rules of the firewall's `fw_in` and `fw_out`,
    /// stored as the first rule's comment (`vmnet:<shape>`): two plans of the same shape differ
    /// in those rules only, and the kernel layer changes one into the other as one small batch.
    pub nft_shape: String,
    /// The host table of this VM (`host_table_base + uid`).
    pub host_table: u32,
    /// The name prefix (for the nft table name).
    pub name_prefix: String,
    /// The throughput limits: HTB trees on the tap and the VM veth end ([`super::limits`]).
    pub limits: super::limits::LimitsPlan,
    /// The VM's public addresses on the host (`None` without any).
    #[serde(default)]
    pub public: Option<super::public::PublicPlan>,
    /// The firewall's rules, when it filters (enabled, and the VM has a veth); its chains and
    /// sets are in [`Self::nft`].
    #[serde(default)]
    pub firewall: Option<super::firewall::FirewallPlan>,
    /// The metadata document and version ([`super::metadata`]).
    #[serde(default)]
    pub metadata: super::metadata::MetadataPlan,
    /// The VM's packet-activity entry ([`super::activity`]); `None` when the settings
    /// turn activity off.
    #[serde(default)]
    pub activity: Option<super::activity::ActivityPlan>,
    /// The VM's guest-guard entry ([`super::guard`]); `None` when the settings turn the guard
    /// off.
    #[serde(default)]
    pub guard: Option<super::guard::GuardPlan>,
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
    /// elements: see [`super::public::host_ruleset`]).
    #[serde(default)]
    pub pub_nft: serde_json::Value,
    /// The name of that table.
    #[serde(default)]
    pub pub_table: String,
    /// The uplink where proxy neighbour entries live, and `proxy_ndp` is turned on, in proxy mode.
    #[serde(default)]
    pub proxy_uplink: Option<String>,
}
