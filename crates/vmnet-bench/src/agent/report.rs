//! The table `vmnet-lab bench agent` prints: a row per checkpoint and the target lines.

use std::fmt::Write as _;
use std::time::Duration;

use super::{AgentRow, DeletePhase};
use crate::procstat::ProcUsage;
use crate::vms::{Stats, stats};

/// The medians of the first and the last 100 samples (all of them when fewer) and their ratio.
fn drift_ratio(samples: &[Duration]) -> (f64, f64, f64) {
    let k = samples.len().min(100);
    let first = stats(&samples[..k]).median;
    let last = stats(&samples[samples.len() - k..]).median;
    (first, last, last / first.max(1e-9))
}

fn mib(kib: u64) -> String {
    format!("{:.1}", kib as f64 / 1024.0)
}

/// Renders the table and the target lines.
#[must_use]
pub fn render(rows: &[AgentRow], again: Stats, after: &ProcUsage, del: &DeletePhase) -> String {
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let s = stats(&r.puts);
            let put = |v: f64| {
                if r.puts.is_empty() {
                    "-".to_owned()
                } else {
                    format!("{v:.2}")
                }
            };
            vec![
                r.n.to_string(),
                r.puts.len().to_string(),
                put(s.median),
                put(s.p99),
                mib(r.usage.rss_kib),
                mib(r.usage.hwm_kib),
                r.usage.threads.to_string(),
                match r.usage.fd_limit {
                    Some(l) => format!("{}/{l}", r.usage.fds),
                    None => r.usage.fds.to_string(),
                },
                r.pass_ms.map_or_else(|| "-".to_owned(), |p| p.to_string()),
            ]
        })
        .collect();
    let mut out = vmnet_agent::table::render(
        &[
            "VMS",
            "PUTS",
            "PUT MED ms",
            "PUT P99 ms",
            "RSS MiB",
            "HWM MiB",
            "THREADS",
            "FDS/LIMIT",
            "PASS ms",
        ],
        &table,
    );
    out.push('\n');
    let _ = writeln!(
        out,
        "re-PUT of an unchanged VM x100: median {:.2} ms, p99 {:.2} ms; RSS after {} MiB, HWM {} MiB",
        again.median,
        again.p99,
        mib(after.rss_kib),
        mib(after.hwm_kib)
    );
    if let (Some(first), Some(last)) = (rows.first(), rows.last())
        && last.n > first.n
    {
        let per_vm = last.usage.rss_kib.saturating_sub(first.usage.rss_kib) as f64
            / f64::from(last.n - first.n);
        let _ = writeln!(
            out,
            "RSS growth: {per_vm:.1} KiB per VM from {} to {} VMs",
            first.n, last.n
        );
    }
    if let Some(r) = rows.iter().find(|r| r.n >= 1000) {
        let m = r.usage.rss_kib as f64 / 1024.0;
        let _ = writeln!(
            out,
            "agent RSS at N={}: {m:.1} MiB (target < 64 MiB at 1000): {}",
            r.n,
            if m < 64.0 { "met" } else { "MISSED" }
        );
    }
    if let Some(r) = rows.last() {
        let _ = writeln!(
            out,
            "open descriptors at N={}: {} (per VM a metadata listener and an nf_tables generation socket, plus a fixed set; limit {}): {}",
            r.n,
            r.usage.fds,
            r.usage
                .fd_limit
                .map_or_else(|| "unlimited".to_owned(), |l| l.to_string()),
            if r.usage.fds < 2 * u64::from(r.n) + 256 {
                "ok"
            } else {
                "HIGH"
            }
        );
    }
    let puts: Vec<Duration> = rows.iter().flat_map(|r| r.puts.iter().copied()).collect();
    let n = puts.len();
    for (what, samples, target) in [
        ("PUT of a new VM", &puts, 4.0),
        ("DELETE", &del.deletes, 5.0),
    ] {
        if samples.is_empty() {
            continue;
        }
        let s = stats(samples);
        let (first, last, ratio) = drift_ratio(samples);
        let k = samples.len().min(100);
        let _ = writeln!(
            out,
            "{what} at N={n}: median {:.2} ms, p99 {:.2} ms (target <= {target} ms): {}; \
             last-{k}/first-{k} median {last:.2}/{first:.2} ms = {ratio:.2}x (target <= 1.2x): {}",
            s.median,
            s.p99,
            verdict(s.median <= target),
            verdict(ratio <= 1.2)
        );
    }
    if !del.deletes.is_empty() {
        let _ = writeln!(
            out,
            "left on the host after deleting all VMs: {} ({:.2} s after the last DELETE): {}",
            if del.leftovers.is_empty() {
                "nothing".to_owned()
            } else {
                format!("objects of user ids {:?}", del.leftovers)
            },
            del.settled_after.as_secs_f64(),
            verdict(del.leftovers.is_empty())
        );
    }
    out
}

fn verdict(ok: bool) -> &'static str {
    if ok { "met" } else { "MISSED" }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_rows_and_targets() {
        let row = |n: u32, rss_mib: u64| AgentRow {
            n,
            puts: vec![Duration::from_millis(3); n as usize],
            usage: ProcUsage {
                rss_kib: rss_mib * 1024,
                hwm_kib: rss_mib * 1024,
                threads: 5,
                fds: 20,
                fd_limit: Some(1024),
            },
            pass_ms: Some(u64::from(n)),
        };
        let del = DeletePhase {
            deletes: (0..1000).map(|i| Duration::from_micros(4000 + i)).collect(),
            leftovers: vec![7],
            settled_after: Duration::from_secs(10),
        };
        let text = render(
            &[row(0, 20), row(1000, 70)],
            Stats::default(),
            &ProcUsage::default(),
            &del,
        );
        assert!(text.contains("20/1024"), "{text}");
        assert!(text.contains("51.2 KiB per VM"), "{text}");
        assert!(
            text.contains("70.0 MiB (target < 64 MiB at 1000): MISSED"),
            "{text}"
        );
        assert!(
            text.contains("PUT of a new VM at N=1000: median 3.00 ms, p99 3.00 ms (target <= 4 ms): met; last-100/first-100 median 3.00/3.00 ms = 1.00x (target <= 1.2x): met"),
            "{text}"
        );
        // 4.000..4.999 ms: the last 100 (4.90..4.99 ms) against the first 100 (4.00..4.09 ms).
        assert!(
            text.contains("DELETE at N=1000: median 4.50 ms, p99 4.99 ms (target <= 5 ms): met; last-100/first-100 median 4.95/4.05 ms = 1.22x (target <= 1.2x): MISSED"),
            "{text}"
        );
        assert!(
            text.contains("objects of user ids [7] (10.00 s after the last DELETE): MISSED"),
            "{text}"
        );
        let text = render(
            &[row(0, 20), row(1000, 30)],
            Stats::default(),
            &ProcUsage::default(),
            &DeletePhase::default(),
        );
        assert!(
            text.contains("30.0 MiB (target < 64 MiB at 1000): met"),
            "{text}"
        );
        assert!(!text.contains("DELETE"), "{text}");
    }
}
