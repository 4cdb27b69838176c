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
//!   1380, MACs `06:01:<uid>` / `06:02:<uid>` ([`veth_macs`]), the transit /30
//!   `transit_ipv4 + 4·uid` (host `.1`, netns `.2`), `fe80::2/64` on the netns end (no DAD) and
//!   no IPv6 address on the host end. Each side reaches the other's link-local through a
//!   permanent neighbour entry: the netns maps `fe80::1:<uid>` ([`host_veth_link_local`]) to the
//!   host end's MAC, the host maps `fe80::2` to the netns end's MAC. So the host's IPv6 routing
//!   table holds one route per VM (its mesh /128), not three, which is what a link event on the
//!   host walks;
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
//! - throughput limits ([`limits`]): HTB trees on the tap and the VM end of the veth.
//!
//! - the firewall ([`firewall`]): filter chains in the same netns table, and the rules in
//!   [`VmPlan::firewall`] for the kernel layer's conntrack sweep.
//!
//! - the metadata service ([`metadata`]): the document in [`VmPlan::metadata`], and
//!   169.254.169.254/32 on the tap where the agent serves it;
//! - packet activity ([`activity`]): with [`NsSettings::activity`], the VM's entry in the
//!   shared activity program's map (its tap and veth end), in [`VmPlan::activity`].
//! - the guest guard ([`guard`]): with [`NsSettings::guard`], the VM's entry in the shared
//!   guard program's map (what its guest may send), in [`VmPlan::guard`], and the chain of its
//!   netns table that drops forwarded packets the guard did not pass;
//! - sysctls ([`sysctls`]): forwarding on, and router advertisements, redirects, source routes,
//!   proxy ARP/NDP and unsolicited ARP ignored, namespace-wide and on the tap.
//!
//! Later features slot in as more optional sections of [`VmPlan`].
//!
//! # Limitations
//! The guest's IPv6 gateway is the link-local `fe80::1` on the tap; the guest image must use it.

pub mod activity;
mod build;
pub mod diff;
pub mod firewall;
pub mod guard;
pub mod limits;
pub mod metadata;
pub mod names;
pub(crate) mod nft;
pub mod public;
mod settings;
pub mod sysctls;
mod topology;
mod types;

pub use build::{plan_host, plan_vm};
pub use names::{NameKind, name, parse_uid};
pub use nft::FINGERPRINT_PREFIX;
pub use public::{PublicNeighbors, PublicPlan};
pub use settings::NsSettings;
pub use topology::*;
pub use types::*;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod public_tests;

#[cfg(test)]
mod firewall_tests;
