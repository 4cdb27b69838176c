//! The bodies of `GET /v1/mesh` and `POST /v1/sync`.

use serde::{Deserialize, Serialize};
use vmnet_kernel::wg::sockbuf::UdpSocket;
use vmnet_kernel::wg::uapi::UapiPeer;

use super::body::WgKey;
use super::dataplane::DataPlaneView;
use super::plan::RecordPeer;

/// Publishes `mesh_peer_added` for each of `added` and `mesh_peer_removed` for each of
/// `removed`.
pub(crate) fn publish_peers<'a>(
    events: &crate::events::Events,
    added: impl Iterator<Item = &'a super::body::PeerSpec>,
    removed: &[WgKey],
) {
    use crate::events::{EventBody, Subject};
    for p in added {
        let body = EventBody::MeshPeerAdded {
            public_key: p.public_key.to_string(),
            mesh_address: p.mesh_address.to_string(),
            endpoint: p.endpoint.to_string(),
        };
        events.publish(Subject::host(), body);
    }
    for k in removed {
        let body = EventBody::MeshPeerRemoved {
            public_key: k.to_string(),
        };
        events.publish(Subject::host(), body);
    }
}

/// `GET /v1/mesh`: this host's side of the mesh and every peer on the interface.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MeshView {
    /// The interface name.
    pub interface: String,
    /// This host's public key (base64).
    pub public_key: String,
    /// The listen port.
    pub listen_port: u16,
    /// This host's mesh address, when it has one.
    pub mesh_address: Option<String>,
    /// The interface MTU.
    pub mtu: u32,
    /// The pid of the running `wireguard-go`, when one answers.
    pub daemon_pid: Option<u32>,
    /// How often this agent started `wireguard-go` (0 after adopting a running one).
    pub daemon_starts: u64,
    /// The UDP sockets of the running `wireguard-go` with their buffers.
    #[serde(default)]
    pub socket_buffers: Vec<SocketBuffers>,
    /// The managed peers (by key), then the foreign ones.
    pub peers: Vec<PeerView>,
    /// The tenant-0 whitelist of the last sync.
    pub whitelist: Vec<String>,
    /// The BPF data plane's maps and counters (`vmnet serve --mesh-bpf-root`); absent without.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_plane: Option<DataPlaneView>,
    /// The VM registrations this host knows (with the data plane and a mesh address).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registrations: Option<super::locations::RegistrationsView>,
}

/// One UDP socket of `wireguard-go` and its buffers, as the kernel reports them (`SO_RCVBUF`,
/// `SO_SNDBUF`: twice the size set, as `ss -m` shows them in `rb` and `tb`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SocketBuffers {
    /// `ipv4` or `ipv6`.
    pub family: String,
    /// The receive buffer, bytes.
    pub receive_bytes: u64,
    /// The send buffer, bytes.
    pub send_bytes: u64,
}

impl From<&UdpSocket> for SocketBuffers {
    fn from(s: &UdpSocket) -> Self {
        Self {
            family: if s.ipv6 { "ipv6" } else { "ipv4" }.to_owned(),
            receive_bytes: u64::try_from(s.rcvbuf).unwrap_or(u64::MAX),
            send_bytes: u64::try_from(s.sndbuf).unwrap_or(u64::MAX),
        }
    }
}

/// One peer on the interface (or recorded but missing there).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerView {
    /// Its public key (base64).
    pub public_key: String,
    /// True for a peer vmnet did not apply (never touched).
    pub foreign: bool,
    /// The endpoint: the recorded one for a managed peer, the device's for a foreign one.
    pub endpoint: Option<String>,
    /// The recorded mesh address (managed peers only).
    pub mesh_address: Option<String>,
    /// The allowed IPs the device shows.
    pub allowed_ips: Vec<String>,
    /// Whether the peer is on the device.
    pub present: bool,
    /// Whether its /128 route into the interface is there (managed peers only).
    pub route: Option<bool>,
    /// The peer left the set and its removal is not done yet (managed peers only).
    pub leaving: bool,
    /// Seconds since the epoch of the last handshake; `None` before the first.
    pub last_handshake_unix_secs: Option<u64>,
    /// Bytes received from the peer.
    pub rx_bytes: u64,
    /// Bytes sent to the peer.
    pub tx_bytes: u64,
}

impl PeerView {
    /// A managed peer as recorded, with what the device shows of it.
    #[must_use]
    pub fn managed(r: &RecordPeer, d: Option<&UapiPeer>, route: bool) -> Self {
        let mut v = Self::counters(r.spec.public_key, false, d);
        v.endpoint = Some(r.spec.endpoint.to_string());
        v.mesh_address = Some(r.spec.mesh_address.to_string());
        v.route = Some(route);
        v.leaving = r.leaving;
        v
    }

    /// A foreign peer as the device shows it.
    #[must_use]
    pub fn foreign(k: WgKey, d: &UapiPeer) -> Self {
        let mut v = Self::counters(k, true, Some(d));
        v.endpoint = d.endpoint.map(|e| e.to_string());
        v
    }

    fn counters(k: WgKey, foreign: bool, d: Option<&UapiPeer>) -> Self {
        Self {
            public_key: k.to_string(),
            foreign,
            endpoint: None,
            mesh_address: None,
            allowed_ips: d
                .map(|d| d.allowed_ips.iter().map(ToString::to_string).collect())
                .unwrap_or_default(),
            present: d.is_some(),
            route: None,
            leaving: false,
            last_handshake_unix_secs: d.map(|d| d.last_handshake_sec).filter(|s| *s != 0),
            rx_bytes: d.map_or(0, |d| d.rx_bytes),
            tx_bytes: d.map_or(0, |d| d.tx_bytes),
        }
    }
}

/// `POST /v1/sync`: what the sync changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncOutcome {
    /// Managed peers after the sync.
    pub peers: usize,
    /// Peers added to the interface.
    pub added: usize,
    /// Peers rewritten (endpoint or mesh address changed, or drifted).
    pub updated: usize,
    /// Managed peers removed.
    pub removed: usize,
    /// Routes added (new peers, changed addresses, missing routes).
    pub routes_added: usize,
    /// Routes removed.
    pub routes_removed: usize,
    /// Whitelist entries stored.
    pub whitelist: usize,
}

/// The answer of `POST /v1/mesh/vms/sync`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmSyncOutcome {
    /// Mesh addresses whose registration was missing or differed and was written.
    pub written: Vec<String>,
    /// Mesh addresses this host registered but no longer has (removed).
    pub removed: Vec<String>,
}
