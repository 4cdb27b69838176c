//! The class counters of each VM as its last converge observed them
//! ([`crate::ns::NsDriver::kept_limit_counters`]).

use std::collections::HashMap;
use std::sync::Mutex;

use super::LimitCounters;

/// The kept counters, by user id; only VMs with a limit in force.
#[derive(Debug, Default)]
pub(crate) struct KeptCounters(Mutex<HashMap<u32, Vec<LimitCounters>>>);

impl KeptCounters {
    /// Keeps `counters` of `uid` (forgets it when no limit is in force).
    pub(crate) fn keep(&self, uid: u32, counters: Vec<LimitCounters>) {
        if let Ok(mut c) = self.0.lock() {
            if counters.iter().any(|r| r.applied) {
                c.insert(uid, counters);
            } else {
                c.remove(&uid);
            }
        }
    }

    /// Forgets `uid` (its VM is removed).
    pub(crate) fn forget(&self, uid: u32) {
        if let Ok(mut c) = self.0.lock() {
            c.remove(&uid);
        }
    }

    /// Every VM's kept counters.
    pub(crate) fn all(&self) -> HashMap<u32, Vec<LimitCounters>> {
        self.0.lock().map(|c| c.clone()).unwrap_or_default()
    }
}
