//! Kernel drivers for vmnet: one module per subsystem (namespaces, netlink links/addresses/routes,
//! taps, nftables), each able to observe the real state, diff it against a plan from
//! `vmnet-plan` and apply the ordered changes. This crate never decides policy.

/// Packet activity: the shared tc BPF program recording the last host-to-guest TCP per VM.
pub mod activity;
/// The bpffs the BPF drivers pin on, and what else they share.
pub mod bpffs;
/// Conntrack entries deleted over ctnetlink.
pub mod conntrack;
/// The guest guard: the BPF program on each namespace-mode tap that drops what a guest may not
/// send.
pub mod guard;
pub mod keptfd;
pub mod mesh;
mod netlink;
pub mod netns;
/// The netfilter netlink socket shared by conntrack and the nf_tables element lookups.
pub mod nfnl;
/// Keyed lookups of nf_tables set and map elements over netlink.
pub mod nftelem;
/// The nf_tables generation of a namespace: has anything there changed?
pub mod nftgen;
pub mod ns;
pub mod tap;
mod tcfilter;
pub mod wake;
pub mod watch;
pub mod wg;

pub mod pool;
