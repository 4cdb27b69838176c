//! The plan of a sync (pure data): what changes on wg0, in its routes and in the record, given
//! the desired peer set, the record of what the agent applied, and what wg0 shows.
//!
//! # Ownership
//! A peer is *managed* when the record holds it (including a peer that left the set and whose
//! removal is not confirmed yet, `leaving`). Every other peer on wg0 is *foreign* and is never
//! changed: a sync that names a foreign peer's key, or a mesh address a foreign peer has among
//! its allowed IPs, is refused (`CONFLICT`) instead of silently taking it over. A route into wg0
//! is the agent's when its destination is a managed peer's mesh address; other routes into wg0
//! are left alone.
//!
//! # What is rewritten
//! A desired peer is written to wg0 only when it is missing there or differs (endpoint, or
//! allowed IPs other than exactly its mesh address /128); a managed peer that left is removed;
//! a desired mesh route that is missing is added; the route of a managed address that is no
//! longer desired is deleted. An unchanged peer costs nothing, so a no-op sync writes nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv6Addr, SocketAddr};

use ipnet::{IpNet, Ipv6Net};
use vmnet_model::Error;

use super::body::{PeerSpec, WgKey};

/// One row of the record: a peer the agent applied (or is applying).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordPeer {
    /// The peer as last desired.
    pub spec: PeerSpec,
    /// The peer left the set; its removal from wg0 is not confirmed yet.
    pub leaving: bool,
}

/// What wg0 shows of one peer.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SeenPeer {
    /// Its endpoint, if set.
    pub endpoint: Option<SocketAddr>,
    /// Its allowed IPs.
    pub allowed_ips: Vec<IpNet>,
}

/// The changes of one sync or reconcile pass.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MeshPlan {
    /// Peers to write (added or changed), each with its full config.
    pub set: Vec<PeerSpec>,
    /// Managed peers to remove from wg0.
    pub remove: Vec<WgKey>,
    /// /128 routes into wg0 to add.
    pub routes_add: Vec<Ipv6Addr>,
    /// /128 routes into wg0 to delete.
    pub routes_del: Vec<Ipv6Addr>,
}

impl MeshPlan {
    /// Whether the plan changes nothing.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.set.is_empty()
            && self.remove.is_empty()
            && self.routes_add.is_empty()
            && self.routes_del.is_empty()
    }
}

/// The record changes of a sync (pure data): rows to insert or update, rows to mark leaving.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RecordDiff {
    /// New or changed rows (written with `leaving` false).
    pub upsert: Vec<PeerSpec>,
    /// Keys of rows that left the set (kept, marked leaving, until their removal is done).
    pub leave: Vec<WgKey>,
}

impl RecordDiff {
    /// Whether nothing changes.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.upsert.is_empty() && self.leave.is_empty()
    }
}

fn wants(spec: &PeerSpec) -> IpNet {
    IpNet::V6(Ipv6Net::from(spec.mesh_address))
}

/// The record changes that take `record` to `desired`.
#[must_use]
pub fn record_diff(desired: &[PeerSpec], record: &[RecordPeer]) -> RecordDiff {
    let old: BTreeMap<WgKey, &RecordPeer> = record.iter().map(|r| (r.spec.public_key, r)).collect();
    let keep: BTreeSet<WgKey> = desired.iter().map(|p| p.public_key).collect();
    RecordDiff {
        upsert: desired
            .iter()
            .filter(|p| {
                old.get(&p.public_key)
                    .is_none_or(|r| r.leaving || r.spec != **p)
            })
            .cloned()
            .collect(),
        leave: record
            .iter()
            .filter(|r| !r.leaving && !keep.contains(&r.spec.public_key))
            .map(|r| r.spec.public_key)
            .collect(),
    }
}

/// The plan taking wg0 (`seen` peers, `routes` = the /128 destinations routed into wg0) to
/// `desired`, given the `record` as it was before this sync.
///
/// # Errors
/// `CONFLICT` when a desired peer is a foreign peer of wg0, or a desired mesh address is among a
/// foreign peer's allowed IPs.
pub fn plan(
    desired: &[PeerSpec],
    record: &[RecordPeer],
    seen: &BTreeMap<WgKey, SeenPeer>,
    routes: &BTreeSet<Ipv6Addr>,
) -> Result<MeshPlan, Error> {
    let managed: BTreeSet<WgKey> = record.iter().map(|r| r.spec.public_key).collect();
    let desired_keys: BTreeSet<WgKey> = desired.iter().map(|p| p.public_key).collect();
    // Foreign peers: on wg0, not in the record.
    let mut foreign_ips: BTreeMap<IpNet, WgKey> = BTreeMap::new();
    for (k, p) in seen.iter().filter(|(k, _)| !managed.contains(k)) {
        if desired_keys.contains(k) {
            return Err(Error::conflict(format!(
                "sync: peer {k} is on wg0 but was not added by vmnet (a foreign peer); remove it first or leave it out of the sync"
            )));
        }
        for ip in &p.allowed_ips {
            foreign_ips.insert(*ip, *k);
        }
    }
    let mut out = MeshPlan::default();
    for p in desired {
        let want = wants(p);
        if let Some(f) = (!foreign_ips.is_empty())
            .then(|| {
                foreign_ips
                    .iter()
                    .find(|(ip, _)| ip.contains(&want.addr()))
                    .map(|(_, k)| k)
            })
            .flatten()
        {
            return Err(Error::conflict(format!(
                "sync: peer {}: mesh_address {} is an allowed IP of the foreign peer {f} on wg0",
                p.public_key, p.mesh_address
            )));
        }
        let same = seen
            .get(&p.public_key)
            .is_some_and(|s| s.endpoint == Some(p.endpoint) && s.allowed_ips.as_slice() == [want]);
        if !same {
            out.set.push(p.clone());
        }
        if !routes.contains(&p.mesh_address) {
            out.routes_add.push(p.mesh_address);
        }
    }
    let desired_mesh: BTreeSet<Ipv6Addr> = desired.iter().map(|p| p.mesh_address).collect();
    for r in record {
        let k = r.spec.public_key;
        if !desired_keys.contains(&k) && seen.contains_key(&k) {
            out.remove.push(k);
        }
        let m = r.spec.mesh_address;
        if !desired_mesh.contains(&m) && routes.contains(&m) && !out.routes_del.contains(&m) {
            out.routes_del.push(m);
        }
    }
    Ok(out)
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;
