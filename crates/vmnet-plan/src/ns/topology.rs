//! The fixed addresses of every VM's namespace (the same in each, so no allocator is needed) and
//! the link-locals of the veth pair. A leaf module.

use std::net::{Ipv4Addr, Ipv6Addr};

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

/// The link-local address that stands for the host end of VM `uid`'s veth: `fe80::1:<uid>`, the
/// next hop of the netns's IPv6 routes to the host. The host end does not carry it: the netns
/// resolves it through a permanent neighbour entry (see [`super::VethPlan`]). Unique per VM so
/// that no two VMs' gateways look alike in logs and listings, and never one of the netns's own
/// addresses (the kernel refuses a local address as a gateway).
#[must_use]
pub fn host_veth_link_local(uid: u32) -> Ipv6Addr {
    let hi = u16::try_from(uid >> 16).unwrap_or(u16::MAX);
    let lo = u16::try_from(uid & 0xffff).unwrap_or(u16::MAX);
    Ipv6Addr::new(0xfe80, 0, 0, 0, 0, hi, 1, lo)
}
/// The MACs of VM `uid`'s veth ends, `(host end, netns end)`: `06:01:` and `06:02:` (locally
/// administered, unicast; the guest's is `06:00:…`) followed by the uid in four bytes, big
/// endian. Set when the pair is made, so the permanent neighbour entry each side keeps for the
/// other is known before either end exists.
#[must_use]
pub fn veth_macs(uid: u32) -> ([u8; 6], [u8; 6]) {
    let [a, b, c, d] = uid.to_be_bytes();
    ([0x06, 0x01, a, b, c, d], [0x06, 0x02, a, b, c, d])
}
/// The link-local address of the netns end of every veth.
pub const PEER_LINK_LOCAL: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 2);
/// The routing table number of the main table.
pub const MAIN_TABLE: u32 = 254;
