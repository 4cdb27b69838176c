//! The table `vmnet-lab bench boot` prints: figure, value, goal, whether it was met.

use std::fmt::Write as _;
use std::time::Duration;

use super::Start;

/// Goal from start to ready after a reboot, at 1,000 VMs.
pub const REBOOT_GOAL: Duration = Duration::from_secs(3);

/// Goal from start to ready after an agent restart, at 1,000 VMs.
pub const RESTART_GOAL: Duration = Duration::from_millis(500);

/// What the bench measured.
#[derive(Debug, Clone)]
pub struct BootRow {
    /// VMs in the store.
    pub n: u32,
    /// The start after the reboot.
    pub reboot: Start,
    /// VM namespaces on the host once that agent was ready.
    pub booted_netns: usize,
    /// The start on the kernel state in place.
    pub restart: Start,
    /// What the restart rewrote: namespaces (nf_tables commits, made again) and host veths.
    pub changed: (Vec<String>, Vec<String>),
    /// One observe of the host with the VMs in place, from the bench.
    pub observe: Duration,
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1000.0)
}

fn verdict(ok: bool) -> &'static str {
    if ok { "met" } else { "MISSED" }
}

/// A list of at most 3 items and how many more.
fn some(items: &[String]) -> String {
    let mut s = items.iter().take(3).cloned().collect::<Vec<_>>().join(", ");
    if items.len() > 3 {
        let _ = write!(s, " and {} more", items.len() - 3);
    }
    s
}

/// Whether an adoption line of the log changed only the guest guard (the map entry, the tap's
/// filter program): a new agent loads its own guard and registers every VM with it.
fn only_guard(line: &str) -> bool {
    let Some((_, changes)) = line.split_once("changes=[") else {
        return false;
    };
    let changes = changes.rsplit_once(']').map_or(changes, |(c, _)| c);
    changes.split("\", \"").all(|c| c.contains("guard"))
}

/// Renders the table and, when something is wrong, a line saying what.
#[must_use]
pub fn render(r: &BootRow) -> String {
    let n = r.n;
    let (a, b) = (&r.reboot, &r.restart);
    let dash = || "-".to_owned();
    let pass = |s: &Start| {
        s.status
            .reconcile
            .last_duration_ms
            .map_or_else(dash, |d| format!("{d} ms"))
    };
    let cpu = |s: &Start| {
        format!(
            "{} of the agent, {} of the host (2 cores: {} ms of CPU per wall s)",
            s.cpu.map_or_else(dash, ms),
            s.host_cpu.map_or_else(dash, ms),
            s.host_cpu.map_or_else(dash, |h| format!(
                "{:.0}",
                h.as_secs_f64() * 1000.0 / s.ready.as_secs_f64().max(1e-3)
            ))
        )
    };
    let ra = &a.status.reconcile;
    let rb = &b.status.reconcile;
    let rewrites = rb.drift_repairs_total + rb.notifications.repairs_total;
    let (guard_only, other): (Vec<&String>, Vec<&String>) =
        b.adoptions.iter().partition(|l| only_guard(l));
    let other: Vec<String> = other.into_iter().cloned().collect();
    let (ns, veths) = &r.changed;
    let mut rows: Vec<Vec<String>> = vec![
        vec![
            format!("reboot (N={n} stored, empty kernel): start to API up"),
            ms(a.api),
            dash(),
            dash(),
        ],
        vec![
            "reboot: start to every VM applied (first pass ends)".to_owned(),
            a.first_pass_end.map_or_else(dash, ms),
            format!("<= {} s", REBOOT_GOAL.as_secs()),
            a.first_pass_end
                .map_or_else(dash, |d| verdict(d <= REBOOT_GOAL).to_owned()),
        ],
        vec![
            "reboot: start to /readyz 200".to_owned(),
            ms(a.ready),
            format!("<= {} s", REBOOT_GOAL.as_secs()),
            verdict(a.ready <= REBOOT_GOAL).to_owned(),
        ],
        vec![
            "reboot: the first pass".to_owned(),
            format!(
                "{}, {} VMs made again, {} failed, {} errors",
                pass(a),
                ra.pass_repairs_total,
                a.status.vms.failed,
                ra.last_errors.len()
            ),
            dash(),
            dash(),
        ],
        vec!["reboot: CPU to ready".to_owned(), cpu(a), dash(), dash()],
        vec![
            "reboot: VM namespaces once ready".to_owned(),
            r.booted_netns.to_string(),
            n.to_string(),
            verdict(r.booted_netns == n as usize).to_owned(),
        ],
        vec![
            format!("restart (N={n}, kernel state there): start to API up"),
            ms(b.api),
            dash(),
            dash(),
        ],
        vec![
            "restart: start to /readyz 200".to_owned(),
            ms(b.ready),
            format!("<= {} ms", RESTART_GOAL.as_millis()),
            verdict(b.ready <= RESTART_GOAL).to_owned(),
        ],
        vec![
            "restart: the first pass".to_owned(),
            format!("{}, {} errors", pass(b), rb.last_errors.len()),
            dash(),
            dash(),
        ],
        vec!["restart: CPU to ready".to_owned(), cpu(b), dash(), dash()],
        vec![
            "restart: VM tables taken as checked from the previous agent (not listed)".to_owned(),
            b.tables_taken.to_string(),
            dash(),
            dash(),
        ],
        vec![
            "restart: one observe of the host (netns, host veths, rules), from the bench"
                .to_owned(),
            ms(r.observe),
            dash(),
            dash(),
        ],
        vec![
            "restart: repairs counted / other adoptions logged".to_owned(),
            format!("{rewrites} / {}", other.len()),
            "0 / 0".to_owned(),
            verdict(rewrites == 0 && other.is_empty()).to_owned(),
        ],
        vec![
            "restart: VMs given this agent's guest guard (map entry, program swapped on the tap)"
                .to_owned(),
            guard_only.len().to_string(),
            "by design".to_owned(),
            dash(),
        ],
        vec![
            format!(
                "restart: namespaces with an nf_tables commit or made again (of {})",
                n + 1
            ),
            ns.len().to_string(),
            "0".to_owned(),
            verdict(ns.is_empty()).to_owned(),
        ],
        vec![
            "restart: host veths made again".to_owned(),
            veths.len().to_string(),
            "0".to_owned(),
            verdict(veths.is_empty()).to_owned(),
        ],
    ];
    if n != 1000 {
        for row in &mut rows {
            if row[2].starts_with("<=") {
                row[2].push_str(" at 1000");
            }
        }
    }
    let mut out = vmnet_agent::table::render(&["FIGURE", "VALUE", "GOAL", "MET"], &rows);
    for (what, items) in [
        ("restart: rewritten namespaces", ns),
        ("restart: host veths", veths),
        ("reboot: errors of the first pass", &ra.last_errors),
        ("restart: errors of the first pass", &rb.last_errors),
        ("restart: other adoptions", &other),
    ] {
        if !items.is_empty() {
            let _ = writeln!(out, "{what}: {}", some(items));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const GUARD: &str = r#"2026-12-07T08:06:32.619937Z  INFO vmnet_agent::reconcile: configure on start: replaced an earlier agent's objects vm=bench-1 op="adopt" changes=["vm: upgrade pft0001: no entry in this agent's guard: written", "vm: upgrade pft0001: pft0001's guard filter runs program 3171: program 3177 swapped in"]"#;

    #[test]
    fn an_adoption_of_the_guard_alone_is_told_apart() {
        assert!(only_guard(GUARD));
        let more = GUARD.replace(
            "swapped in\"]",
            "swapped in\", \"vm: upgrade pft0001: nft table replaced\"]",
        );
        assert!(!only_guard(&more));
        assert!(!only_guard(
            "configure on start: replaced an earlier agent's objects"
        ));
    }

    #[test]
    fn a_long_list_is_cut_after_three() {
        let items: Vec<String> = (1..=5).map(|i| i.to_string()).collect();
        assert_eq!(some(&items), "1, 2, 3 and 2 more");
        assert_eq!(some(&items[..2]), "1, 2");
    }
}
