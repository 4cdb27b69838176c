//! What the mesh runtime knows between syncs, and the conversions between the store's record,
//! the device's peers and the plan's types.

use std::collections::BTreeMap;

use ipnet::IpNet;
use vmnet_ipam::mesh_store::MeshPeerRow;
use vmnet_kernel::wg::uapi::UapiDevice;
use vmnet_model::Error;

use super::body::{PeerSpec, WgKey};
use super::plan::{MeshPlan, RecordPeer, SeenPeer};

/// What the agent last read from or wrote to the device instance `pid` and the record: a sync
/// plans against it instead of reading 1,000 peers back each time. It is dropped when anything
/// fails and not used for another device instance; a full reconcile pass reads everything afresh.
#[derive(Debug)]
pub(super) struct Known {
    pub(super) pid: u32,
    pub(super) seen: BTreeMap<WgKey, SeenPeer>,
    pub(super) record: Vec<RecordPeer>,
    pub(super) whitelist: Vec<String>,
}

impl Known {
    /// `seen` after `p` was applied.
    pub(super) fn applied(
        mut seen: BTreeMap<WgKey, SeenPeer>,
        p: &MeshPlan,
    ) -> BTreeMap<WgKey, SeenPeer> {
        for k in &p.remove {
            seen.remove(k);
        }
        for s in &p.set {
            seen.insert(
                s.public_key,
                SeenPeer {
                    endpoint: Some(s.endpoint),
                    allowed_ips: vec![IpNet::V6(s.mesh_address.into())],
                },
            );
        }
        seen
    }
}

pub(super) fn record_of(rows: Vec<MeshPeerRow>) -> Result<Vec<RecordPeer>, Error> {
    rows.into_iter()
        .map(|r| {
            let bad = |f: &str| Error::internal(format!("mesh record {}: bad {f}", r.public_key));
            Ok(RecordPeer {
                spec: PeerSpec {
                    public_key: r.public_key.parse().map_err(|_| bad("public_key"))?,
                    endpoint: r.endpoint.parse().map_err(|_| bad("endpoint"))?,
                    mesh_address: r.mesh_address.parse().map_err(|_| bad("mesh_address"))?,
                },
                leaving: r.leaving,
            })
        })
        .collect()
}

pub(super) fn row_of(p: &PeerSpec, leaving: bool) -> MeshPeerRow {
    MeshPeerRow {
        public_key: p.public_key.to_string(),
        endpoint: p.endpoint.to_string(),
        mesh_address: p.mesh_address.to_string(),
        leaving,
    }
}

pub(super) fn seen_of(dev: &UapiDevice) -> BTreeMap<WgKey, SeenPeer> {
    dev.peers
        .iter()
        .map(|(k, p)| {
            (
                WgKey(*k),
                SeenPeer {
                    endpoint: p.endpoint,
                    allowed_ips: p.allowed_ips.clone(),
                },
            )
        })
        .collect()
}
