//! What the pool sandbox reports: a row per instance and the checks, as a table or JSON.

use serde::Serialize;

use super::checks::Check;

/// One row of the instance table.
#[derive(Debug, Clone, Serialize)]
pub struct InstanceRow {
    /// Instance id.
    pub instance: String,
    /// Policy.
    pub policy: String,
    /// The IPv4 lease, or the placement error.
    pub lease: String,
    /// The IPv6 lease, or `-` (no IPv6 range, or no placement).
    pub lease6: String,
    /// The tap, or `-`.
    pub tap: String,
    /// The MAC, or `-`.
    pub mac: String,
    /// The addresses the guest configured from its seed (`cloud-init` for real guests).
    pub seed_address: String,
}

/// What `up` prints with `--output json` for a pool spec.
#[derive(Debug, Clone, Serialize)]
pub struct PoolReport {
    /// The sandbox name.
    pub sandbox: String,
    /// The agent's pid while it ran (it is stopped with the sandbox).
    pub agent_pid: u32,
    /// The agent's whole command line, the `vmnet` binary first.
    pub agent_command: Vec<String>,
    /// Instances.
    pub instances: Vec<InstanceRow>,
    /// Checks.
    pub checks: Vec<Check>,
}

pub(super) fn print(r: &PoolReport) {
    print!("{}", render(r));
}

/// The two tables (instances, checks) in the namespace-mode layout, and the summary line.
fn render(r: &PoolReport) -> String {
    use vmnet_agent::table::render as render_table;
    let rows: Vec<Vec<String>> = r
        .instances
        .iter()
        .map(|i| {
            vec![
                i.instance.clone(),
                i.policy.clone(),
                i.lease.clone(),
                i.lease6.clone(),
                i.tap.clone(),
                i.mac.clone(),
                i.seed_address.clone(),
            ]
        })
        .collect();
    let mut out = format!(
        "pool sandbox {}\nagent pid {} (stopped with the sandbox), command: {}\n\n",
        r.sandbox,
        r.agent_pid,
        crate::agent_args::shell_line(&r.agent_command)
    );
    out.push_str(&render_table(
        &[
            "INSTANCE",
            "POLICY",
            "LEASE",
            "LEASE6",
            "TAP",
            "MAC",
            "SEED ADDRESSES",
        ],
        &rows,
    ));
    out.push('\n');
    out.push_str(&super::checks::table(&r.checks));
    let ok = r.checks.iter().filter(|c| c.ok).count();
    out.push_str(&format!(
        "\n{ok}/{} checks ok; sandbox removed\n",
        r.checks.len()
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_use_the_namespace_mode_layout_and_summary() {
        let r = PoolReport {
            sandbox: "pw1".into(),
            agent_pid: 42,
            agent_command: vec!["/bin/vmnet".into(), "serve".into()],
            instances: vec![InstanceRow {
                instance: "i-1".into(),
                policy: "default".into(),
                lease: "10.0.0.2".into(),
                lease6: "fd00:10::2".into(),
                tap: "bc0".into(),
                mac: "02:00:00:00:00:01".into(),
                seed_address: "10.0.0.2/29".into(),
            }],
            checks: vec![
                Check {
                    name: "i-1 ping gateway".into(),
                    expected: "reply".into(),
                    seen: "reply".into(),
                    ok: true,
                },
                Check {
                    name: "i-1 forged ARP".into(),
                    expected: "dropped".into(),
                    seen: "seen".into(),
                    ok: false,
                },
            ],
        };
        let text = render(&r);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "pool sandbox pw1");
        assert_eq!(
            lines[1],
            "agent pid 42 (stopped with the sandbox), command: /bin/vmnet serve"
        );
        assert!(lines[3].starts_with("INSTANCE  POLICY   LEASE"), "{text}");
        assert!(lines[4].starts_with("--------  -------"), "{text}");
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("CHECK") && l.ends_with("SEEN   RESULT")),
            "{text}"
        );
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("i-1 forged ARP") && l.ends_with("seen   FAIL")),
            "{text}"
        );
        assert_eq!(lines.last(), Some(&"1/2 checks ok; sandbox removed"));
    }
}
