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
