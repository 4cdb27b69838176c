//! The tables of `vmnet-lab bench wake` and the figures they show.

use std::fmt::Write as _;
use std::time::Duration;

use vmnet_agent::table::{Align, render_aligned};
use vmnet_agent::wake::hold::Counters;

/// How the agent runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Wake on packet as it ships (the agent's defaults).
    Hold,
    /// `--wake-hold-secs 0`: nothing held, the first SYN lost.
    NoHold,
}

impl Mode {
    /// Its name in the tables.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Hold => "hold (default)",
            Self::NoHold => "no hold (--wake-hold-secs 0)",
        }
    }

    /// A short tag for file names.
    #[must_use]
    pub fn tag(self) -> &'static str {
        match self {
            Self::Hold => "hold",
            Self::NoHold => "nohold",
        }
    }

    /// The agent's arguments for it, after `--activity-root`.
    #[must_use]
    pub fn agent_args(self) -> Vec<&'static str> {
        match self {
            Self::Hold => Vec::new(),
            Self::NoHold => vec!["--wake-hold-secs", "0"],
        }
    }
}

/// One connection to a sleeping VM.
#[derive(Debug, Clone, Copy)]
pub struct Connected {
    /// From `connect()` to established.
    pub took: Duration,
    /// Segments the client retransmitted (`tcpi_total_retrans`): SYNs, before established.
    pub retrans: u32,
    /// Whether the guest's echo answered.
    pub served: bool,
}

/// One mode's connections and the agent's wake counters over them.
#[derive(Debug, Clone)]
pub struct ModeResult {
    /// The mode.
    pub mode: Mode,
    /// Every connection, in order.
    pub connections: Vec<Connected>,
    /// What the VM's wake counters moved by (`None` without wake on packet).
    pub counters: Option<Counters>,
}

impl ModeResult {
    /// No connection yet.
    #[must_use]
    pub fn new(mode: Mode) -> Self {
        Self {
            mode,
            connections: Vec::new(),
            counters: None,
        }
    }

    fn times(&self) -> Vec<Duration> {
        let mut t: Vec<Duration> = self.connections.iter().map(|c| c.took).collect();
        t.sort_unstable();
        t
    }
}

/// The `p`-th percentile (nearest rank, 0 < p ≤ 100) of `sorted`; zero when empty.
#[must_use]
pub fn percentile(sorted: &[Duration], p: usize) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = (p * sorted.len()).div_ceil(100).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// The median of `sorted` (the mean of the middle two for an even count); zero when empty.
#[must_use]
pub fn median(sorted: &[Duration]) -> Duration {
    let n = sorted.len();
    match n {
        0 => Duration::ZERO,
        _ if n % 2 == 1 => sorted[n / 2],
        _ => (sorted[n / 2 - 1] + sorted[n / 2]) / 2,
    }
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

/// The table of the connections to a sleeping VM.
#[must_use]
pub fn render_connect(results: &[ModeResult], attach_ms: u64) -> String {
    let mut out = format!(
        "vmnet-lab bench wake: connect() from the fake internet to a sleeping VM's mesh address, the relay (the VMM) attached {attach_ms} ms after connect()\n"
    );
    let rows: Vec<Vec<String>> = results
        .iter()
        .map(|r| {
            let t = r.times();
            let retrans: u32 = r.connections.iter().map(|c| c.retrans).sum();
            let max_retrans = r.connections.iter().map(|c| c.retrans).max().unwrap_or(0);
            let served = r.connections.iter().filter(|c| c.served).count();
            let (wakes, held, delivered) = r.counters.map_or_else(
                || ("-".into(), "-".into(), "-".into()),
                |c| {
                    (
                        c.wakes.to_string(),
                        c.held.to_string(),
                        c.delivered.to_string(),
                    )
                },
            );
            vec![
                r.mode.name().into(),
                r.connections.len().to_string(),
                ms(median(&t)),
                ms(percentile(&t, 90)),
                ms(t.last().copied().unwrap_or_default()),
                format!("{retrans} / {max_retrans}"),
                served.to_string(),
                wakes,
                held,
                delivered,
            ]
        })
        .collect();
    let mut align = vec![Align::Left];
    align.extend([Align::Right; 9]);
    out.push_str(&render_aligned(
        &[
            "MODE",
            "CONNECTIONS",
            "MEDIAN",
            "P90",
            "MAX",
            "SYN RETRANS (SUM / MAX)",
            "SERVED",
            "VM_WAKE",
            "HELD",
            "DELIVERED",
        ],
        &align,
        &rows,
    ));
    if let [hold, no_hold] = results {
        let (h, n) = (median(&hold.times()), median(&no_hold.times()));
        let _ = writeln!(
            out,
            "median connect() to established: {} with the hold against {} without ({} after the attach with the hold)",
            ms(h),
            ms(n),
            ms(h.saturating_sub(Duration::from_millis(attach_ms)))
        );
    }
    out
}

/// The ratio `with / without` in percent.
#[must_use]
pub fn ratio(with: f64, without: f64) -> f64 {
    100.0 * with / without.max(1e-9)
}

fn median_f(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => v[n / 2],
        _ => f64::midpoint(v[n / 2 - 1], v[n / 2]),
    }
}

/// The table of the awake cost: one row per round, MiB/s with the hold and without.
#[must_use]
pub fn render_iperf(rows: &[Vec<f64>], secs: u32) -> String {
    let mut out = format!(
        "vmnet-lab bench wake: iperf3 from the fake internet to an awake VM's guest (userspace frame relay), {secs} s per run, alternately\n"
    );
    let col = |i: usize| rows.iter().map(move |r| r.get(i).copied().unwrap_or(0.0));
    let mut cells: Vec<Vec<String>> = rows
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let (h, n) = (
                r.first().copied().unwrap_or(0.0),
                r.get(1).copied().unwrap_or(0.0),
            );
            vec![
                (i + 1).to_string(),
                format!("{h:.1}"),
                format!("{n:.1}"),
                format!("{:.1} %", ratio(h, n)),
            ]
        })
        .collect();
    let (h, n) = (
        median_f(&mut col(0).collect::<Vec<_>>()),
        median_f(&mut col(1).collect::<Vec<_>>()),
    );
    cells.push(vec![
        "median".into(),
        format!("{h:.1}"),
        format!("{n:.1}"),
        format!("{:.1} %", ratio(h, n)),
    ]);
    out.push_str(&render_aligned(
        &["ROUND", "HOLD MiB/s", "NO HOLD MiB/s", "RATIO"],
        &[Align::Left, Align::Right, Align::Right, Align::Right],
        &cells,
    ));
    let mut paired: Vec<f64> = rows
        .iter()
        .map(|r| {
            ratio(
                r.first().copied().unwrap_or(0.0),
                r.get(1).copied().unwrap_or(0.0),
            )
        })
        .collect();
    let _ = writeln!(
        out,
        "median of the rounds' ratios (each round's two runs back to back, so a drift of the host's load cancels): {:.1} %",
        median_f(&mut paired)
    );
    out.push_str("target: ratio ≥ 98 %\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    #[test]
    fn percentiles_by_nearest_rank() {
        let v: Vec<Duration> = (1..=20).map(d).collect();
        assert_eq!(percentile(&v, 90), d(18));
        assert_eq!(percentile(&v, 100), d(20));
        assert_eq!(percentile(&v, 1), d(1));
        assert_eq!(median(&v), Duration::from_micros(10_500));
        assert_eq!(median(&[d(3)]), d(3));
        assert_eq!(percentile(&[], 90), Duration::ZERO);
        assert_eq!(median(&[]), Duration::ZERO);
    }

    #[test]
    fn connect_table_sums_retransmissions_and_counts_served() {
        let mut hold = ModeResult::new(Mode::Hold);
        let mut no = ModeResult::new(Mode::NoHold);
        for i in 0..4 {
            hold.connections.push(Connected {
                took: d(101 + i),
                retrans: 0,
                served: true,
            });
            no.connections.push(Connected {
                took: d(1010 + i),
                retrans: 1,
                served: i != 0,
            });
        }
        hold.counters = Some(Counters {
            wakes: 4,
            held: 4,
            delivered: 4,
            ..Counters::default()
        });
        let t = render_connect(&[hold, no], 100);
        let hold_line = t.lines().find(|l| l.starts_with("hold")).unwrap();
        assert!(hold_line.contains("102.5 ms"), "{t}");
        assert!(hold_line.contains("0 / 0"), "{t}");
        let no_line = t.lines().find(|l| l.starts_with("no hold")).unwrap();
        assert!(
            no_line.contains("1011.5 ms") && no_line.contains("4 / 1"),
            "{t}"
        );
        assert!(no_line.contains(" 3 "), "{t}");
        assert!(no_line.trim_end().ends_with('-'), "{t}");
        assert!(t.contains("102.5 ms with the hold against 1011.5 ms without (2.5 ms after"));
    }

    #[test]
    fn iperf_table_shows_the_ratio_of_the_medians() {
        let t = render_iperf(
            &[
                vec![990.0, 1000.0],
                vec![1000.0, 1000.0],
                vec![500.0, 400.0],
            ],
            3,
        );
        let m = t.lines().find(|l| l.starts_with("median")).unwrap();
        assert!(
            m.contains("990.0") && m.contains("1000.0") && m.contains("99.0 %"),
            "{t}"
        );
        assert!(t.contains("125.0 %"));
        // Rounds' ratios 99.0, 100.0 and 125.0 %.
        assert!(t.contains("cancels): 100.0 %"), "{t}");
    }
}
