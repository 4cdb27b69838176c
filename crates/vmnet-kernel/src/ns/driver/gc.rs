//! Garbage collection: namespaces, veths and host state that no kept VM owns.

use super::*;

impl NetlinkNsDriver {
    pub(super) async fn gc_inner(&self, keep: &[u32]) -> Result<Vec<u32>, NsError> {
        let want: BTreeSet<u32> = keep.iter().copied().collect();
        // A VM removed with a deferred teardown a moment ago may still show its veth pair while
        // the kernel destroys its namespace: leave it to the kernel for a grace period.
        let orphans: Vec<u32> = self
            .observe_all()
            .await?
            .into_iter()
            .filter(|o| {
                !want.contains(&o.user_id)
                    && (o.netns.is_some() || !self.teardown_pending(o.user_id))
            })
            .map(|o| o.user_id)
            .collect();
        // A bounded number at a time: teardown waits on the kernel, not on us.
        let results: Vec<_> = futures::stream::iter(
            orphans
                .clone()
                .into_iter()
                .map(|u| async move { (u, self.remove_uid(u).await) }),
        )
        .buffer_unordered(16)
        .collect()
        .await;
        let mut errors: Vec<NsError> = Vec::new();
        for (uid, r) in results {
            let netns = self.name(NameKind::Netns, uid);
            match r {
                Ok(changes) => tracing::info!(
                    user_id = uid, netns = %netns,
                    removed = ?changes.iter().map(ToString::to_string).collect::<Vec<_>>(),
                    reason = "no stored VM plans to this user id",
                    "namespace mode: collected an orphaned VM"),
                Err(e) => {
                    tracing::warn!(user_id = uid, netns = %netns, error = %e,
                        "namespace mode: collecting an orphaned VM failed");
                    errors.push(e);
                }
            }
        }
        if let Some(rec) = &self.activity {
            if let Some(what) = rec.ensure_link()? {
                tracing::warn!(repair = %what, "packet activity: repaired the program's link");
            }
            let n = rec.retain(keep)?;
            if n > 0 {
                tracing::info!(
                    registrations = n,
                    "packet activity: dropped registrations of VMs that are gone"
                );
            }
        }
        if want.is_empty()
            && let Some(p) = &self.host_plan
        {
            let mut state = self.host_ready.lock().await;
            host::remove_host(&self.host_ns, p)?;
            if state.ready {
                tracing::info!(table = %p.nft_table, reason = "no VM is left on this host",
                    "namespace mode: removed the host masquerade table");
            }
            *state = HostState {
                idle: true,
                ..HostState::default()
            };
        } else if !want.is_empty() {
            self.host_ready.lock().await.ready = false;
            self.ensure_host().await?;
        }
        if !errors.is_empty() {
            return Err(NsError::Many(errors));
        }
        Ok(orphans)
    }
}
