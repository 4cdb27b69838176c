//! The event stream: what the agent did, as it does it, for `GET /v1/events` and
//! `vmnet events`.
//!
//! # Design
//! - One bus per agent ([`bus::Events`]): producers call [`bus::Events::publish`], which never
//!   waits: it numbers the event, keeps it in a bounded ring (the last [`bus::RING_EVENTS`]
//!   events) and hands it to a `tokio::sync::broadcast` channel. Nothing a consumer does reaches
//!   back to a producer: with no consumer an event costs its ring slot; a consumer that falls
//!   behind is cut ([`stream`]), never waited for.
//! - Every event carries the agent's run id (random per start) and a sequence number (per run,
//!   from 1, gap-free in the ring), its time (RFC 3339, UTC, milliseconds), its `kind`, the VM
//!   id and user id when it is about one VM, and the fields of its kind ([`EventBody`]).
//! - The kinds are one list ([`event_kinds!`]): adding a kind is one line there (its name and
//!   fields) plus the `publish` call where it happens; the name list the API validates filters
//!   against ([`KINDS`]) and [`EventBody::kind`] come from the same line.
//! - The stream is NDJSON (`application/x-ndjson`), one JSON object per line, each written as
//!   soon as it is published. NDJSON rather than server-sent events: the API's clients are the
//!   CLI, scripts and `curl --unix-socket … | jq` on a unix socket, where a line of JSON is read
//!   as is, while SSE's `data:` framing and its reconnect protocol serve browsers, which cannot
//!   reach this socket; resuming is `since=SEQ`.
//! - Spoof drops are read from the guest guard's per-VM counters every
//!   [`spoof::SPOOF_SUMMARY_SECS`] while someone listens, and published as one summary per VM
//!   per interval with what moved ([`spoof`]).
//!
//! # Limitations
//! - Events live in memory: a restarted agent starts a new run at sequence 1 with an empty
//!   ring (a position of the old run is refused, [`bus`]).
//! - An event is published after the change it reports; a change whose answer was lost (the
//!   agent killed mid-change) may have no event.

pub mod bus;
pub mod spoof;
pub mod stream;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use vmnet_kernel::ns::{Change, Side};
use vmnet_model::ErrorCode;

pub use bus::Events;

/// What made the agent act.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Trigger {
    /// An API request (`PUT`, `DELETE`).
    Api,
    /// A reconcile pass (periodic, at start, or on a lost notification).
    Pass,
    /// A kernel change notification about the object.
    Notification,
    /// The periodic firewall audit.
    Audit,
}

impl From<crate::repairs::Trigger> for Trigger {
    fn from(t: crate::repairs::Trigger) -> Self {
        match t {
            crate::repairs::Trigger::Notification => Self::Notification,
            crate::repairs::Trigger::Pass => Self::Pass,
        }
    }
}

/// How a VM came to be applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Applied {
    /// The VM was not applied before (a new VM, or one applied for the first time).
    Created,
    /// The VM's config changed, or a VM that had failed is applied again.
    Changed,
}

/// The mode of a spoof-drop summary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GuardMode {
    /// Namespace mode's guest guard: counts per VM.
    Namespace,
    /// Pool mode's tap guard: counts for the whole host.
    Pool,
}

/// Declares the event kinds: one line per kind, `Variant = "name" { field: Type, … }`. Makes
/// [`EventBody`] (tagged by `kind`), [`KINDS`] and [`EventBody::kind`] from that one list.
macro_rules! event_kinds {
    ($( $(#[$doc:meta])* $variant:ident = $name:literal { $( $(#[$fdoc:meta])* $field:ident : $ty:ty ),* $(,)? } ),* $(,)?) => {
        /// The kind of an event and its kind-specific fields (see the module docs).
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(tag = "kind")]
        pub enum EventBody {
            $( $(#[$doc])* #[serde(rename = $name)] $variant { $( $(#[$fdoc])* $field: $ty ),* } ),*
        }

        /// Every event kind's name, in declaration order.
        pub const KINDS: &[&str] = &[$($name),*];

        impl EventBody {
            /// This event's kind name.
            #[must_use]
            pub fn kind(&self) -> &'static str {
                match self { $( Self::$variant { .. } => $name ),* }
            }
        }
    };
}

event_kinds! {
    /// A VM's config was applied (created or changed).
    VmApplied = "vm_applied" {
        /// Created or changed.
        change: Applied,
        /// Who applied it: the API, or a pass (a VM that had failed, or one new at start).
        trigger: Trigger,
    },
    /// A VM was deleted: its kernel objects and its row are gone.
    VmDeleted = "vm_deleted" {},
    /// Applying a VM failed; the previous good config stays applied (or, for a new VM,
    /// nothing of it is left).
    VmFailed = "vm_failed" {
        /// The documented error code (`UNAVAILABLE`, …).
        code: ErrorCode,
        /// The error, naming the object.
        message: String,
        /// Who applied it.
        trigger: Trigger,
    },
    /// Something vmnet owns was found changed behind its back and was repaired (found and
    /// repaired are one step: the apply that observes the difference writes it back).
    DriftRepaired = "drift_repaired" {
        /// The kinds of object put back (`link`, `address`, `route`, `nft_rule`, …; the
        /// names of the repair counters), or `mesh` or `pool_tables`.
        objects: Vec<String>,
        /// Where: `host`, or the VM's netns name.
        netns: String,
        /// Whether a kernel notification or a pass found it.
        trigger: Trigger,
        /// The repair, as the agent logs it.
        detail: String,
    },
    /// A VM's firewall filter table differed from its config and was replaced.
    FirewallRepaired = "firewall_repaired" {
        /// The audit, a pass or a notification.
        trigger: Trigger,
        /// How the table differed, one line each.
        differences: Vec<String>,
    },
    /// A mesh peer was added to the WireGuard interface.
    MeshPeerAdded = "mesh_peer_added" {
        /// The peer's public key (base64).
        public_key: String,
        /// The peer host's mesh address.
        mesh_address: String,
        /// The peer's endpoint.
        endpoint: String,
    },
    /// A managed mesh peer was removed from the WireGuard interface.
    MeshPeerRemoved = "mesh_peer_removed" {
        /// The peer's public key (base64).
        public_key: String,
    },
    /// A provider pool's poll failed; its machines keep their last good addresses, stale.
    ProviderPollFailed = "provider_poll_failed" {
        /// The pool id.
        pool: String,
        /// The provider (`hetzner`, `proxmox`).
        provider: String,
        /// The pool's state after the poll (`failing`, `auth_failed`, `degraded`).
        state: String,
        /// The failure's kind (`timeout`, `http_5xx`, `store`, …).
        error_kind: String,
        /// The failure, as in `GET /v1/status` (never a credential).
        error: String,
    },
    /// A packet that counts as activity (TCP from the host side) arrived for a VM whose tap
    /// has no VMM: it is held, with what follows, until the VMM attaches. At most one per VM
    /// per wake interval. The flow is the packet's as the guest would receive it.
    VmWake = "vm_wake" {
        /// The IP protocol number (6: TCP).
        protocol: u8,
        /// The source address.
        src: String,
        /// The source port.
        src_port: u16,
        /// The destination address.
        dst: String,
        /// The destination port.
        dst_port: u16,
        /// Frames the VM holds now, this one included.
        held: u64,
    },
    /// A sleeping VM's VMM attached and its held frames were sent to the guest.
    HeldDelivered = "held_delivered" {
        /// Frames delivered.
        delivered: u64,
        /// Frames the kernel refused (too long for the tap, its queue full).
        refused: u64,
        /// How long the oldest of them was held, in milliseconds.
        waited_ms: u64,
    },
    /// Frames a guard dropped of what guests sent during the last interval, by kind (only
    /// the kinds that moved): per VM in namespace mode, for the whole host in pool mode.
    SpoofDrops = "spoof_drops" {
        /// Which guard counted them.
        mode: GuardMode,
        /// The interval the counts cover, in seconds.
        interval_secs: u64,
        /// Drops by kind in the interval.
        drops: BTreeMap<String, u64>,
    },
}

/// The VM an event is about, if any.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Subject {
    /// The VM id.
    pub vm: Option<String>,
    /// The VM's user id.
    pub user_id: Option<u32>,
}

impl Subject {
    /// About VM `id` with user id `uid`.
    #[must_use]
    pub fn vm(id: &str, uid: u32) -> Self {
        Self {
            vm: Some(id.to_owned()),
            user_id: Some(uid),
        }
    }

    /// About the host (no VM).
    #[must_use]
    pub fn host() -> Self {
        Self::default()
    }
}

/// One published event: the envelope and its kind's fields, serialized flat
/// (`{"seq":1,"time":"…","vm":"a","user_id":7,"kind":"vm_applied",…}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// The agent's run (random per start, [`bus::Run`]): with `seq`, the event's position.
    pub run: String,
    /// The agent's sequence number of the event, from 1 in each run.
    pub seq: u64,
    /// When it was published: RFC 3339, UTC, milliseconds.
    pub time: String,
    /// The VM id, for an event about one VM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm: Option<String>,
    /// The VM's user id, for an event about one VM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_id: Option<u32>,
    /// The kind and its fields.
    #[serde(flatten)]
    pub body: EventBody,
}

/// Where one drift repair happened: `host`, or the VM's netns `netns`.
#[must_use]
pub fn drift_place(change: &Change, netns: &str) -> String {
    let host = match change {
        Change::AddVeth { .. } | Change::DelVeth { .. } => true,
        Change::AddRoute(s, _)
        | Change::DelRoute(s, _)
        | Change::AddRule(s, _)
        | Change::DelRule(s, _) => *s == Side::Host,
        Change::Repair { what } => what.starts_with("host: "),
        _ => false,
    };
    if host { "host" } else { netns }.to_owned()
}

/// The kinds of object one repair put back ([`Change::kinds`], the repair counters' names).
#[must_use]
pub fn drift_objects(change: &Change) -> Vec<String> {
    change
        .kinds()
        .iter()
        .map(|k| k.as_str().to_owned())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_serialize_flat_with_their_kind() {
        let e = Event {
            run: "0123456789abcdef".into(),
            seq: 3,
            time: "2025-01-01T00:00:00.000Z".into(),
            vm: Some("a".into()),
            user_id: Some(7),
            body: EventBody::VmApplied {
                change: Applied::Created,
                trigger: Trigger::Api,
            },
        };
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"run":"0123456789abcdef","seq":3,"time":"2025-01-01T00:00:00.000Z","vm":"a","user_id":7,
                "kind":"vm_applied","change":"created","trigger":"api"})
        );
        let back: Event = serde_json::from_value(v).unwrap();
        assert_eq!(back, e);
        let host = Event {
            vm: None,
            user_id: None,
            body: EventBody::MeshPeerRemoved {
                public_key: "k".into(),
            },
            ..e
        };
        let v = serde_json::to_value(&host).unwrap();
        assert!(v.get("vm").is_none() && v.get("user_id").is_none(), "{v}");
        assert_eq!(host.body.kind(), "mesh_peer_removed");
    }

    #[test]
    fn every_kind_is_listed_once() {
        let mut k = KINDS.to_vec();
        k.sort_unstable();
        k.dedup();
        assert_eq!(k.len(), KINDS.len());
        assert!(KINDS.contains(&"drift_repaired") && KINDS.contains(&"spoof_drops"));
    }

    #[test]
    fn drift_repairs_name_their_objects_and_place() {
        let ns = "vmn0007";
        let cases = [
            (
                Change::Repair {
                    what: "vmn0007: tap vmt0007 missing, made again".into(),
                },
                ns,
            ),
            (
                Change::AddRoute(Side::Host, "10.0.0.0/8 table 254".into()),
                "host",
            ),
            (Change::AddRule(Side::Vm, "x".into()), ns),
            (
                Change::Repair {
                    what: "host: add proxy neighbour 203.0.113.5 dev eth0".into(),
                },
                "host",
            ),
            (
                Change::AddVeth {
                    host: "vmh0007".into(),
                    peer: "vmp0007".into(),
                },
                "host",
            ),
        ];
        for (c, at) in cases {
            assert_eq!(drift_place(&c, ns), at, "{c}");
            assert!(!drift_objects(&c).is_empty(), "{c}");
        }
        assert_eq!(
            drift_objects(&Change::AddRoute(Side::Vm, "r".into())),
            ["route"]
        );
    }
}
