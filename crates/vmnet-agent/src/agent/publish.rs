//! What the agent publishes on its event bus ([`crate::events`]): the helpers its operations
//! call, and the spoof-drop summaries' loop.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use vmnet_ipam::vm_store;
use vmnet_kernel::ns::Change;

use super::{Agent, store_tx};
use crate::events::spoof::{Counts, moved};
use crate::events::{EventBody, Events, GuardMode, Subject, Trigger, drift_objects, drift_place};

impl Agent {
    /// The agent's event bus.
    #[must_use]
    pub fn events(&self) -> &Events {
        &self.events
    }

    /// Publishes `body` about VM `id` (user id `uid`).
    pub(crate) fn emit_vm(&self, id: &str, uid: u32, body: EventBody) {
        self.events.publish(Subject::vm(id, uid), body);
    }

    /// Publishes one `drift_repaired` per change, about VM `vm` (id, user id, netns) or, with
    /// `None`, the host.
    pub(crate) fn emit_drift<'a>(
        &self,
        vm: Option<(&str, u32, &str)>,
        changes: impl IntoIterator<Item = &'a Change>,
        trigger: Trigger,
    ) {
        let (subject, netns) = match vm {
            Some((id, uid, ns)) => (Subject::vm(id, uid), ns),
            None => (Subject::host(), "host"),
        };
        for c in changes {
            self.events.publish(
                subject.clone(),
                EventBody::DriftRepaired {
                    objects: drift_objects(c),
                    netns: drift_place(c, netns),
                    trigger,
                    detail: c.to_string(),
                },
            );
        }
    }

    /// Publishes one host `drift_repaired` of `object` per line of `lines` (the mesh's and pool
    /// mode's repairs, which report lines).
    pub(crate) fn emit_host_lines(&self, object: &str, lines: &[String], trigger: Trigger) {
        for l in lines {
            self.events.publish(
                Subject::host(),
                EventBody::DriftRepaired {
                    objects: vec![object.to_owned()],
                    netns: "host".to_owned(),
                    trigger,
                    detail: l.clone(),
                },
            );
        }
    }

    /// Publishes the spoof-drop summaries every `every` until the task is aborted (see
    /// [`crate::events::spoof`]).
    pub async fn run_spoof_summaries(self: Arc<Self>, every: Duration) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last: Option<(BTreeMap<u32, Counts>, Option<Counts>)> = None;
        loop {
            tick.tick().await;
            if !self.events.followed() {
                last = None;
                continue;
            }
            let now = self.drop_counts();
            if let Some((vms, pool)) = &last {
                self.summarize(vms, pool.as_ref(), &now, every).await;
            }
            last = Some(now);
        }
    }

    /// The guards' drop counters now: per user id (namespace mode) and the pool guard's.
    fn drop_counts(&self) -> (BTreeMap<u32, Counts>, Option<Counts>) {
        let own = |m: BTreeMap<&'static str, u64>| -> Counts {
            m.into_iter().map(|(k, n)| (k.to_owned(), n)).collect()
        };
        let vms = match self.driver.guard_totals() {
            Ok(Some(t)) => t.per_vm.into_iter().map(|(u, m)| (u, own(m))).collect(),
            Ok(None) => BTreeMap::new(),
            Err(e) => {
                tracing::debug!("spoof summaries: reading the guest guard failed: {e}");
                BTreeMap::new()
            }
        };
        (vms, self.pool().and_then(|p| p.guard_drops()))
    }

    async fn summarize(
        &self,
        before: &BTreeMap<u32, Counts>,
        pool_before: Option<&Counts>,
        (vms, pool): &(BTreeMap<u32, Counts>, Option<Counts>),
        every: Duration,
    ) {
        let interval_secs = every.as_secs().max(1);
        let moved_vms: Vec<(u32, Counts)> = vms
            .iter()
            .map(|(u, now)| (*u, moved(before.get(u), now)))
            .filter(|(_, d)| !d.is_empty())
            .collect();
        if !moved_vms.is_empty() {
            let ids: BTreeMap<u32, String> = match store_tx!(self.db, tx => vm_store::list(tx).await)
            {
                Ok(rows) => rows.into_iter().map(|r| (r.user_id, r.id)).collect(),
                Err(e) => {
                    tracing::debug!("spoof summaries: reading the VMs failed: {e}");
                    BTreeMap::new()
                }
            };
            for (uid, drops) in moved_vms {
                let subject = match ids.get(&uid) {
                    Some(id) => Subject::vm(id, uid),
                    None => Subject {
                        vm: None,
                        user_id: Some(uid),
                    },
                };
                self.events.publish(
                    subject,
                    EventBody::SpoofDrops {
                        mode: GuardMode::Namespace,
                        interval_secs,
                        drops,
                    },
                );
            }
        }
        if let (Some(b), Some(now)) = (pool_before, pool) {
            let drops = moved(Some(b), now);
            if !drops.is_empty() {
                self.events.publish(
                    Subject::host(),
                    EventBody::SpoofDrops {
                        mode: GuardMode::Pool,
                        interval_secs,
                        drops,
                    },
                );
            }
        }
    }
}
