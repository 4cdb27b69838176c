//! What the worker should serve, per VM, and how far the running worker has caught up with it.
//!
//! # Design
//! - Every change to the table (a new listener, a new document, a VM forgotten) takes the next
//!   change number and marks its VM dirty. The pump sends the dirty VMs' messages, then a
//!   `sync` carrying the newest change number it sent; the worker handles its messages in
//!   order and answers `synced` with the same number once everything before it is in place.
//! - [`Settled`] holds the highest number a worker confirmed. A caller that must not answer
//!   before the guest can read its new document (the API's `PUT`) waits for its change number
//!   there, for a bounded time: a dead or restarting worker delays the answer, it never
//!   blocks it.
//! - A new worker is sent every VM again, followed by a `sync` of the current number, so a
//!   change made while no worker ran is confirmed by the next one.

use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio::sync::watch;
use vmnet_model::vm::metadata::MetadataVersion;

/// One VM as the worker should serve it.
#[derive(Debug, Clone)]
pub(super) struct VmEntry {
    pub listener: Arc<OwnedFd>,
    /// Bumped for every new listener.
    pub generation: u64,
    pub version: MetadataVersion,
    pub document: Arc<Value>,
}

/// The VMs the worker should serve and the ones whose message it has not been sent yet.
#[derive(Debug, Default)]
pub(super) struct Table {
    pub vms: BTreeMap<String, VmEntry>,
    pub dirty: BTreeSet<String>,
    generation: u64,
    /// The number of the last change.
    changes: u64,
}

/// A change to the table, to wait for with [`Settled::wait`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Change(pub(super) u64);

impl Table {
    fn changed(&mut self, vm: &str) -> Change {
        self.changes += 1;
        self.dirty.insert(vm.to_owned());
        Change(self.changes)
    }

    /// Serves `vm` on a new listener.
    pub fn listen(
        &mut self,
        vm: &str,
        listener: OwnedFd,
        version: MetadataVersion,
        document: Value,
    ) -> Change {
        self.generation += 1;
        let generation = self.generation;
        self.vms.insert(
            vm.to_owned(),
            VmEntry {
                listener: Arc::new(listener),
                generation,
                version,
                document: Arc::new(document),
            },
        );
        self.changed(vm)
    }

    /// `vm`'s new document: `None` when it has no listener or the document is the same.
    pub fn document(
        &mut self,
        vm: &str,
        version: MetadataVersion,
        document: Value,
    ) -> Option<Change> {
        let e = self.vms.get_mut(vm)?;
        if e.version == version && *e.document == document {
            return None;
        }
        e.version = version;
        e.document = Arc::new(document);
        Some(self.changed(vm))
    }

    /// Forgets `vm`: `None` when it was not served.
    pub fn forget(&mut self, vm: &str) -> Option<Change> {
        self.vms.remove(vm)?;
        Some(self.changed(vm))
    }

    /// Takes the dirty VMs (with what each should now be, `None` for forgotten) and the number
    /// of the newest change among them.
    pub fn take_dirty(&mut self) -> (Vec<(String, Option<VmEntry>)>, Change) {
        let dirty = std::mem::take(&mut self.dirty);
        let work = dirty
            .into_iter()
            .map(|vm| {
                let e = self.vms.get(&vm).cloned();
                (vm, e)
            })
            .collect();
        (work, Change(self.changes))
    }

    /// Marks every VM dirty, for a new worker.
    pub fn all_dirty(&mut self) {
        let all: Vec<String> = self.vms.keys().cloned().collect();
        self.dirty.extend(all);
    }
}

/// The newest change a worker confirmed, and whether a wait ran out since the last
/// confirmation: then the next waits do not wait (a worker that stopped confirming, dead or
/// compromised by a guest, costs the API one bounded wait, not one per request).
#[derive(Debug)]
pub struct Settled(watch::Sender<u64>, std::sync::atomic::AtomicBool);

impl Default for Settled {
    fn default() -> Self {
        Self(
            watch::Sender::new(0),
            std::sync::atomic::AtomicBool::new(false),
        )
    }
}

impl Settled {
    /// Records that a worker confirmed every change up to `c`.
    pub(super) fn confirm(&self, c: Change) {
        self.1.store(false, std::sync::atomic::Ordering::Relaxed);
        self.0.send_if_modified(|v| {
            let newer = c.0 > *v;
            if newer {
                *v = c.0;
            }
            newer
        });
    }

    /// Whether change `c` is confirmed.
    #[must_use]
    pub fn has(&self, c: Change) -> bool {
        *self.0.borrow() >= c.0
    }

    /// Waits until change `c` is confirmed, at most `within` (not at all while an earlier wait
    /// ran out and nothing was confirmed since); whether it was.
    pub async fn wait(&self, c: Change, within: Duration) -> bool {
        use std::sync::atomic::Ordering;
        if self.has(c) {
            return true;
        }
        if self.1.load(Ordering::Relaxed) {
            return false;
        }
        let mut rx = self.0.subscribe();
        let done = tokio::time::timeout(within, rx.wait_for(|v| *v >= c.0))
            .await
            .is_ok_and(|r| r.is_ok());
        if !done {
            self.1.store(true, Ordering::Relaxed);
        }
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fd() -> OwnedFd {
        std::fs::File::open("/dev/null").unwrap().into()
    }

    #[test]
    fn every_change_takes_the_next_number_and_a_same_document_none() {
        let mut t = Table::default();
        let v = MetadataVersion::V2;
        let a = t.listen("a", fd(), v, json!({"x": 1}));
        assert_eq!(t.document("a", v, json!({"x": 1})), None);
        let b = t.document("a", v, json!({"x": 2})).unwrap();
        assert!(b > a);
        assert_eq!(t.document("nobody", v, json!({})), None);
        let (work, upto) = t.take_dirty();
        assert_eq!(work.len(), 1);
        assert_eq!(upto, b);
        let c = t.forget("a").unwrap();
        assert!(c > b);
        assert_eq!(t.forget("a"), None);
        let (work, upto) = t.take_dirty();
        assert!(work[0].1.is_none());
        assert_eq!(upto, c);
    }

    #[tokio::test]
    async fn a_wait_ends_when_confirmed_or_after_its_bound() {
        let s = Arc::new(Settled::default());
        assert!(!s.wait(Change(1), Duration::from_millis(20)).await);
        // A worker's confirmation (of nothing new) ends the stall the timed-out wait marked.
        s.confirm(Change(0));
        let s2 = Arc::clone(&s);
        let h = tokio::spawn(async move { s2.wait(Change(2), Duration::from_secs(5)).await });
        tokio::time::sleep(Duration::from_millis(10)).await;
        s.confirm(Change(1));
        s.confirm(Change(3));
        assert!(h.await.unwrap());
        s.confirm(Change(2));
        assert!(s.has(Change(3)), "a confirmation never goes back");
        // A wait that runs out makes the next ones return at once, until a confirmation.
        assert!(!s.wait(Change(4), Duration::from_millis(20)).await);
        let t0 = std::time::Instant::now();
        assert!(!s.wait(Change(5), Duration::from_secs(5)).await);
        assert!(t0.elapsed() < Duration::from_secs(1), "did not wait again");
        s.confirm(Change(4));
        let s2 = Arc::clone(&s);
        let h = tokio::spawn(async move { s2.wait(Change(5), Duration::from_secs(5)).await });
        tokio::time::sleep(Duration::from_millis(10)).await;
        s.confirm(Change(5));
        assert!(h.await.unwrap(), "waits again after a confirmation");
    }
}
