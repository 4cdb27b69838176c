//! The guest guard as planned kernel state: what a VM's guest may send, enforced at the first
//! hook its frames reach (design `namespace-mode.md`, "What a VM may send"; the program is the
//! kernel crate's `bpf/guest_guard.bpf.c`).
//!
//! # Design
//! One BPF program for the whole host, attached as the first tc filter on the ingress of every
//! VM's tap (inside the VM netns), and per VM one entry in its map, keyed by the VM's netns: the user id the
//! drops are counted under and what the VM may use as a source ([`GuardPlan`]):
//!
//! - Ethernet: source the guest MAC, EtherType ARP, IPv4 or IPv6;
//! - ARP: from the guest MAC and `172.16.0.2` (`0.0.0.0` in a probe), for the gateway
//!   `172.16.0.1`, the metadata address or the guest's own address;
//! - IPv4: source `172.16.0.2`; no ICMP redirect, router advertisement or DHCP server message;
//! - IPv6: its mesh address, an address inside its routed public block, link-local or `::` for
//!   neighbour discovery and MLD with the namespace only; a gateway VM ([`GuardPlan::gateway`])
//!   also sends packets to a mesh address from sources outside `fdaa::/16`. No other source
//!   inside `fdaa::/16`, no router advertisement, redirect or DHCPv6 server message.
//!
//! A frame that passes is marked ([`GUARD_MARK`]); the VM's nft table drops what the namespace
//! forwards from the tap without the mark ([`nft_commands`]), so a program detached by hand
//! stops the VM's forwarded traffic instead of letting spoofs through, until the reconcile
//! pass attaches it again. The plan holds only what derives from the config; the kernel layer
//! finds the netns and the attachment.
//!
//! A gateway VM is one that routes `::/0` via the host (the mesh registers the same VMs as
//! gateways): only such a VM can carry traffic between the internet and the VMs behind it.

use std::net::Ipv6Addr;

use ipnet::Ipv6Net;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use vmnet_model::vm::VmConfig;

/// The mark bit the guard sets on every frame it passes (in the VM netns only: the mark is
/// cleared when a packet leaves the namespace over the veth pair).
pub const GUARD_MARK: u32 = 0x0040_0000;

/// The name of the program (in the BPF object, and as the kernel lists it).
pub const PROGRAM: &str = "guest_guard";

/// The nft chain (in the VM's netns table) that drops forwarded packets from the tap the guard
/// did not pass.
pub const CHAIN: &str = "guard";

/// The kinds of drops, in the order of the program's counters (`enum kind`).
pub const DROP_KINDS: [&str; 9] = [
    "mac",
    "ethertype",
    "arp",
    "ipv4_source",
    "ipv6_source",
    "mesh_source",
    "link_local",
    "server_message",
    "malformed",
];

/// One VM's entry in the guard's map.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuardPlan {
    /// The tap the program is attached to (in the VM netns).
    pub tap: String,
    /// The user id the VM's drops are counted under.
    pub user_id: u32,
    /// The VM's mesh address, its own IPv6 source.
    pub mesh: Option<Ipv6Addr>,
    /// The VM's routed public IPv6 block, whose addresses it may send from.
    pub block: Option<Ipv6Net>,
    /// Whether it is a gateway VM (routes `::/0` via the host): it may send packets to a mesh
    /// address from sources outside `fdaa::/16`.
    pub gateway: bool,
}

/// The guard entry of VM `cfg` with tap `tap`.
#[must_use]
pub fn plan(cfg: &VmConfig, tap: &str) -> GuardPlan {
    GuardPlan {
        tap: tap.to_owned(),
        user_id: cfg.user_id,
        mesh: cfg.mesh_ipv6,
        block: cfg.public_ipv6_block(),
        gateway: cfg.default_v6_via_host(),
    }
}

/// The chain of the VM netns table `table` that drops every packet forwarded from `tap`
/// without [`GUARD_MARK`] (filter, forward, before the MSS clamp).
pub(crate) fn nft_commands(table: &str, tap: &str) -> Vec<Value> {
    vec![
        json!({"add": {"chain": {"family": "inet", "table": table, "name": CHAIN,
            "type": "filter", "hook": "forward", "prio": -200, "policy": "accept"}}}),
        json!({"add": {"rule": {"family": "inet", "table": table, "chain": CHAIN, "expr": [
            {"match": {"op": "==", "left": {"meta": {"key": "iifname"}}, "right": tap}},
            {"match": {"op": "==", "left": {"&": [{"meta": {"key": "mark"}}, GUARD_MARK]}, "right": 0}},
            {"drop": null}
        ]}}}),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(json: &str) -> VmConfig {
        vmnet_model::vm::parse_vm_config(json.as_bytes()).expect("config")
    }

    #[test]
    fn a_gateway_routes_the_default_via_the_host_and_a_block_is_its_own() {
        let g = plan(
            &cfg(
                r#"{"id":"g","user_id":7,"tenant":1,"mesh_ipv6":"fdaa:1::7","public_ipv6":"2001:db8:7::/56",
                "network":{"routes":[{"destination":"::/0","via":"host"}]}}"#,
            ),
            "vmnt0007",
        );
        assert_eq!(
            g,
            GuardPlan {
                tap: "vmnt0007".into(),
                user_id: 7,
                mesh: Some("fdaa:1::7".parse().unwrap()),
                block: Some("2001:db8:7::/56".parse().unwrap()),
                gateway: true,
            }
        );
        // A mapped /128 is not a block (the host translates it to the mesh address), and a VM
        // routing only part of the internet via the host carries nothing for others.
        let m = plan(
            &cfg(
                r#"{"id":"m","user_id":8,"tenant":1,"mesh_ipv6":"fdaa:1::8","public_ipv6":"2001:db8::8",
                "network":{"routes":[{"destination":"2000::/3","via":"host"}]}}"#,
            ),
            "t",
        );
        assert_eq!((m.block, m.gateway), (None, false));
        let none = plan(
            &cfg(r#"{"id":"n","user_id":9,"tenant":1,"network":{"routes":[]}}"#),
            "t",
        );
        assert_eq!((none.mesh, none.block, none.gateway), (None, None, false));
    }

    #[test]
    fn the_chain_drops_unmarked_packets_from_the_tap() {
        let c = nft_commands("vmn", "vmnt0007");
        assert_eq!(c[0]["add"]["chain"]["hook"], "forward");
        let expr = &c[1]["add"]["rule"]["expr"];
        assert_eq!(expr[0]["match"]["right"], "vmnt0007");
        assert_eq!(expr[1]["match"]["left"]["&"][1], GUARD_MARK);
        assert_eq!(expr[2], json!({"drop": null}));
    }
}
