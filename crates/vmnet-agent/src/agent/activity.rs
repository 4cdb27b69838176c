//! The agent's packet-activity reports (`GET /v1/vms/{id}/activity`, `GET /v1/activity`): the
//! kernel's recorded times ([`ActivityRecorder`]) joined with the stored VMs and the agent's
//! start as the baseline ([`crate::activity`]).

use std::sync::Arc;
use std::time::SystemTime;

use vmnet_ipam::vm_store;
use vmnet_kernel::activity::ActivityRecorder;
use vmnet_model::Error;

use super::view::vm_not_found;
use super::{Agent, store_tx};
use crate::activity::{ActivityList, VmActivity, rfc3339, view};

impl Agent {
    /// Turns packet activity on with `recorder` (the program the driver attaches). Set once,
    /// before serving.
    ///
    /// # Errors
    /// `CONFLICT` when it is already set.
    pub fn set_activity(&self, recorder: Arc<ActivityRecorder>) -> Result<(), Error> {
        self.activity
            .set(recorder)
            .map_err(|_| Error::conflict("packet activity is already set on this agent"))
    }

    fn recorder(&self) -> Result<&Arc<ActivityRecorder>, Error> {
        self.activity.get().ok_or_else(|| {
            Error::unavailable(
                "packet activity is off on this agent (start it with --activity-root PATH)",
            )
        })
    }

    /// When this agent started: the activity baseline of the VMs it found.
    #[must_use]
    pub fn started(&self) -> SystemTime {
        self.started
    }

    /// The activity baseline of the VM with user id `uid`: the later of the agent's start and
    /// the moment this agent created the VM (or gave it this user id). A VM created an hour
    /// after the agent started is not idle for an hour at once.
    #[must_use]
    pub fn activity_baseline(&self, uid: u32) -> SystemTime {
        let since = self
            .activity_since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&uid)
            .copied();
        since.map_or(self.started, |t| t.max(self.started))
    }

    /// A VM with user id `uid` now exists (created, or given this user id in place of
    /// `previous`): its activity baseline is now.
    pub(crate) fn activity_starts(&self, uid: u32, previous: Option<u32>) {
        let mut since = self
            .activity_since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(p) = previous {
            since.remove(&p);
            if p != uid
                && let Some(w) = self.wake_on_packet.get()
            {
                w.forget(p);
            }
        }
        since.insert(uid, SystemTime::now());
    }

    /// The VM with user id `uid` was deleted.
    pub(crate) fn activity_ends(&self, uid: u32) {
        self.activity_since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&uid);
        if let Some(w) = self.wake_on_packet.get() {
            w.forget(uid);
        }
    }

    /// Turns wake on packet on. Set once, before serving.
    ///
    /// # Errors
    /// `CONFLICT` when it is already set.
    pub fn set_wake(&self, wake: Arc<crate::wake::Wake>) -> Result<(), Error> {
        self.wake_on_packet
            .set(wake)
            .map_err(|_| Error::conflict("wake on packet is already set on this agent"))
    }

    /// Wake on packet, when on.
    #[must_use]
    pub fn wake_service(&self) -> Option<&Arc<crate::wake::Wake>> {
        self.wake_on_packet.get()
    }

    /// Every VM's id by user id.
    pub(crate) async fn vm_ids(&self) -> Result<std::collections::HashMap<u32, String>, Error> {
        let rows = store_tx!(self.db, tx => vm_store::list(tx).await)?;
        Ok(rows.into_iter().map(|r| (r.user_id, r.id)).collect())
    }

    /// `GET /v1/vms/{id}/activity`.
    ///
    /// # Errors
    /// `NOT_FOUND` for an unknown VM; `UNAVAILABLE` when activity is off or the store or the
    /// kernel map cannot be read.
    pub async fn vm_activity(&self, id: &str) -> Result<VmActivity, Error> {
        let rec = self.recorder()?;
        let row = store_tx!(self.db, tx => vm_store::get(tx, id).await)?;
        let row = row.ok_or_else(|| vm_not_found(id))?;
        let last = rec
            .last_of(row.user_id)
            .map_err(|e| Error::unavailable(format!("vm {id}: read the activity map: {e}")))?;
        let mut v = view(
            &row.id,
            row.user_id,
            last,
            self.activity_baseline(row.user_id),
            SystemTime::now(),
        );
        v.wake = self.wake_service().map(|w| w.counters(row.user_id));
        Ok(v)
    }

    /// `GET /v1/activity`: every VM, or with `idle_secs` those idle at least that long.
    ///
    /// # Errors
    /// `UNAVAILABLE` when activity is off or the store or the kernel map cannot be read.
    pub async fn activity(&self, idle_secs: Option<u64>) -> Result<ActivityList, Error> {
        let rec = self.recorder()?;
        let rows = store_tx!(self.db, tx => vm_store::list(tx).await)?;
        let last = rec
            .last_of_each(rows.iter().map(|r| r.user_id))
            .map_err(|e| Error::unavailable(format!("read the activity map: {e}")))?;
        let now = SystemTime::now();
        let vms = rows
            .iter()
            .map(|r| {
                view(
                    &r.id,
                    r.user_id,
                    last.get(&r.user_id).copied(),
                    self.activity_baseline(r.user_id),
                    now,
                )
            })
            .filter(|v| idle_secs.is_none_or(|n| v.idle_secs >= n))
            .collect();
        Ok(ActivityList {
            baseline: rfc3339(self.started),
            baseline_unix_ms: crate::activity::unix_ms(self.started),
            idle_secs,
            vms,
        })
    }
}
