//! The table `vmnet-lab bench drift` prints.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use super::inject::Kind;
use crate::vms::stats;

/// One kind of change.
#[derive(Debug, Clone)]
pub struct KindRow {
    /// The kind.
    pub kind: Kind,
    /// Changes made.
    pub changes: usize,
    /// Change to repair of the repaired ones.
    pub repaired: Vec<Duration>,
    /// Repairs the agent said a notification triggered.
    pub by_notification: usize,
}

/// The storm.
#[derive(Debug, Clone)]
pub struct StormRow {
    /// Its length, seconds.
    pub secs: u32,
    /// Flushes sent.
    pub sent: u32,
    /// The chain flushed.
    pub chain: String,
    /// The agent's CPU over the storm, % of one core.
    pub cpu: Option<f64>,
    /// Notification checks, repairs and back-offs over the storm.
    pub checks: u64,
    /// See [`Self::checks`].
    pub repairs: u64,
    /// See [`Self::checks`].
    pub backoffs: u64,
    /// When the rule was back after the storm's end (`None`: not within the wait).
    pub back_after: Option<Duration>,
}

/// Everything the bench measured.
#[derive(Debug, Clone)]
pub struct Report {
    /// VMs the agent held.
    pub vms: u32,
    /// One row per kind.
    pub rows: Vec<KindRow>,
    /// The agent's CPU while idle, % of one core.
    pub idle_cpu: f64,
    /// The agent's CPU over the changes, % of one core.
    pub run_cpu: Option<f64>,
    /// The storm, when it ran.
    pub storm: Option<StormRow>,
}

/// The rows of `samples` (kind, change to repair if repaired, trigger), by kind.
#[must_use]
pub fn kind_rows(samples: &[(Kind, Option<Duration>, String)]) -> Vec<KindRow> {
    let mut by: BTreeMap<Kind, KindRow> = BTreeMap::new();
    for (kind, took, trigger) in samples {
        let row = by.entry(*kind).or_insert_with(|| KindRow {
            kind: *kind,
            changes: 0,
            repaired: Vec::new(),
            by_notification: 0,
        });
        row.changes += 1;
        if let Some(t) = took {
            row.repaired.push(*t);
            if trigger == "notification" {
                row.by_notification += 1;
            }
        }
    }
    by.into_values().collect()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The table.
#[must_use]
pub fn render(r: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "change to repair at N={} VMs, by kind (reconcile pass and firewall audit an hour apart: only notifications repair; notified: repairs a notification triggered)",
        r.vms
    );
    let _ = writeln!(
        out,
        "{:<34} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "change", "changes", "repaired", "p50 ms", "p99 ms", "max ms", "notified"
    );
    let mut all = Vec::new();
    for row in &r.rows {
        let s = stats(&row.repaired);
        let max = row.repaired.iter().copied().max().map_or(0.0, ms);
        let _ = writeln!(
            out,
            "{:<34} {:>7} {:>9} {:>9.1} {:>9.1} {:>9.1} {:>9}",
            row.kind.label(),
            row.changes,
            row.repaired.len(),
            s.median,
            s.p99,
            max,
            row.by_notification
        );
        all.extend(row.repaired.iter().copied());
    }
    let s = stats(&all);
    let changes: usize = r.rows.iter().map(|row| row.changes).sum();
    let _ = writeln!(
        out,
        "{:<34} {:>7} {:>9} {:>9.1} {:>9.1} {:>9.1} {:>9}",
        "all",
        changes,
        all.len(),
        s.median,
        s.p99,
        all.iter().copied().max().map_or(0.0, ms),
        r.rows.iter().map(|row| row.by_notification).sum::<usize>()
    );
    let _ = writeln!(
        out,
        "goal: p50 <= 100 ms ({}), p99 <= 1000 ms ({}), every change repaired ({})",
        verdict(s.median <= 100.0),
        verdict(s.p99 <= 1000.0),
        verdict(all.len() == changes)
    );
    let _ = writeln!(
        out,
        "agent CPU: idle with {} VMs {:.2} % of a core (goal <= 1 %: {}); during the changes {}",
        r.vms,
        r.idle_cpu,
        verdict(r.idle_cpu <= 1.0),
        r.run_cpu
            .map_or_else(|| "-".to_owned(), |c| format!("{c:.1} % of a core"))
    );
    if let Some(st) = &r.storm {
        let _ = writeln!(
            out,
            "storm: VM 1's firewall chain {} flushed {} times in {} s ({:.0} a second): agent CPU {}, {} checks, {} repairs, {} back-offs; its rules {}",
            st.chain,
            st.sent,
            st.secs,
            f64::from(st.sent) / f64::from(st.secs.max(1)),
            st.cpu
                .map_or_else(|| "-".to_owned(), |c| format!("{c:.1} % of a core")),
            st.checks,
            st.repairs,
            st.backoffs,
            st.back_after.map_or_else(
                || "were not back within 30 s".to_owned(),
                |d| format!("were back {:.0} ms after the storm", ms(d))
            )
        );
    }
    out
}

fn verdict(ok: bool) -> &'static str {
    if ok { "met" } else { "missed" }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_group_by_kind_and_count_what_was_repaired() {
        let ms = Duration::from_millis;
        let samples = vec![
            (Kind::NatRule, Some(ms(40)), "notification".to_owned()),
            (Kind::VethDown, None, String::new()),
            (Kind::NatRule, Some(ms(60)), "pass".to_owned()),
        ];
        let rows = kind_rows(&samples);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].kind, Kind::NatRule);
        assert_eq!((rows[0].changes, rows[0].repaired.len()), (2, 2));
        assert_eq!(rows[0].by_notification, 1);
        assert_eq!((rows[1].changes, rows[1].repaired.len()), (1, 0));
        let text = render(&Report {
            vms: 3,
            rows,
            idle_cpu: 0.5,
            run_cpu: Some(20.0),
            storm: None,
        });
        assert!(text.contains("every change repaired (missed)"), "{text}");
        assert!(text.contains("idle with 3 VMs 0.50 %"), "{text}");
    }
}
