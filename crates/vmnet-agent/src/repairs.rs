//! The repair counters of `GET /v1/status` (`reconcile.repairs`): repairs by object kind and by
//! what found them (a kernel change notification or a reconcile pass), and the time from a
//! change's notification to the end of its repair as a histogram and a recent p50/p99.
//!
//! # Design
//! - Plain counters that only grow, so a scraper (Prometheus) can read them as they are: per
//!   kind ([`vmnet_kernel::ns::ObjectKind`], every kind listed from the start, zero until
//!   repaired) the repairs by trigger; a repair of a VM that touched a route and an nft rule
//!   counts once for each kind.
//! - The change-to-repair times: a cumulative histogram over fixed bounds (1 ms … 5 s, µs; the
//!   count is the `+Inf` bucket) and the sum, plus the 50th and 99th percentile of the last
//!   [`WINDOW`] repairs, for a reader without a histogram. Only notifications give a change's
//!   time; a pass's repairs have none.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};
use vmnet_kernel::ns::ObjectKind;

/// How many recent change-to-repair times the percentiles cover.
pub const WINDOW: usize = 1000;

/// The histogram's upper bounds, µs.
pub const BOUNDS_US: [u64; 12] = [
    1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000, 200_000, 500_000, 1_000_000, 2_000_000,
    5_000_000,
];

/// What found a repair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// A check run on a kernel change notification (a full pass run on lost notifications
    /// included).
    Notification,
    /// A reconcile pass (periodic, at start, or woken).
    Pass,
}

/// Repairs by trigger.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TriggerCounts {
    /// Found by a check on a kernel change notification.
    pub notification: u64,
    /// Found by a reconcile pass.
    pub pass: u64,
}

impl TriggerCounts {
    fn add(&mut self, trigger: Trigger, n: u64) {
        match trigger {
            Trigger::Notification => self.notification += n,
            Trigger::Pass => self.pass += n,
        }
    }
}

/// The time from a change's first notification to the end of its repair.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChangeToRepair {
    /// Repairs timed.
    pub count: u64,
    /// Their times added up, µs.
    pub sum_us: u64,
    /// The histogram's upper bounds, µs ([`BOUNDS_US`]).
    pub bucket_le_us: Vec<u64>,
    /// Repairs that took at most the bound of the same index (cumulative; `count` is the
    /// `+Inf` bucket).
    pub bucket_counts: Vec<u64>,
    /// The median of the last 1,000 repairs, µs; `null` before the first.
    pub p50_us: Option<u64>,
    /// The 99th percentile of the last 1,000 repairs, µs; `null` before the first.
    pub p99_us: Option<u64>,
    #[serde(skip)]
    recent: VecDeque<u64>,
}

impl Default for ChangeToRepair {
    fn default() -> Self {
        Self {
            count: 0,
            sum_us: 0,
            bucket_le_us: BOUNDS_US.to_vec(),
            bucket_counts: vec![0; BOUNDS_US.len()],
            p50_us: None,
            p99_us: None,
            recent: VecDeque::new(),
        }
    }
}

impl ChangeToRepair {
    /// Records one repair that took `us` µs from its change.
    pub fn record(&mut self, us: u64) {
        self.count += 1;
        self.sum_us = self.sum_us.saturating_add(us);
        for (b, n) in self.bucket_le_us.iter().zip(self.bucket_counts.iter_mut()) {
            if us <= *b {
                *n += 1;
            }
        }
        if self.recent.len() == WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(us);
        let mut v: Vec<u64> = self.recent.iter().copied().collect();
        v.sort_unstable();
        self.p50_us = percentile(&v, 50);
        self.p99_us = percentile(&v, 99);
    }
}

/// The `p`th percentile (nearest rank) of sorted `v`.
fn percentile(v: &[u64], p: usize) -> Option<u64> {
    if v.is_empty() {
        return None;
    }
    let rank = (v.len() * p).div_ceil(100).max(1);
    v.get(rank - 1).copied()
}

/// One repair: its line for the log and the pass outcome, and the kinds of object it put back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Repaired {
    /// `vm <id>: <changes>` or `host: <change>`.
    pub line: String,
    /// The kinds of object put back (each once).
    pub kinds: Vec<ObjectKind>,
}

impl Repaired {
    /// The repair of `changes` (none: `None`), `prefix` naming where (`vm <id>`, `host`).
    #[must_use]
    pub fn of(prefix: &str, changes: &[&vmnet_kernel::ns::Change]) -> Option<Self> {
        if changes.is_empty() {
            return None;
        }
        let lines: Vec<String> = changes.iter().map(ToString::to_string).collect();
        let mut kinds: Vec<ObjectKind> = changes.iter().flat_map(|c| c.kinds()).collect();
        kinds.sort_unstable();
        kinds.dedup();
        Some(Self {
            line: format!("{prefix}: {}", lines.join("; ")),
            kinds,
        })
    }
}

/// The repair counters (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RepairStatus {
    /// Repairs (one per VM or host-wide check that put something back) by trigger.
    pub by_trigger: TriggerCounts,
    /// Repairs by the kind of object put back (`link`, `address`, `route`, `rule`,
    /// `neighbour`, `sysctl`, `nft_table`, `nft_chain`, `nft_rule`, `nft_set`, `tc_qdisc`,
    /// `tc_class`, `tc_filter`, `bpf_map`, `netns`, `other`) and trigger.
    pub by_kind: BTreeMap<String, TriggerCounts>,
    /// From a change's notification to the end of its repair.
    pub change_to_repair: ChangeToRepair,
}

impl Default for RepairStatus {
    fn default() -> Self {
        Self {
            by_trigger: TriggerCounts::default(),
            by_kind: ObjectKind::ALL
                .iter()
                .map(|k| (k.as_str().to_owned(), TriggerCounts::default()))
                .collect(),
            change_to_repair: ChangeToRepair::default(),
        }
    }
}

impl RepairStatus {
    /// Records `repairs` repairs found by `trigger` that touched `kinds` (each counted once per
    /// time it is listed).
    pub fn record(&mut self, trigger: Trigger, repairs: u64, kinds: &[ObjectKind]) {
        self.by_trigger.add(trigger, repairs);
        for k in kinds {
            self.by_kind
                .entry(k.as_str().to_owned())
                .or_default()
                .add(trigger, 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_histogram_is_cumulative_and_the_percentiles_cover_the_window() {
        let mut c = ChangeToRepair::default();
        assert_eq!((c.p50_us, c.p99_us), (None, None));
        for us in [500, 1_500, 30_000, 7_000_000] {
            c.record(us);
        }
        assert_eq!(c.count, 4);
        assert_eq!(c.sum_us, 7_032_000);
        assert_eq!(c.bucket_counts[0], 1, "≤ 1 ms");
        assert_eq!(c.bucket_counts[1], 2, "≤ 2 ms");
        assert_eq!(c.bucket_counts[5], 3, "≤ 50 ms");
        assert_eq!(
            *c.bucket_counts.last().unwrap(),
            3,
            "7 s is above every bound"
        );
        assert_eq!(c.p50_us, Some(1_500));
        assert_eq!(c.p99_us, Some(7_000_000));
        for _ in 0..WINDOW {
            c.record(40_000);
        }
        assert_eq!(
            (c.p50_us, c.p99_us),
            (Some(40_000), Some(40_000)),
            "old times left the window"
        );
        assert_eq!(c.count, 1004);
    }

    #[test]
    fn kinds_and_triggers_count_separately_and_every_kind_is_listed() {
        let mut r = RepairStatus::default();
        assert_eq!(r.by_kind.len(), ObjectKind::ALL.len());
        r.record(
            Trigger::Notification,
            1,
            &[ObjectKind::Route, ObjectKind::NftRule],
        );
        r.record(Trigger::Pass, 2, &[ObjectKind::Route]);
        assert_eq!(
            r.by_trigger,
            TriggerCounts {
                notification: 1,
                pass: 2
            }
        );
        assert_eq!(
            r.by_kind["route"],
            TriggerCounts {
                notification: 1,
                pass: 1
            }
        );
        assert_eq!(r.by_kind["nft_rule"].notification, 1);
        assert_eq!(r.by_kind["link"], TriggerCounts::default());
    }
}
