//! The agent's Prometheus metrics (`GET /metrics`): what it measures as it works (apply and
//! pass durations, repairs, store errors) and what it reads at scrape time ([`scrape`]).
//!
//! # Design
//! - Encoded with the `prometheus-client` crate in the Prometheus text format (version
//!   0.0.4), which `promtool check metrics` and every Prometheus server read.
//! - Durations are histograms observed where the work happens: a VM change through the API
//!   under the kernel lock ([`AgentMetrics::observe_apply`]) and each reconcile pass. Every
//!   other metric is a snapshot of counters the agent already keeps for `GET /v1/status`,
//!   taken at scrape time: a scrape adds no work to the loops.
//! - A scrape reads the store once (the VMs' states, not their configs, and the pools, in one
//!   transaction), the guards' BPF maps once, the activity map once per stored VM (a lookup
//!   by user id, not a walk of its 65,536 entries), the mesh device once, and no tc state:
//!   the per-VM class counters are those the VM's last converge observed
//!   ([`vmnet_kernel::ns::NsDriver::kept_limit_counters`]), at most one reconcile interval old.
//!   It takes no lock of the VM changes; the per-VM series are encoded from borrowed labels
//!   into a buffer sized from the previous scrape.
//!
//! # Limitations
//! Counters start at zero when the agent starts (Prometheus' `rate()` handles the reset);
//! `vmnet_store_errors_total` counts every agent in the process (one in production).

pub mod scrape;

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use vmnet_model::{Error, ErrorCode};

/// Store failures (the store unreachable, timing out, corrupt) since the process started.
static STORE_ERRORS: AtomicU64 = AtomicU64::new(0);

/// Maps a store error to the API's error, counting it when it is the store's failure
/// (`UNAVAILABLE`, `INTERNAL`) rather than the request's (a conflict, an unknown id).
pub fn store_error(e: vmnet_ipam::IpamError) -> Error {
    let err = crate::api::error::from_ipam(e);
    if matches!(err.code, ErrorCode::Unavailable | ErrorCode::Internal) {
        STORE_ERRORS.fetch_add(1, Ordering::Relaxed);
    }
    err
}

/// The store failures counted so far.
#[must_use]
pub fn store_errors() -> u64 {
    STORE_ERRORS.load(Ordering::Relaxed)
}

/// One label: `(name, value)`.
pub type Label = [(&'static str, &'static str); 1];

/// The histogram constructor of a family.
type NewHistogram = fn() -> Histogram;

/// 1 ms to about 16 s, doubling.
fn duration_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 15))
}

/// What is observed as the agent works.
#[derive(Debug)]
pub struct AgentMetrics {
    /// VM changes through the API by kind.
    pub(crate) apply: Family<Label, Histogram, NewHistogram>,
    /// Reconcile passes by kind.
    pub(crate) passes: Family<Label, Histogram, NewHistogram>,
    /// Drift repairs by (object, trigger).
    repairs: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
    /// The size of the last scrape's body, bytes (the next one's buffer is made that large).
    pub(crate) last_scrape_bytes: std::sync::atomic::AtomicUsize,
}

impl Default for AgentMetrics {
    fn default() -> Self {
        Self {
            apply: Family::new_with_constructor(duration_buckets),
            passes: Family::new_with_constructor(duration_buckets),
            repairs: Mutex::new(BTreeMap::new()),
            last_scrape_bytes: std::sync::atomic::AtomicUsize::new(0),
        }
    }
}

/// The kind of a VM change: `create`, `change` or `delete`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApplyKind {
    /// A PUT of a new VM.
    Create,
    /// A PUT of a stored VM.
    Change,
    /// A DELETE.
    Delete,
}

impl ApplyKind {
    const fn label(self) -> &'static str {
        match self {
            Self::Create => "create",
            Self::Change => "change",
            Self::Delete => "delete",
        }
    }
}

/// What set off a repair: a reconcile pass or a kernel notification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// A reconcile pass (periodic, or run on lost notifications).
    Pass,
    /// A check on a kernel change notification.
    Notification,
}

/// The object kind of a repair line (`host: …`, `vm <id>: …`, `mesh: …`, `pool: …`).
#[must_use]
pub fn object_of(line: &str) -> &'static str {
    if line.starts_with("host:") {
        "host"
    } else if line.starts_with("vm ") {
        "vm"
    } else if line.starts_with("mesh") {
        "mesh"
    } else if line.starts_with("pool") {
        "pool"
    } else {
        "other"
    }
}

impl AgentMetrics {
    /// Records a VM change that took `took`.
    pub fn observe_apply(&self, kind: ApplyKind, took: Duration) {
        self.apply
            .get_or_create(&[("kind", kind.label())])
            .observe(took.as_secs_f64());
    }

    /// Records a reconcile pass (`full` or a change pass) that took `took`.
    pub fn observe_pass(&self, full: bool, took: Duration) {
        let kind = if full { "full" } else { "change" };
        self.passes
            .get_or_create(&[("pass", kind)])
            .observe(took.as_secs_f64());
    }

    /// Counts the repairs `lines` made on `trigger`. Pool mode's table repairs are counted by
    /// its audit instead (the scrape reads them there).
    pub fn count_repairs(&self, trigger: Trigger, lines: &[impl AsRef<str>]) {
        let t = match trigger {
            Trigger::Pass => "pass",
            Trigger::Notification => "notification",
        };
        if let Ok(mut r) = self.repairs.lock() {
            for l in lines {
                let o = object_of(l.as_ref());
                if o != "pool" {
                    *r.entry((o, t)).or_default() += 1;
                }
            }
        }
    }

    /// The repairs counted so far by (object, trigger).
    #[must_use]
    pub fn repairs(&self) -> BTreeMap<(&'static str, &'static str), u64> {
        self.repairs.lock().map(|r| r.clone()).unwrap_or_default()
    }
}
