//! The mesh interface on this host: `wireguard-go` supervised, the managed peers and their /128
//! routes converged to the record (`POST /v1/sync`, every pass, every restart of the device).
//!
//! # Design
//! - One lock serializes every change (sync, pass, restart): a sync's answer reflects its apply.
//! - A sync is validated whole ([`super::body`]), planned against the record and what wg0 shows
//!   ([`super::plan`]) and refused before anything changes when invalid or in conflict with a
//!   foreign peer. The record is written *before* wg0 (peers that left stay recorded as
//!   `leaving` until their removal is done), so an agent killed half-way still knows every peer
//!   it may have applied, and the next pass finishes the work. All peer changes go to the device
//!   in one UAPI transaction; the routes follow over netlink.
//! - A sync plans against what the agent last read from or wrote to the device and the record
//!   (kept in memory for the running `wireguard-go` instance) instead of reading 1,000 peers
//!   back; it reads the device when the plan adds a peer or moves a mesh address (so a foreign
//!   peer added meanwhile is never taken over), and it always reads the routes, so a missing
//!   route comes back on the next sync. A managed peer changed behind the agent's back (`wg set`)
//!   is repaired by the next full reconcile pass, which reads everything.
//! - The device is `wireguard-go` in the agent's network namespace, left running when the agent
//!   stops: a new agent adopts it (its UAPI socket answers and the link exists), compares and
//!   finds nothing to do, so no tunnel is interrupted. When the device is gone (killed, or wg0
//!   deleted as in a reboot) the watch task (every second) starts it again and configures it
//!   from the record.
//! - The wg0 MTU is the private network's (`--private-mtu`, or that of the link routing to the
//!   first peer's endpoint, 1500 without peers) minus 80 with IPv6 endpoints, 60 with IPv4 only.

mod read;

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv6Addr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use ipnet::IpNet;
use tokio::sync::Mutex;
use vmnet_ipam::Db;
use vmnet_ipam::mesh_store::{self, MeshPeerRow};
use vmnet_kernel::mesh::MeshPlane;
use vmnet_kernel::wg::daemon::Daemon;
use vmnet_kernel::wg::link::{self, Link};
use vmnet_kernel::wg::uapi::{PeerChange, UapiDevice, set_text};
use vmnet_model::Error;

use super::body::{Own, PeerSpec, SyncBody, WgKey, parse_sync};
use super::dataplane::DataPlane;
use super::keys;
use super::known::{Known, record_of, row_of, seen_of};
use super::locations::Locations;
use super::plan::{MeshPlan, RecordPeer, SeenPeer, plan, record_diff};
use super::view::{MeshView, PeerView, SocketBuffers, SyncOutcome};
use crate::agent::store_tx;
use crate::api::error::from_wg;
use crate::status::now_ms;

/// The default listen port.
pub const DEFAULT_PORT: u16 = 51820;
/// The persistent keepalive the agent sets on its peers, in seconds: off (WireGuard's default;
/// a handshake happens with the first packet). Measured here: with a keepalive, wireguard-go
/// starts a handshake inside the UAPI request for every new peer, and a sync of 1,000 new peers
/// took over 10 s instead of under 200 ms.
pub const KEEPALIVE_SECS: u16 = 0;
/// How often the watch task checks that the device runs.
pub const WATCH_PERIOD: Duration = Duration::from_secs(1);

/// The WireGuard MTU on a private network of MTU `base`: minus 80 (IPv6 outer header, UDP,
/// WireGuard) when any endpoint is IPv6 or there is none yet, minus 60 with IPv4 endpoints only;
/// never below IPv6's minimum, 1280.
#[must_use]
pub fn wg_mtu(base: u32, peers: &[PeerSpec]) -> u32 {
    let v6 = peers.is_empty() || peers.iter().any(|p| p.endpoint.is_ipv6());
    let overhead = if v6 { 80 } else { 60 };
    base.saturating_sub(overhead).max(1280)
}

/// How the mesh interface is set up (`vmnet serve --wg-…`).
#[derive(Debug, Clone)]
pub struct MeshSettings {
    /// The interface name (unique on the machine: the UAPI socket directory is global).
    pub ifname: String,
    /// The listen port.
    pub listen_port: u16,
    /// This host's mesh address (from the control plane), put on the interface as a /128.
    pub mesh_address: Option<Ipv6Addr>,
    /// The private network's MTU; `None`: that of the link routing to the peers' endpoints.
    pub private_mtu: Option<u32>,
    /// Where the key lives and `wireguard-go` logs.
    pub state_dir: PathBuf,
    /// The `wireguard-go` executable.
    pub wireguard_go: PathBuf,
    /// The size the agent gives `wireguard-go`'s UDP socket buffers, bytes; `None`: leave
    /// them as it sets them (see [`vmnet_kernel::wg::sockbuf`]).
    pub socket_buffer_bytes: Option<u32>,
    /// The bpffs directory of the data plane's pinned maps; `None`: no data plane.
    pub bpf_root: Option<PathBuf>,
}

/// The mesh interface of this host.
#[derive(Debug)]
pub struct Mesh {
    s: MeshSettings,
    private: keys::PrivateKey,
    public: WgKey,
    daemon: Daemon,
    pub(super) nl: rtnetlink::Handle,
    lock: Mutex<()>,
    mtu: AtomicU32,
    starts: AtomicU64,
    /// What the agent last read or wrote (see [`Known`]); `None` after a failure.
    known: StdMutex<Option<Known>>,
    /// The BPF data plane, when `bpf_root` is set.
    plane: Option<DataPlane>,
    /// The VMs' registrations and locations, with the data plane and a mesh address.
    locations: Option<Locations>,
    /// The agent's event bus, for peers added and removed ([`crate::agent::Agent::set_mesh`]).
    pub(crate) events: std::sync::OnceLock<crate::events::Events>,
}

impl Mesh {
    /// The mesh interface with `s`; loads (or makes) the host key and opens a netlink socket in
    /// the current network namespace. Starts nothing: the first [`Mesh::converge`] does.
    ///
    /// # Errors
    /// `INVALID_INPUT` for a bad interface name; `UNAVAILABLE` when the key or netlink fail.
    pub fn new(s: MeshSettings) -> Result<Arc<Self>, Error> {
        if s.ifname.is_empty() || s.ifname.len() > 15 || s.ifname.contains(['/', ' ']) {
            return Err(Error::invalid(format!(
                "--wg-interface {:?}: 1-15 bytes, no '/' or space",
                s.ifname
            )));
        }
        let private = keys::load_or_create(&s.state_dir)?;
        let (conn, nl, _) = rtnetlink::new_connection()
            .map_err(|e| Error::unavailable(format!("netlink socket: {e}")))?;
        tokio::spawn(conn);
        let log = s.state_dir.join(format!("wireguard-go-{}.log", s.ifname));
        let plane = s.bpf_root.as_deref().map(DataPlane::load).transpose()?;
        let locations = plane.as_ref().and(s.mesh_address).map(Locations::new);
        Ok(Arc::new(Self {
            locations,
            plane,
            daemon: Daemon::new(&s.ifname, &s.wireguard_go, Some(log))
                .socket_buffers(s.socket_buffer_bytes),
            public: keys::public_of(private.expose()),
            private,
            nl,
            lock: Mutex::new(()),
            mtu: AtomicU32::new(0),
            starts: AtomicU64::new(0),
            known: StdMutex::new(None),
            events: std::sync::OnceLock::new(),
            s,
        }))
    }

    /// The registrations with the data plane they write, when both run.
    #[must_use]
    pub fn located(&self) -> Option<(&Locations, &MeshPlane)> {
        Some((self.locations.as_ref()?, self.plane.as_ref()?.plane()))
    }

    /// This host's public key.
    #[must_use]
    pub fn public_key(&self) -> WgKey {
        self.public
    }

    /// The settings.
    #[must_use]
    pub fn settings(&self) -> &MeshSettings {
        &self.s
    }

    /// This host's mesh address (`--mesh-address`), if it has one.
    #[must_use]
    pub fn mesh_address(&self) -> Option<Ipv6Addr> {
        self.s.mesh_address
    }

    fn own(&self) -> Own {
        Own {
            public_key: self.public,
            mesh_address: self.s.mesh_address,
        }
    }

    /// The wg0 MTU for peers `peers` (see the module docs).
    async fn mtu_for(&self, peers: &[PeerSpec]) -> u32 {
        let base = match (self.s.private_mtu, peers.first()) {
            (Some(m), _) => m,
            (None, Some(p)) => link::mtu_towards(&self.nl, p.endpoint.ip())
                .await
                .ok()
                .flatten()
                .unwrap_or(1500),
            (None, None) => 1500,
        };
        wg_mtu(base, peers)
    }

    /// Makes sure the device runs; returns the link, whether it was (re)started, and the pid of
    /// the instance. Call under the lock.
    async fn ensure_device(&self) -> Result<(Link, bool, u32), Error> {
        let found = link::by_name(&self.nl, &self.s.ifname)
            .await
            .map_err(from_wg)?;
        let pid = self.daemon.pid();
        let (found, started, pid) = match (found, pid) {
            (Some(l), Some(p)) => (l, false, p),
            (l, p) => {
                if p.is_some() || l.is_some() {
                    tracing::warn!(interface = %self.s.ifname, link = l.is_some(), daemon = ?p,
                        "the mesh device is incomplete; restarting wireguard-go");
                    self.daemon.stop();
                }
                let d = &self.daemon;
                let pid = tokio::task::block_in_place(|| d.start()).map_err(from_wg)?;
                self.starts.fetch_add(1, Ordering::Relaxed);
                tracing::info!(interface = %self.s.ifname, pid, "wireguard-go started");
                let l = link::by_name(&self.nl, &self.s.ifname)
                    .await
                    .map_err(from_wg)?
                    .ok_or_else(|| {
                        Error::unavailable(format!(
                            "wireguard-go runs but link {} does not exist",
                            self.s.ifname
                        ))
                    })?;
                (l, true, pid)
            }
        };
        Ok((found, started, pid))
    }

    /// Reads the device; sets our key and port when they differ (a fresh device).
    fn device(&self) -> Result<UapiDevice, Error> {
        let u = self.daemon.uapi();
        let dev = u.get().map_err(from_wg)?;
        if !dev.has_private_key || dev.listen_port != self.s.listen_port {
            u.set(&set_text(
                Some(self.private.expose()),
                Some(self.s.listen_port),
                &[],
            ))
            .map_err(from_wg)?;
            return u.get().map_err(from_wg);
        }
        Ok(dev)
    }

    /// Applies `p` to the device (one UAPI transaction) and the routes into `l`.
    async fn apply(&self, l: Link, p: &MeshPlan) -> Result<(), Error> {
        let mut changes: Vec<PeerChange> = p
            .remove
            .iter()
            .map(|k| PeerChange::Remove { key: k.0 })
            .collect();
        changes.extend(p.set.iter().map(|s| PeerChange::Set {
            key: s.public_key.0,
            endpoint: s.endpoint,
            allowed_ips: vec![IpNet::V6(s.mesh_address.into())],
            keepalive: KEEPALIVE_SECS,
        }));
        if !changes.is_empty() {
            self.daemon
                .uapi()
                .set(&set_text(None, None, &changes))
                .map_err(from_wg)?;
        }
        // Pipelined on one netlink socket.
        let dels = p
            .routes_del
            .iter()
            .map(|d| link::del_route(&self.nl, l.index, *d));
        futures::future::try_join_all(dels).await.map_err(from_wg)?;
        let adds = p
            .routes_add
            .iter()
            .map(|d| link::add_route(&self.nl, l.index, *d));
        futures::future::try_join_all(adds).await.map_err(from_wg)?;
        Ok(())
    }

    async fn prepare_link(&self, l: Link, peers: &[PeerSpec]) -> Result<(), Error> {
        let mtu = self.mtu_for(peers).await;
        link::prepare(&self.nl, l, mtu, self.s.mesh_address)
            .await
            .map_err(from_wg)?;
        self.mtu.store(mtu, Ordering::Relaxed);
        Ok(())
    }

    /// Sizes the device's UDP socket buffers (it opens new sockets whenever its link comes up
    /// or its port is set); logs the sockets it wrote. A failure is logged, not returned: the
    /// tunnel works without, only less well under load.
    fn size_sockets(&self) -> Vec<SocketBuffers> {
        let d = &self.daemon;
        match tokio::task::block_in_place(|| d.size_sockets()) {
            Ok(socks) => {
                if socks.iter().any(|s| s.written) {
                    tracing::info!(interface = %self.s.ifname, sockets = ?socks, "wireguard-go socket buffers sized");
                }
                socks.iter().map(SocketBuffers::from).collect()
            }
            Err(e) => {
                tracing::warn!(interface = %self.s.ifname, "sizing wireguard-go's socket buffers failed: {e}");
                Vec::new()
            }
        }
    }

    async fn finish_leaving(&self, db: &Db, record: &[RecordPeer]) -> Result<(), Error> {
        let gone: Vec<String> = record
            .iter()
            .filter(|r| r.leaving)
            .map(|r| r.spec.public_key.to_string())
            .collect();
        if !gone.is_empty() {
            store_tx!(db, tx => mesh_store::delete_leaving(tx, &gone).await)?;
        }
        Ok(())
    }

    /// `POST /v1/sync`: validate `body` whole, then apply it (see the module docs).
    ///
    /// # Errors
    /// `INVALID_INPUT` for a bad body and `CONFLICT` for a foreign peer's key or address, or a
    /// peer on the mesh address of a VM of this host (nothing changed); `UNAVAILABLE` when the store or the device fails (the record holds the new set,
    /// so the next pass finishes it).
    pub async fn sync(&self, db: &Db, body: &[u8]) -> Result<SyncOutcome, Error> {
        let clock = std::time::Instant::now();
        let mut phases: Vec<(&str, Duration)> = Vec::new();
        let mut lap = |name: &'static str| phases.push((name, clock.elapsed()));
        let want: SyncBody = parse_sync(body, &self.own())?;
        store_tx!(db, tx => super::conflicts::sync_peers(tx, &want.peers).await)?;
        lap("validate");
        let _g = self.lock.lock().await;
        let (l, started, pid) = self.ensure_device().await?;
        lap("device");
        let known = self
            .known
            .lock()
            .ok()
            .and_then(|mut k| k.take())
            .filter(|k| k.pid == pid);
        let fresh = known.is_none();
        let (mut seen, record, old_whitelist) = match known {
            Some(k) => (k.seen, k.record, k.whitelist),
            None => {
                let seen = seen_of(&self.device()?);
                let (record, wl) = store_tx!(db, tx => async {
                    Ok::<_, vmnet_ipam::IpamError>((mesh_store::list_peers(tx).await?, mesh_store::whitelist(tx).await?))
                }.await)?;
                (seen, record_of(record)?, wl)
            }
        };
        lap("device and record");
        let routes = link::routes_into(&self.nl, l.index)
            .await
            .map_err(from_wg)?;
        lap("routes");
        let mut p = plan(&want.peers, &record, &seen, &routes)?;
        // A new peer or a new mesh address may collide with a foreign peer added since the last
        // read: read the device then, so a foreign peer is never taken over.
        let takes_new = |p: &MeshPlan, seen: &BTreeMap<WgKey, SeenPeer>| {
            p.set.iter().any(|s| {
                seen.get(&s.public_key)
                    .is_none_or(|x| x.allowed_ips.as_slice() != [IpNet::V6(s.mesh_address.into())])
            })
        };
        if !fresh && takes_new(&p, &seen) {
            seen = seen_of(&self.device()?);
            p = plan(&want.peers, &record, &seen, &routes)?;
        }
        let diff = record_diff(&want.peers, &record);
        lap("plan");
        let whitelist: Vec<String> = want.whitelist.iter().map(ToString::to_string).collect();
        if !diff.is_empty() || whitelist != old_whitelist {
            let upsert: Vec<MeshPeerRow> = diff.upsert.iter().map(|s| row_of(s, false)).collect();
            let leave: Vec<String> = diff.leave.iter().map(ToString::to_string).collect();
            let now = now_ms();
            store_tx!(db, tx => async {
                mesh_store::upsert_peers(tx, &upsert, now).await?;
                mesh_store::mark_leaving(tx, &leave, now).await?;
                mesh_store::set_whitelist(tx, &whitelist).await
            }.await)?;
        }
        lap("record write");
        // The link is up before routes go into it.
        self.prepare_link(l, &want.peers).await?;
        lap("link");
        if let Err(e) = self.apply(l, &p).await {
            // wireguard-go may have gone mid-request: an error of this sync only; the watch
            // starts it again and applies the record.
            tracing::warn!(
                interface = %self.s.ifname,
                "wireguard-go (pid {pid}) failed during a UAPI request: {e}"
            );
            return Err(e);
        }
        self.size_sockets();
        if let Some(d) = &self.plane {
            // The program and route only when wg0 is new; every pass writes them anyway.
            d.converge(
                &self.nl,
                (&self.s.ifname, l, started),
                self.s.mesh_address,
                &whitelist,
            )
            .await?;
        }
        lap("apply");
        if let Some(ev) = self.events.get() {
            let added = p.set.iter().filter(|s| !seen.contains_key(&s.public_key));
            super::view::publish_peers(ev, added, &p.remove);
        }
        // Every row marked leaving (by this sync or an earlier one) is off wg0 now, unless the
        // sync brought it back.
        let left: BTreeSet<WgKey> = diff.leave.iter().copied().collect();
        let back: BTreeSet<WgKey> = want.peers.iter().map(|w| w.public_key).collect();
        let after: Vec<RecordPeer> = record
            .into_iter()
            .map(|mut r| {
                r.leaving |= left.contains(&r.spec.public_key);
                r
            })
            .filter(|r| r.leaving && !back.contains(&r.spec.public_key))
            .collect();
        self.finish_leaving(db, &after).await?;
        lap("finish");
        tracing::debug!(?phases, "mesh sync");
        let outcome = SyncOutcome {
            peers: want.peers.len(),
            added: p
                .set
                .iter()
                .filter(|s| !seen.contains_key(&s.public_key))
                .count(),
            updated: p
                .set
                .iter()
                .filter(|s| seen.contains_key(&s.public_key))
                .count(),
            removed: p.remove.len(),
            routes_added: p.routes_add.len(),
            routes_removed: p.routes_del.len(),
            whitelist: want.whitelist.len(),
        };
        self.remember(pid, Known::applied(seen, &p), &want.peers, whitelist);
        Ok(outcome)
    }

    /// Keeps what was just applied for the next sync.
    fn remember(
        &self,
        pid: u32,
        seen: BTreeMap<WgKey, SeenPeer>,
        peers: &[PeerSpec],
        whitelist: Vec<String>,
    ) {
        let record = peers
            .iter()
            .map(|s| RecordPeer {
                spec: s.clone(),
                leaving: false,
            })
            .collect();
        if let Ok(mut k) = self.known.lock() {
            *k = Some(Known {
                pid,
                seen,
                record,
                whitelist,
            });
        }
    }

    /// One reconcile pass of the mesh: the device runs (started and configured from the record
    /// when it was gone), every recorded peer is on it as recorded, every managed route is
    /// there, peers that left are removed. Returns one line per repair.
    ///
    /// # Errors
    /// `UNAVAILABLE` when the store or the device fails.
    pub async fn converge(&self, db: &Db) -> Result<Vec<String>, Error> {
        let _g = self.lock.lock().await;
        if let Ok(mut k) = self.known.lock() {
            *k = None;
        }
        let (l, started, pid) = self.ensure_device().await?;
        let dev = self.device()?;
        let seen = seen_of(&dev);
        let record = record_of(store_tx!(db, tx => mesh_store::list_peers(tx).await)?)?;
        let desired: Vec<PeerSpec> = record
            .iter()
            .filter(|r| !r.leaving)
            .map(|r| r.spec.clone())
            .collect();
        let routes = link::routes_into(&self.nl, l.index)
            .await
            .map_err(from_wg)?;
        let p = plan(&desired, &record, &seen, &routes)?;
        self.prepare_link(l, &desired).await?;
        self.apply(l, &p).await?;
        self.size_sockets();
        self.finish_leaving(db, &record).await?;
        let whitelist = store_tx!(db, tx => mesh_store::whitelist(tx).await)?;
        if let Some(d) = &self.plane {
            d.converge(
                &self.nl,
                (&self.s.ifname, l, true),
                self.s.mesh_address,
                &whitelist,
            )
            .await?;
        }
        self.remember(pid, Known::applied(seen, &p), &desired, whitelist);
        let mut repaired = Vec::new();
        if started {
            repaired.push(format!(
                "mesh: {} started and configured from the record ({} peers)",
                self.s.ifname,
                desired.len()
            ));
        } else {
            repaired.extend(
                p.set
                    .iter()
                    .map(|s| format!("mesh: peer {} rewritten", s.public_key)),
            );
            repaired.extend(
                p.routes_add
                    .iter()
                    .map(|a| format!("mesh: route {a}/128 reinstalled")),
            );
            repaired.extend(
                p.remove
                    .iter()
                    .map(|k| format!("mesh: peer {k} removed (left)")),
            );
        }
        for r in &repaired {
            tracing::info!("{r}");
        }
        Ok(repaired)
    }

    /// Converges every [`WATCH_PERIOD`] when the device is gone (wireguard-go died or wg0 was
    /// deleted), and sizes its sockets (new ones after a link flap); runs until the task is
    /// aborted.
    pub async fn watch(self: Arc<Self>, db: Db) {
        loop {
            tokio::time::sleep(WATCH_PERIOD).await;
            let link = link::by_name(&self.nl, &self.s.ifname).await;
            let d = &self.daemon;
            let pid = tokio::task::block_in_place(|| d.pid());
            if matches!(link, Ok(Some(_))) && pid.is_some() {
                self.size_sockets();
                continue;
            }
            if let Err(e) = self.converge(&db).await {
                tracing::warn!(interface = %self.s.ifname, "restarting the mesh device failed: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(ep: &str) -> PeerSpec {
        PeerSpec {
            public_key: WgKey([1; 32]),
            endpoint: ep.parse().unwrap(),
            mesh_address: "fdaa::2".parse().unwrap(),
        }
    }

    #[test]
    fn the_wireguard_mtu_is_the_private_mtu_minus_the_overhead_of_the_endpoints_family() {
        assert_eq!(wg_mtu(1500, &[peer("[fd00:10::2]:51820")]), 1420);
        assert_eq!(wg_mtu(1500, &[peer("10.10.0.2:51820")]), 1440);
        assert_eq!(
            wg_mtu(9000, &[peer("10.10.0.2:51820"), peer("[fd00:10::3]:51820")]),
            8920
        );
        assert_eq!(wg_mtu(1500, &[]), 1420);
        assert_eq!(wg_mtu(1300, &[peer("[fd00:10::2]:51820")]), 1280);
    }
}
