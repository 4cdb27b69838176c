//! Packet activity as planned kernel state (spec: namespaced-vm-networking.md, "Packet activity
//! and wake").
//!
//! # Design
//! One BPF program for the whole host, attached once (a BTF tracepoint on `net_dev_queue`, the
//! kernel's tracepoint for every frame queued for transmission on any device), and per VM one
//! entry in its map, keyed by the VM's netns: its user id, its veth end and its tap (by
//! ifindex). The program records a frame when it is queued on the VM's tap, which carries
//! exactly what the guest receives however it was delivered (routed, NATed, or put on the host
//! veth end by another BPF program), after the VM's firewall: a packet the firewall drops never
//! reached the guest and is not activity. "From the host" means "entered the VM namespace through the VM's
//! veth end": the packet's ingress device. A VM without a veth pair has no host path and gets no
//! entry.
//!
//! Earlier versions put a `cls_bpf` filter on each tap's clsact egress instead (at
//! [`LEGACY_FILTER_PRIORITY`] / [`LEGACY_FILTER_HANDLE`], running [`LEGACY_PROGRAM`]). Every
//! such filter costs the kernel two tc blocks, and binding a block searches a list of every
//! block on the host, so each new VM cost a little more than the last. The kernel layer
//! removes a filter of that kind it finds on a tap.
//!
//! The plan holds only what is derived from the config: the two devices and the user id. Their
//! ifindexes are known once they exist; the kernel layer compares the map entry against them.

use serde::{Deserialize, Serialize};

/// tc filter priority of the per-tap activity filter of earlier versions.
pub const LEGACY_FILTER_PRIORITY: u16 = 0xc000;

/// tc filter handle of the per-tap activity filter of earlier versions.
pub const LEGACY_FILTER_HANDLE: u32 = 0xac7;

/// The name of the program of the per-tap filter of earlier versions.
pub const LEGACY_PROGRAM: &str = "activity_out";

/// The name of the program in the BPF object (and as the kernel lists it).
pub const PROGRAM: &str = "activity_xmit";

/// The kernel tracepoint the program is attached to.
pub const TRACEPOINT: &str = "net_dev_queue";

/// The packet-activity entry of one VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActivityPlan {
    /// The device whose queued frames are the guest's (the tap, in the VM netns).
    pub dev: String,
    /// The device host traffic enters the VM netns by (the VM veth end), registered with
    /// [`Self::user_id`] by its ifindex.
    pub ingress_dev: String,
    /// The user id the VM's netns is registered with in the program's maps.
    pub user_id: u32,
}

/// The activity entry for the VM with tap `tap`, VM veth end `peer` and user id `uid`.
#[must_use]
pub fn plan(tap: &str, peer: &str, uid: u32) -> ActivityPlan {
    ActivityPlan {
        dev: tap.to_owned(),
        ingress_dev: peer.to_owned(),
        user_id: uid,
    }
}
