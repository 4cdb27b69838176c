//! Packet activity as planned kernel state (spec: namespaced-vm-networking.md, "Packet activity
//! and wake").
//!
//! # Design
//! One tc filter per VM: the shared activity program (`activity_out`, loaded once per agent) as
//! a `cls_bpf` direct-action filter on the clsact egress of the VM's tap, at
//! [`FILTER_PRIORITY`] / [`FILTER_HANDLE`]. The tap's egress carries exactly what the guest
//! receives, however it was delivered (routed, NATed, or put on the host veth end by another
//! BPF program), after the VM's firewall: a packet the firewall drops never reached the guest
//! and is not activity. "From the host" means "entered the VM namespace through the VM's veth
//! end": the program finds the VM by the packet's ingress device, registered with the VM's user
//! id by the kernel layer (tap ifindexes repeat across namespaces; the veth ends have derived,
//! distinct ones). A VM without a veth pair has no host path and gets no filter.
//!
//! The plan holds only what is derived from the config: device, priority, handle and the user
//! id. The program id it must run is known only once the agent loaded it; the kernel layer
//! compares the observed filter against that.

use serde::{Deserialize, Serialize};

/// tc filter priority of the activity filter on the tap's egress: a high number, so it runs
/// after filters that might drop a frame (a dropped frame is not activity), and it never ends
/// the chain itself.
pub const FILTER_PRIORITY: u16 = 0xc000;

/// tc filter handle of the activity filter.
pub const FILTER_HANDLE: u32 = 0xac7;

/// The name of the program in the BPF object (and in the filter).
pub const PROGRAM: &str = "activity_out";

/// The activity filter of one VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActivityPlan {
    /// The device whose clsact egress gets the filter (the tap, in the VM netns).
    pub dev: String,
    /// The device host traffic enters the VM netns by (the VM veth end), registered under
    /// [`Self::user_id`] by its ifindex.
    pub ingress_dev: String,
    /// The filter priority ([`FILTER_PRIORITY`]).
    pub priority: u16,
    /// The filter handle ([`FILTER_HANDLE`]).
    pub handle: u32,
    /// The user id the VM's veth end is registered under in the program's maps.
    pub user_id: u32,
}

/// The activity filter for the VM with tap `tap`, VM veth end `peer` and user id `uid`.
#[must_use]
pub fn plan(tap: &str, peer: &str, uid: u32) -> ActivityPlan {
    ActivityPlan {
        dev: tap.to_owned(),
        ingress_dev: peer.to_owned(),
        priority: FILTER_PRIORITY,
        handle: FILTER_HANDLE,
        user_id: uid,
    }
}
