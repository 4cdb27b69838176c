//! The firewall audit: every `--firewall-audit-secs` (default [`DEFAULT_FIREWALL_AUDIT_SECS`])
//! the filter table of each VM whose firewall filters (enabled, applied without error) is
//! compared with its plan by content and replaced when it differs (a rule added, edited or
//! removed, a chain's policy changed); each repair is logged and counted per VM
//! (`GET /v1/vms/{id}`: `firewall_repairs`) and in `GET /v1/status` (`firewall`). An unchanged
//! table is read, never rewritten.
//!
//! # Design
//! - The filter lives in the VM's netns table, which every full reconcile pass also compares
//!   (every `--reconcile-interval-secs`); the audit is that comparison alone, on its own period,
//!   one VM at a time under the kernel lock (API changes interleave between VMs).
//! - A reconcile pass that replaces the table of a VM whose firewall filters counts as a
//!   firewall repair of that VM too: whichever finds the change first repairs it.
//! - A replacement also removes the VM's tracked connections the rules do not admit (the
//!   driver's sweep), so a connection opened through a hole made by hand is cut with it.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use vmnet_ipam::vm_store;
use vmnet_model::Error;
use vmnet_model::vm::parse_vm_config;

use super::{Agent, store_tx};
use crate::status::{FirewallAuditStatus, now_ms};

/// Default seconds between firewall audits.
pub const DEFAULT_FIREWALL_AUDIT_SECS: u64 = 60;

/// How many repair lines the status keeps.
const LAST_REPAIRS: usize = 10;

/// The audit's record: the status body and the repairs per VM id.
#[derive(Debug, Default)]
pub(crate) struct FirewallRecord {
    pub status: FirewallAuditStatus,
    pub per_vm: BTreeMap<String, u64>,
}

impl Agent {
    /// Sets the period of the firewall audit ([`Agent::run_loop`] runs it). Call before the loop
    /// starts.
    pub fn set_firewall_audit_period(&self, period: Duration) {
        if let Ok(mut p) = self.firewall_period.lock() {
            *p = period;
        }
        if let Ok(mut r) = self.firewall.lock() {
            r.status.audit_period_secs = period.as_secs();
        }
    }

    /// The period of the firewall audit.
    #[must_use]
    pub fn firewall_audit_period(&self) -> Duration {
        self.firewall_period
            .lock()
            .map(|p| *p)
            .unwrap_or(Duration::from_secs(DEFAULT_FIREWALL_AUDIT_SECS))
    }

    /// Counts one replaced filter table of VM `id` (user id `uid`) with its differences, and
    /// publishes it as a `firewall_repaired` event of `trigger`.
    pub(crate) fn count_firewall_repair(
        &self,
        (id, uid): (&str, u32),
        differences: &[String],
        trigger: crate::events::Trigger,
    ) {
        let body = crate::events::EventBody::FirewallRepaired {
            trigger,
            differences: differences.to_vec(),
        };
        self.emit_vm(id, uid, body);
        if let Ok(mut r) = self.firewall.lock() {
            *r.per_vm.entry(id.to_owned()).or_default() += 1;
            r.status.repairs_total += 1;
            r.status
                .last_repairs
                .push(format!("vm {id}: {}", differences.join("; ")));
            let n = r.status.last_repairs.len();
            if n > LAST_REPAIRS {
                r.status.last_repairs.drain(..n - LAST_REPAIRS);
            }
        }
    }

    /// The firewall repairs of VM `id` since the agent started.
    pub(crate) fn firewall_repairs_of(&self, id: &str) -> u64 {
        self.firewall
            .lock()
            .ok()
            .and_then(|r| r.per_vm.get(id).copied())
            .unwrap_or(0)
    }

    /// The firewall audit's status.
    pub(crate) fn firewall_status(&self) -> FirewallAuditStatus {
        self.firewall
            .lock()
            .map(|r| r.status.clone())
            .unwrap_or_default()
    }

    /// Runs one firewall audit now: every VM whose firewall filters in its applied config has
    /// its filter table compared with the plan and replaced when it differs. Returns the
    /// repairs, one line per VM.
    ///
    /// # Errors
    /// `UNAVAILABLE` when the store cannot be read. Per-VM failures are recorded in the status.
    pub async fn audit_firewalls(&self) -> Result<Vec<String>, Error> {
        let clock = Instant::now();
        let rows = store_tx!(self.db(), tx => vm_store::list(tx).await)?;
        let mut repairs = Vec::new();
        let mut errors = Vec::new();
        let mut tables = 0u64;
        for row in rows {
            // Only a VM whose desired config is applied without error: any other is the
            // reconcile pass's business.
            if row.last_error.is_some() || row.applied.as_deref() != Some(row.config.as_str()) {
                continue;
            }
            let Ok(cfg) = parse_vm_config(row.config.as_bytes()) else {
                continue;
            };
            if !cfg.firewall.as_ref().is_some_and(|f| f.enabled) {
                continue;
            }
            let Ok(plan) = self.plan(&cfg) else { continue };
            if plan.firewall.is_none() {
                continue;
            }
            self.yield_to_api().await;
            // The audit replaces the VM's netns table and nothing in the host.
            let _kernel = self
                .kernel
                .lock(
                    format!("firewall audit: vm {}", row.id),
                    [Some(plan.netns.clone())],
                )
                .await;
            self.pass_progress();
            tables += 1;
            match self.driver().audit_table(&plan).await {
                Ok(None) => {}
                Ok(Some(diffs)) => {
                    tracing::warn!(vm = %row.id, op = "firewall-repair", differences = ?diffs, "firewall audit: the filter table was changed behind the agent's back; replaced it");
                    let trigger = crate::events::Trigger::Audit;
                    self.count_firewall_repair((&row.id, cfg.user_id), &diffs, trigger);
                    repairs.push(format!("vm {}: {}", row.id, diffs.join("; ")));
                }
                Err(e) => errors.push(format!("vm {}: {e}", row.id)),
            }
        }
        if let Ok(mut r) = self.firewall.lock() {
            r.status.audits += 1;
            r.status.last_audit_at_unix_ms = Some(now_ms());
            r.status.last_audit_duration_ms =
                Some(u64::try_from(clock.elapsed().as_millis()).unwrap_or(u64::MAX));
            r.status.last_audit_tables = tables;
            r.status.last_errors = errors;
        }
        Ok(repairs)
    }
}
