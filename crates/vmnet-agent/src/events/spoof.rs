//! Spoof-drop summaries: what moved in the guards' drop counters since the last look.
//!
//! # Design
//! - Every [`SPOOF_SUMMARY_SECS`], while at least one stream follows the bus, the agent reads
//!   the counters it already keeps for `GET /v1/status` (namespace mode's guest guard per VM,
//!   pool mode's tap guard for the host, one map walk each) and publishes one `spoof_drops`
//!   event per VM whose counters moved (and one for the pool guard), with the increments by
//!   kind ([`moved`]). A guest flooding spoofed frames is one event per interval, never one
//!   per frame.
//! - With nobody following, nothing is read and the last counts are forgotten: the first look
//!   after a stream starts sets the baseline, the next reports.

use std::collections::BTreeMap;

/// Seconds between two looks at the drop counters.
pub const SPOOF_SUMMARY_SECS: u64 = 10;

/// Counters by kind.
pub type Counts = BTreeMap<String, u64>;

/// The increments from `before` to `now`, only the kinds that moved. A counter that went down
/// (the VM was made again and its counters restarted) counts from zero.
#[must_use]
pub fn moved(before: Option<&Counts>, now: &Counts) -> Counts {
    now.iter()
        .filter_map(|(k, n)| {
            let was = before.and_then(|b| b.get(k)).copied().unwrap_or(0);
            let d = if *n >= was { n - was } else { *n };
            (d > 0).then(|| (k.clone(), d))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(pairs: &[(&str, u64)]) -> Counts {
        pairs.iter().map(|(k, n)| ((*k).to_owned(), *n)).collect()
    }

    #[test]
    fn only_what_moved_is_reported() {
        let before = c(&[("ipv4_source", 10), ("arp", 2)]);
        let now = c(&[("ipv4_source", 15), ("arp", 2), ("ipv6_source", 1)]);
        assert_eq!(
            moved(Some(&before), &now),
            c(&[("ipv4_source", 5), ("ipv6_source", 1)])
        );
        assert!(moved(Some(&now), &now).is_empty());
        // Restarted counters count from zero; no baseline counts everything.
        assert_eq!(moved(Some(&now), &c(&[("arp", 1)])), c(&[("arp", 1)]));
        assert_eq!(moved(None, &c(&[("arp", 3)])), c(&[("arp", 3)]));
    }
}
