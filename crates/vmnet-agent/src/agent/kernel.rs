//! The kernel lock and the deadline of every VM change through the API.
//!
//! # Design
//! - Every kernel change (a PUT, a DELETE, one VM of a reconcile pass, an audit) runs under
//!   one lock ([`KernelGate`]), which records what holds it and since when.
//! - A change through the API waits at most the kernel deadline (`vmnet serve
//!   --kernel-deadline-secs`, default [`DEFAULT_KERNEL_DEADLINE_SECS`]) from its start: for the
//!   lock, then for its apply. One that cannot get the lock in time changes nothing and answers
//!   `UNAVAILABLE` naming what holds the lock and for how long; one whose apply does not
//!   finish in time answers `UNAVAILABLE` saying so, and the apply goes on in the background
//!   (stopping a kernel change halfway would leave half-applied state): its outcome shows in
//!   the VM's status when it ends, and the lock is free again then.
//! - `GET /v1/status` shows the deadline, what holds the lock now and for how long, and the
//!   changes that ran out of time ([`KernelStatus`]).
//! - While the lock is held, the kernel's change notifications of the namespaces the holder
//!   changes are its own: the lock holds a [`Quiet`] of the driver's watcher ([`crate::watch`])
//!   naming them ([`KernelGate::lock`]), and releasing the lock discards what the change caused
//!   (the `Quiet` drops before the lock is released). The notifications of every other
//!   namespace are kept, so a foreign change in another VM's netns is checked at once, after
//!   the holder. A VM change names the host and the VM's netns ([`Agent::vm_spaces`]): the
//!   host side of every VM (host veth end, routes, rules, proxy entries, host nft) is in the
//!   host namespace, whose notifications are then discarded whichever VM they were for. A
//!   holder that reads under the lock which VMs it changes (the stored row of a PUT, a DELETE
//!   or a pass's step; the VMs garbage collection may remove) names them before changing them
//!   ([`KernelGate::quiet_also`]). A check on a notification quiets nothing
//!   ([`KernelGate::lock_checking`]).

use std::future::Future;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};

use tokio::sync::{Mutex, OwnedMutexGuard};
use vmnet_ipam::vm_store::VmRow;
use vmnet_kernel::watch::{Quiet, Watcher};
use vmnet_model::Error;
use vmnet_model::vm::parse_vm_config;
use vmnet_plan::ns::{NameKind, name, parse_uid};

use super::Agent;
pub use crate::status::KernelStatus;
use crate::status::now_ms;

/// The kernel deadline of an agent started without `--kernel-deadline-secs`.
pub const DEFAULT_KERNEL_DEADLINE_SECS: u64 = 30;

#[derive(Debug, Default)]
struct Record {
    holder: Option<(String, Instant)>,
    timeouts: u64,
    last_timeout: Option<String>,
    last_timeout_at_unix_ms: Option<i64>,
}

/// The kernel lock, what holds it, and the deadline of API changes.
#[derive(Debug)]
pub struct KernelGate {
    lock: Arc<Mutex<()>>,
    record: Arc<StdMutex<Record>>,
    deadline: StdMutex<Duration>,
    /// The driver's notification watcher, when it has one.
    watcher: Option<Watcher>,
    /// The holder's [`Quiet`], when it quiets anything.
    quiet: Arc<StdMutex<Option<Quiet>>>,
}

impl Default for KernelGate {
    fn default() -> Self {
        Self::new(None)
    }
}

/// The kernel lock, held; what held it is forgotten when it drops.
#[derive(Debug)]
pub struct KernelGuard {
    /// The gate's slot of the holder's `Quiet`, emptied (discarding the holder's own
    /// notifications) in `drop`, before the lock is released with `_guard`.
    quiet: Arc<StdMutex<Option<Quiet>>>,
    _guard: OwnedMutexGuard<()>,
    record: Arc<StdMutex<Record>>,
}

impl Drop for KernelGuard {
    fn drop(&mut self) {
        if let Ok(mut r) = self.record.lock() {
            r.holder = None;
        }
        let quiet = self
            .quiet
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        drop(quiet);
    }
}

impl KernelGate {
    /// A free lock; the notifications of `watcher` (the driver's) are quieted while it is
    /// held.
    #[must_use]
    pub fn new(watcher: Option<Watcher>) -> Self {
        Self {
            lock: Arc::new(Mutex::new(())),
            record: Arc::default(),
            deadline: StdMutex::new(Duration::from_secs(DEFAULT_KERNEL_DEADLINE_SECS)),
            watcher,
            quiet: Arc::default(),
        }
    }

    /// Takes the lock for `what` (waiting as long as it takes: background work) to change the
    /// namespaces `netns` (a VM netns by name, `None` for the host), which are quiet while it
    /// is held; more are added with [`Self::quiet_also`]. A holder that changes nothing names
    /// none.
    pub async fn lock(
        &self,
        what: impl Into<String>,
        netns: impl IntoIterator<Item = Option<String>>,
    ) -> KernelGuard {
        let guard = self.take(what).await;
        if let Some(w) = &self.watcher {
            *self.slot() = Some(w.quiet(netns));
        }
        guard
    }

    /// The lock for `what`, nothing quieted yet.
    async fn take(&self, what: impl Into<String>) -> KernelGuard {
        let guard = Arc::clone(&self.lock).lock_owned().await;
        if let Ok(mut r) = self.record.lock() {
            r.holder = Some((what.into(), Instant::now()));
        }
        KernelGuard {
            quiet: Arc::clone(&self.quiet),
            _guard: guard,
            record: Arc::clone(&self.record),
        }
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Option<Quiet>> {
        self.quiet
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Quiets the namespaces `netns` too, until the lock is released: called by the holder of
    /// [`Self::lock`] before it changes them (it found out under the lock which they are). A
    /// no-op for the holder of [`Self::lock_checking`].
    pub fn quiet_also(&self, netns: impl IntoIterator<Item = Option<String>>) {
        if let Some(q) = self.slot().as_mut() {
            q.also(netns);
        }
    }

    /// Takes the lock for `what`, a check on a notification ([`crate::watch`]): nothing is
    /// quieted. A check writes only when it repairs; the notifications of its repair then cost
    /// one more check that finds nothing, and a foreign change made during the check is never
    /// lost.
    pub async fn lock_checking(&self, what: impl Into<String>) -> KernelGuard {
        self.take(what).await
    }

    /// The deadline of API changes.
    #[must_use]
    pub fn deadline(&self) -> Duration {
        self.deadline
            .lock()
            .map_or(Duration::from_secs(DEFAULT_KERNEL_DEADLINE_SECS), |d| *d)
    }

    fn holder(&self) -> String {
        match self.record.lock().ok().and_then(|r| r.holder.clone()) {
            Some((what, since)) => {
                format!("held by {what} for {:.1} s", since.elapsed().as_secs_f64())
            }
            None => "free again at the deadline".into(),
        }
    }

    fn timed_out(&self, message: &str) {
        tracing::warn!("{message}");
        if let Ok(mut r) = self.record.lock() {
            r.timeouts += 1;
            r.last_timeout = Some(message.to_owned());
            r.last_timeout_at_unix_ms = Some(now_ms());
        }
    }

    /// What `GET /v1/status` shows.
    #[must_use]
    pub fn status(&self) -> KernelStatus {
        let r = self.record.lock();
        let (holder, held_for_ms, timeouts, last, last_at) = match r {
            Ok(r) => (
                r.holder.as_ref().map(|(w, _)| w.clone()),
                r.holder
                    .as_ref()
                    .map(|(_, t)| u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX)),
                r.timeouts,
                r.last_timeout.clone(),
                r.last_timeout_at_unix_ms,
            ),
            Err(_) => (None, None, 0, None, None),
        };
        KernelStatus {
            deadline_ms: u64::try_from(self.deadline().as_millis()).unwrap_or(u64::MAX),
            holder,
            held_for_ms,
            timeouts_total: timeouts,
            last_timeout: last,
            last_timeout_at_unix_ms: last_at,
        }
    }
}

/// Where a bounded change stands.
const WAITING: u8 = 0;
const RUNNING: u8 = 1;
const GAVE_UP: u8 = 2;
const LATE: u8 = 3;

impl Agent {
    /// Sets the deadline of API changes (`--kernel-deadline-secs`).
    pub fn set_kernel_deadline(&self, d: Duration) {
        if let Ok(mut x) = self.kernel.deadline.lock() {
            *x = d;
        }
    }

    /// The namespaces a change of the VMs with user ids `uids` touches: the host (host veth
    /// ends, routes, rules, proxy entries, host nft) and each VM's netns, by the name its plan
    /// gives it.
    pub(crate) fn vm_spaces(&self, uids: impl IntoIterator<Item = u32>) -> Vec<Option<String>> {
        let p = &self.settings.name_prefix;
        std::iter::once(None)
            .chain(uids.into_iter().map(|u| Some(name(p, NameKind::Netns, u))))
            .collect()
    }

    /// The namespaces converging the VM of `row` touches ([`Self::vm_spaces`]): its desired
    /// config's user id (the row's column) and, when the applied config differs, the applied
    /// one's (a failed apply re-applies that one; a successful one removes it). A row in sync
    /// is not parsed: a pass reads every row.
    pub(crate) fn row_spaces(&self, row: &VmRow) -> Vec<Option<String>> {
        let mut uids = vec![row.user_id];
        if let Some(applied) = row.applied.as_deref().filter(|a| *a != row.config) {
            uids.extend(parse_vm_config(applied.as_bytes()).ok().map(|c| c.user_id));
        }
        uids.dedup();
        self.vm_spaces(uids)
    }

    /// The VM netns garbage collection may remove while keeping the user ids `keep`: every
    /// watched one of another user id (a netns nobody watches has no notification to quiet).
    /// Read under the kernel lock, so no netns is watched meanwhile.
    pub(crate) fn collectable_spaces(&self, keep: &[u32]) -> Vec<Option<String>> {
        let Some(w) = self.driver.watcher() else {
            return Vec::new();
        };
        let p = &self.settings.name_prefix;
        w.watched()
            .into_iter()
            .filter(|n| parse_uid(p, NameKind::Netns, n).is_none_or(|u| !keep.contains(&u)))
            .map(Some)
            .collect()
    }

    /// Runs `change` (named `what`, e.g. `PUT vm web-1`) under the kernel lock, quieting
    /// `netns` ([`KernelGate::lock`]), within the kernel deadline (see the module docs).
    /// `later` says where the outcome of a change that runs out of time shows.
    ///
    /// # Errors
    /// `change`'s error; `UNAVAILABLE` when the lock or the change took longer than the
    /// deadline, naming what it waited for.
    pub(crate) async fn bounded<T, F, Fut>(
        self: &Arc<Self>,
        what: String,
        later: &str,
        netns: Vec<Option<String>>,
        change: F,
    ) -> Result<T, Error>
    where
        T: Send + 'static,
        F: FnOnce(Arc<Self>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, Error>> + Send + 'static,
    {
        let limit = self.kernel.deadline();
        let deadline = tokio::time::Instant::now() + limit;
        let state = Arc::new(AtomicU8::new(WAITING));
        let me = Arc::clone(self);
        let st = Arc::clone(&state);
        let name = what.clone();
        let name2 = what.clone();
        let mut task = tokio::spawn(async move {
            let _api = super::ApiChange::new(&me);
            let guard = me.kernel.lock(name, netns).await;
            if st
                .compare_exchange(WAITING, RUNNING, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                // The caller gave up while this waited: change nothing.
                drop(guard);
                return None;
            }
            let r = change(Arc::clone(&me)).await;
            drop(guard);
            if st.load(Ordering::Acquire) == LATE {
                match &r {
                    Ok(_) => tracing::info!("{name2}: finished after its deadline"),
                    Err(e) => tracing::warn!("{name2}: finished after its deadline: {e}"),
                }
            }
            Some(r)
        });
        tokio::select! {
            r = &mut task => match r {
                Ok(Some(r)) => r,
                Ok(None) => Err(Error::internal(format!("{what}: given up before the deadline"))),
                Err(e) => Err(Error::internal(format!("{what}: the change's task failed: {e}"))),
            },
            () = tokio::time::sleep_until(deadline) => {
                let secs = limit.as_secs_f64();
                if state
                    .compare_exchange(WAITING, GAVE_UP, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    let m = format!(
                        "{what}: waited {secs:.1} s (the kernel deadline) for the kernel lock, {}; nothing was changed, retry later",
                        self.kernel.holder()
                    );
                    self.kernel.timed_out(&m);
                    Err(Error::unavailable(m))
                } else {
                    state.store(LATE, Ordering::Release);
                    let m = format!(
                        "{what}: the kernel did not finish it within {secs:.1} s (the kernel deadline); it goes on in the background and its outcome shows in {later}"
                    );
                    self.kernel.timed_out(&m);
                    Err(Error::unavailable(m))
                }
            }
        }
    }
}
