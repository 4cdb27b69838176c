//! Removing a VM's kernel objects: host rules, the host table, the veth pair and the netns,
//! synchronously or with the namespace's own teardown left to the kernel.

use super::*;

impl NetlinkNsDriver {
    /// Removes everything of `uid`: host rules, the host table, the veth pair (and with it the
    /// routes through it), the netns (and with it the tap). Goes on past failures and reports all.
    pub(in crate::ns) async fn remove_uid(&self, uid: u32) -> Result<Vec<Change>, NsError> {
        self.remove_with(uid, false).await
    }

    /// [`Self::remove_uid`]; with `deferred`, the veth pair is not deleted while the netns
    /// exists: unmounting the netns lets the kernel destroy the namespace, and with it the pair
    /// (a veth end takes its peer along) and the routes through it, in its own cleanup work after
    /// this returns, instead of a synchronous delete that waits for the kernel (≈ 30–40 ms). A
    /// host end whose netns is already gone is deleted either way.
    pub(super) async fn remove_with(
        &self,
        uid: u32,
        deferred: bool,
    ) -> Result<Vec<Change>, NsError> {
        self.tc_counters.forget(uid);
        let mut errors = Vec::new();
        let mut found = false;
        let host_veth = self.name(NameKind::HostVeth, uid);
        match super::super::public::remove(self, uid) {
            Ok(held) => {
                found |= !held.is_empty();
                let block = match self.uplink().await {
                    Ok(Some(_)) => self.routed_block_of(&host_veth).await.unwrap_or(None),
                    _ => None,
                };
                if let Err(e) = self.drop_proxies(&held, block, &[]).await {
                    errors.push(e);
                }
                self.flush_conntrack(&held).await;
            }
            Err(e) => errors.push(e),
        }
        let table = self.settings.host_table_base + uid;
        match self.host_rules.of(&host_veth).await {
            Ok(rules) => {
                for r in &rules {
                    found = true;
                    if let Err(e) = super::super::rules::del_rule(&self.host, r, "host").await {
                        errors.push(e);
                    }
                }
            }
            Err(e) => errors.push(e),
        }
        for v in [IpVersion::V4, IpVersion::V6] {
            let dumped = {
                let _dumps = self.host_dumps.lock().await;
                routes::dump_routes(&self.host, v, Some(table), None).await
            };
            match dumped {
                Ok(rs) => {
                    for r in &rs {
                        found = true;
                        if let Err(e) = routes::del_route(&self.host, r, "host").await {
                            errors.push(e);
                        }
                    }
                }
                Err(e) => errors.push(e),
            }
        }
        let ns = self.name(NameKind::Netns, uid);
        let ns_exists = netns::exists(&ns);
        if !(deferred && ns_exists) {
            match self.delete_host_veth(&host_veth).await {
                Ok(deleted) => found |= deleted,
                Err(e) => errors.push(e),
            }
        }
        self.nft_memo.forget_netns(&ns);
        // Before the unmount: the kept sockets hold the namespace (and the veth pair in it).
        self.nft_gens.close(&ns);
        if let Some(w) = &self.watcher {
            w.unwatch(&ns);
        }
        let forgotten = [
            self.activity
                .as_ref()
                .map(|r| r.forget(uid).map_err(NsError::from)),
            self.guard
                .as_ref()
                .map(|g| g.forget(uid).map_err(NsError::from)),
        ];
        errors.extend(forgotten.into_iter().flatten().filter_map(Result::err));
        if ns_exists {
            found = true;
            match netns::delete(&ns) {
                Ok(()) if deferred => {
                    if let Ok(mut d) = self.deferred.lock() {
                        d.retain(|_, at| at.elapsed() < TEARDOWN_GRACE);
                        d.insert(uid, Instant::now());
                    }
                }
                Ok(()) => {}
                Err(e) => errors.push(e.into()),
            }
        }
        match errors.len() {
            0 => Ok(if found {
                vec![Change::RemoveVm { user_id: uid }]
            } else {
                Vec::new()
            }),
            1 => Err(errors.remove(0)),
            _ => Err(NsError::Many(errors)),
        }
    }

    /// Deletes the host veth end `name` (and with it its peer) if it exists, waiting for the
    /// kernel; returns whether it existed.
    async fn delete_host_veth(&self, name: &str) -> Result<bool, NsError> {
        let Some(l) = routes::link_by_name(&self.host, name).await? else {
            return Ok(false);
        };
        match self.host.link().del(l.index).execute().await {
            // ENODEV: gone meanwhile, the kernel's teardown of its namespace got there first.
            Ok(()) => Ok(true),
            Err(e) if routes::errno(&e) == Some(libc::ENODEV) => Ok(true),
            Err(e) => Err(routes::nl(format!("host: delete link {name}"))(e)),
        }
    }

    /// Deletes the host link `name` when it is the leftover end of a veth pair whose peer lives
    /// in another namespace: one a deferred removal left to the kernel, or one some process
    /// still holds. A link of that name of another kind, or with its peer on the host, is not
    /// ours to delete and stays (the create then fails on the taken name). Returns whether one
    /// was deleted.
    pub(in crate::ns) async fn delete_stale_host_veth(&self, name: &str) -> Result<bool, NsError> {
        let Some(m) = crate::netlink::link_by_name(&self.host, name)
            .await
            .map_err(routes::nl(format!("host: get link {name}")))?
        else {
            return Ok(false);
        };
        let is_veth = m.attributes.iter().any(|a| {
            matches!(a, LinkAttribute::LinkInfo(infos)
                if infos.iter().any(|i| matches!(i, LinkInfo::Kind(InfoKind::Veth))))
        });
        // The kernel names the peer's namespace only when it differs from the link's own.
        let peer_elsewhere = m
            .attributes
            .iter()
            .any(|a| matches!(a, LinkAttribute::LinkNetNsId(_)));
        if !(is_veth && peer_elsewhere) {
            return Ok(false);
        }
        match self.host.link().del(m.header.index).execute().await {
            Ok(()) => Ok(true),
            Err(e) if routes::errno(&e) == Some(libc::ENODEV) => Ok(true),
            Err(e) => Err(routes::nl(format!("host: delete link {name}"))(e)),
        }
    }

    /// Whether `uid` was removed with a deferred teardown less than [`TEARDOWN_GRACE`] ago.
    pub(super) fn teardown_pending(&self, uid: u32) -> bool {
        self.deferred
            .lock()
            .ok()
            .and_then(|d| d.get(&uid).copied())
            .is_some_and(|at| at.elapsed() < TEARDOWN_GRACE)
    }
}
