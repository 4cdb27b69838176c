//! What `GET /v1/mesh` answers: the record, the peers and the data plane's counters.

use super::*;

impl Mesh {
    /// Every peer the device has now, by public key, with when it last completed a handshake
    /// (seconds since the Unix epoch; 0: never). Empty while the device is down.
    #[must_use]
    pub fn handshakes(&self) -> Vec<(String, u64)> {
        let u = self.daemon.uapi();
        let dev = tokio::task::block_in_place(|| u.get()).unwrap_or_default();
        dev.peers
            .iter()
            .map(|(k, d)| (WgKey(*k).to_string(), d.last_handshake_sec))
            .collect()
    }

    /// `GET /v1/mesh`.
    ///
    /// # Errors
    /// `UNAVAILABLE` when the store or the device does not answer.
    pub async fn view(&self, db: &Db) -> Result<MeshView, Error> {
        let (record, whitelist) = store_tx!(db, tx => async {
            Ok::<_, vmnet_ipam::IpamError>((mesh_store::list_peers(tx).await?, mesh_store::whitelist(tx).await?))
        }.await)?;
        let record = record_of(record)?;
        let u = self.daemon.uapi();
        // A device that is down (being restarted) shows the record with nothing present.
        let dev = tokio::task::block_in_place(|| u.get()).unwrap_or_default();
        let l = link::by_name(&self.nl, &self.s.ifname)
            .await
            .map_err(from_wg)?;
        let routes = match l {
            Some(l) => link::routes_into(&self.nl, l.index)
                .await
                .map_err(from_wg)?,
            None => BTreeSet::new(),
        };
        let managed: BTreeMap<WgKey, &RecordPeer> =
            record.iter().map(|r| (r.spec.public_key, r)).collect();
        let mut peers = Vec::new();
        for r in &record {
            let d = dev.peers.get(&r.spec.public_key.0);
            peers.push(PeerView::managed(
                r,
                d,
                routes.contains(&r.spec.mesh_address),
            ));
        }
        for (k, d) in dev
            .peers
            .iter()
            .filter(|(k, _)| !managed.contains_key(&WgKey(**k)))
        {
            peers.push(PeerView::foreign(WgKey(*k), d));
        }
        Ok(MeshView {
            interface: self.s.ifname.clone(),
            public_key: self.public.to_string(),
            listen_port: self.s.listen_port,
            mesh_address: self.s.mesh_address.map(|a| a.to_string()),
            mtu: l.map_or(self.mtu.load(Ordering::Relaxed), |l| l.mtu),
            daemon_pid: self.daemon.pid(),
            daemon_starts: self.starts.load(Ordering::Relaxed),
            socket_buffers: {
                let d = &self.daemon;
                tokio::task::block_in_place(|| d.read_sockets())
                    .unwrap_or_default()
                    .iter()
                    .map(SocketBuffers::from)
                    .collect()
            },
            peers,
            whitelist,
            data_plane: self.plane.as_ref().map(DataPlane::view).transpose()?,
            registrations: self.locations.as_ref().map(Locations::view),
        })
    }
}
