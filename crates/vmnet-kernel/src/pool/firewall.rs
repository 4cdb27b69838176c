//! The three bcd nftables tables on one host: full replace, one instance added or removed as a
//! small element batch, and the drift audit (spec: "bcd's nftables tables").
//!
//! # Design
//! [`PoolFirewall`] holds the desired [`Firewall`] (plain data from `vmnet-plan`), the census the
//! plan expects (elements per set) and the census read back right after the last full replace
//! (the rules as the kernel lists them). Every change is one nft transaction through an
//! [`NftExec`] — libnftables in-process ([`LibNft`]) or the agent's root helper. The first tap
//! on a host and the last one going away are full replaces (the backstop tables appear and go);
//! everything else is element adds/deletes whose size does not depend on how many taps exist.
//!
//! [`PoolFirewall::audit`] lists the ruleset, compares rules and element counts of the three
//! tables with what was loaded and, on any difference (a missing table, an edited rule, a
//! missing element — none of which another process can cause while the owner lives), re-applies
//! the whole desired state atomically, logs the difference and counts it.
//!
//! # The gap: what guests can do while the tables are not as loaded
//! The three tables are *owned* (table flag `owner`) by the netlink socket of the executor's one
//! long-lived libnftables context — the root helper's in the agent ([`apply_owned`] makes each
//! table with the fixed text command [`owner_command`] before the JSON batch; nft 1.0.6 cannot
//! set table flags in JSON and the flag cannot be added to an existing table). Decided:
//! - **External flush or edit: no gap.** Another process's `nft flush ruleset` leaves the
//!   tables and their rules intact, and `nft delete table`, `nft flush table`, `nft add rule`
//!   or element changes on them fail with `EPERM`; frames keep being filtered throughout
//!   (tested with spoofed frames right after the flush: `tests/pool_drift.rs`). The audit stays
//!   as the second line of defence and for other drift (e.g. a missing table).
//! - **The owner dies** (the helper crashes or is killed; the agent stops): the kernel deletes
//!   the three tables with the socket. The agent watches its helper ([`OwnerWatch`]): on the
//!   child's exit it starts a new helper at once and re-applies the full desired state (the
//!   window is the helper's start plus one replace: 25–35 ms from the exit to the tables
//!   re-applied, 40–50 ms from the kill until an outside `nft list` shows them, one tap, 2-core
//!   test host; `vmnet-agent/tests/pool_helper.rs`, `vmnet/tests/kernel_agent_pool.rs`). While the agent itself is down the tables
//!   are gone until it starts again. In such a window only the bridge still filters: a tap's
//!   port is locked with learning off and a static FDB entry for the NIC's MAC
//!   ([`super::tap`]), so frames with another source MAC are dropped; IP/ARP source checks,
//!   the policies, the DHCP/RA drops and the host-address drop do not hold.
//! - A table that exists without the flag (left by an older agent) is replaced by an empty
//!   owned one in one transaction just before the batch that fills it (a sub-millisecond gap,
//!   once).
//!
//! nft 1.0.6 mis-frees the flags of a table with one flag while it prints the table as JSON (a
//! use-after-free that corrupted this process's heap in testing), so bcd's tables are listed
//! object by object ([`list_owned`]), never with `list ruleset`/`list table(s)` in-process.
//!
//! Not available here: the `persist` flag (tables surviving their owner) is not in nft 1.0.6; a
//! tc layer on each tap needs `act_gact` (drop), which this kernel lacks.

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use vmnet_model::Error;
use vmnet_model::nic::{InstanceSpec, instance_hash10};
use vmnet_plan::pool::census::{Census, drift};
use vmnet_plan::pool::nft::{
    Change, Firewall, needs_full_replace, owner_command, render_full, render_instance,
    tables_to_own, tap_entries,
};

use super::libnft::{LibNft, LibNftError};

/// Applies nft JSON batches and lists the ruleset: libnftables in-process ([`LibNft`]) or the
/// agent's root helper.
pub trait NftExec: Send + Sync {
    /// Applies one nft JSON batch as one transaction.
    ///
    /// # Errors
    /// A message from nft or from the transport when the batch was refused or not delivered;
    /// nothing of the batch is applied then.
    fn apply(&self, batch: &str) -> Result<(), FirewallError>;

    /// The ruleset as nft JSON (`nft -j list ruleset`).
    ///
    /// # Errors
    /// When nft or the transport fails.
    fn list(&self) -> Result<String, FirewallError>;

    /// A handle on the process whose socket owns the tables, for a watchdog that restarts it
    /// and re-applies when it dies (see the module docs). `None` (the default): the owner is
    /// this process (in-process libnftables), nothing to watch.
    fn owner_watch(&self) -> Option<Arc<dyn OwnerWatch>> {
        None
    }
}

/// The owner of the tables as a separate process (the root helper), watched without holding
/// the firewall: when it dies the kernel has deleted the tables.
pub trait OwnerWatch: Send + Sync {
    /// Waits up to `timeout` for the owner to exit; `true` when it has (and stays so until
    /// [`Self::restart`]).
    fn wait_lost(&self, timeout: Duration) -> bool;

    /// Starts a new owner in place of the one that exited; the caller then re-applies the
    /// tables ([`PoolFirewall::reapply`]).
    ///
    /// # Errors
    /// When the new owner cannot be started.
    fn restart(&self) -> Result<(), FirewallError>;
}

/// The nft JSON command that lists the ruleset. Not used on bcd's owned tables from a
/// long-lived process (see [`list_owned`]).
pub const LIST_RULESET: &str = r#"{"nftables":[{"list":{"ruleset":null}}]}"#;

/// Applies `batch` (nft JSON; `doc` is it parsed) through `nft` so that bcd's tables belong to
/// `nft`'s socket: first every table the batch defines something in
/// ([`tables_to_own`]) is made with the fixed text command [`owner_command`] (one transaction, a
/// no-op for tables this context owns already), then the batch as one transaction. A table
/// that exists without the flag is deleted and made again, owned and empty, in one transaction
/// (the batch that follows fills it). Element-only batches skip the first step.
///
/// # Errors
/// [`LibNftError::Refused`] when nft refuses either step (e.g. `EPERM`: another socket owns a
/// table); when the batch is refused, nothing of it is applied.
pub fn apply_owned(nft: &LibNft, doc: &Value, batch: &str) -> Result<(), LibNftError> {
    let tables = tables_to_own(doc);
    if !tables.is_empty() {
        let all: Vec<String> = tables.iter().map(|t| owner_command(*t)).collect();
        if nft.run_text(&all.join("\n")).is_err() {
            for t in &tables {
                let own = owner_command(*t);
                if nft.run_text(&own).is_err() {
                    nft.run_text(&format!("delete table {} {}\n{own}", t.0, t.1))?;
                }
            }
        }
    }
    nft.run(batch).map(drop)
}

/// The items of every `{"nftables":[…]}` line nft printed (one per `list` command), metainfo
/// left out.
fn items(out: &str) -> Result<Vec<Value>, LibNftError> {
    let mut all = Vec::new();
    for line in out.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).map_err(|e| LibNftError::Refused {
            status: 0,
            message: format!("listing is not JSON: {e}"),
        })?;
        let list = v.get("nftables").and_then(Value::as_array).cloned();
        all.extend(
            list.unwrap_or_default()
                .into_iter()
                .filter(|i| i.get("metainfo").is_none()),
        );
    }
    Ok(all)
}

/// Lists bcd's three tables as one nft JSON document (`{"nftables":[…]}`: chains with their
/// rules, sets and maps with their elements) without ever printing a table object: nft 1.0.6
/// frees the flags of a table with exactly one flag (`owner`) while it prints them
/// (`table_flags_json`), a use-after-free that corrupts a long-lived process's heap, so `list
/// ruleset` and `list table` are not used. First the chains, sets and maps of all tables, then
/// each of bcd's in full, one run each. A table without any chain or set reads as absent.
///
/// # Errors
/// As [`LibNft::run`].
pub fn list_owned(nft: &LibNft) -> Result<String, LibNftError> {
    let names = items(&nft.run(
        r#"{"nftables":[{"list":{"chains":null}},{"list":{"sets":null}},{"list":{"maps":null}}]}"#,
    )?)?;
    let mut cmds = Vec::new();
    for item in &names {
        let Some((kind, body)) = item.as_object().and_then(|o| o.iter().next()) else {
            continue;
        };
        let fam = body.get("family").and_then(Value::as_str).unwrap_or("");
        let tbl = body.get("table").and_then(Value::as_str).unwrap_or("");
        let name = body.get("name").and_then(Value::as_str).unwrap_or("");
        let owned = vmnet_plan::pool::nft::OWNED_TABLES
            .iter()
            .any(|(f, t)| *f == fam && *t == tbl);
        if owned && matches!(kind.as_str(), "chain" | "set" | "map") {
            let cmd = serde_json::json!({ "list": { kind.as_str(): {
                "family": fam, "table": tbl, "name": name } } });
            if !cmds.contains(&cmd) {
                cmds.push(cmd);
            }
        }
    }
    // One run per object: nft 1.0.6 narrows its cache to the chain or set of one `list`
    // command, so several in one run fail for all but one.
    let mut all = Vec::new();
    for cmd in cmds {
        let doc = serde_json::json!({ "nftables": [cmd] }).to_string();
        all.extend(items(&nft.run(&doc)?)?);
    }
    Ok(serde_json::json!({ "nftables": all }).to_string())
}

impl NftExec for LibNft {
    fn apply(&self, batch: &str) -> Result<(), FirewallError> {
        let doc: Value = serde_json::from_str(batch).unwrap_or(Value::Null);
        apply_owned(self, &doc, batch).map_err(FirewallError::Nft)
    }

    fn list(&self) -> Result<String, FirewallError> {
        list_owned(self).map_err(FirewallError::Nft)
    }
}

/// Errors of the pool firewall.
#[derive(Debug, thiserror::Error)]
pub enum FirewallError {
    /// nft refused a batch (nothing of it applied) or could not be run.
    #[error("nftables")]
    Nft(#[source] LibNftError),
    /// The root helper refused the batch or could not be reached.
    #[error("root helper: {0}")]
    Helper(String),
    /// The plan refused the input.
    #[error("plan: {0}")]
    Plan(#[source] Error),
    /// The listing could not be read, or did not show what was just loaded.
    #[error("read-back: {0}")]
    ReadBack(String),
}

impl FirewallError {
    /// The documented error this maps to: plan errors keep their code, the rest are
    /// `UNAVAILABLE` (the kernel or the helper failed; the previous state is kept).
    #[must_use]
    pub fn to_error(&self) -> Error {
        match self {
            Self::Plan(e) => e.clone(),
            other => Error::unavailable(format!("pool firewall: {}", chain(other))),
        }
    }
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// What one audit found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AuditReport {
    /// The differences found (empty: no drift).
    pub drift: Vec<String>,
    /// Whether the desired state was re-applied.
    pub repaired: bool,
}

/// Counters for the status report.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct FirewallStatus {
    /// Taps with rules.
    pub taps: usize,
    /// Audits that found drift and re-applied.
    pub drift_repairs: u64,
    /// The differences of the last drift found.
    pub last_drift: Vec<String>,
}

/// The bcd tables of one host, driven through `E`.
#[derive(Debug)]
pub struct PoolFirewall<E: NftExec> {
    exec: E,
    desired: Firewall,
    planned: Census,
    reference: Census,
    loaded: bool,
    status: FirewallStatus,
}

impl<E: NftExec> PoolFirewall<E> {
    /// A driver that has loaded nothing yet; call [`Self::replace`] before any VM starts.
    pub fn new(exec: E) -> Self {
        Self {
            exec,
            desired: Firewall::default(),
            planned: Census::default(),
            reference: Census::default(),
            loaded: false,
            status: FirewallStatus::default(),
        }
    }

    /// The executor (e.g. to run a listing in tests).
    pub fn exec(&self) -> &E {
        &self.exec
    }

    /// The desired state as last applied.
    pub fn desired(&self) -> &Firewall {
        &self.desired
    }

    /// Counters for the status report.
    pub fn status(&self) -> FirewallStatus {
        FirewallStatus {
            taps: self.desired.taps.len(),
            ..self.status.clone()
        }
    }

    /// Lists the three tables as they are in the kernel.
    ///
    /// # Errors
    /// When nft cannot list or its output is not JSON.
    pub fn observe(&self) -> Result<Census, FirewallError> {
        let out = self.exec.list()?;
        let v: Value = serde_json::from_str(&out)
            .map_err(|e| FirewallError::ReadBack(format!("listing is not JSON: {e}")))?;
        Ok(Census::of(&v))
    }

    /// Replaces all three tables with `fw` in one transaction, then reads them back. On failure
    /// the previous tables stay as they were (the batch is atomic).
    ///
    /// # Errors
    /// [`FirewallError::Nft`] when nft refuses the batch; [`FirewallError::ReadBack`] when the
    /// listing does not show the rules just loaded.
    pub fn replace(&mut self, fw: Firewall) -> Result<(), FirewallError> {
        let doc = render_full(&fw);
        self.exec.apply(&doc.to_string())?;
        let planned = Census::of(&doc);
        let observed = self.observe()?;
        self.desired = fw;
        self.planned = planned;
        self.loaded = true;
        if observed.rule_counts() != self.planned.rule_counts() {
            let msg = format!(
                "loaded {:?} rules, listed {:?}",
                self.planned.rule_counts(),
                observed.rule_counts()
            );
            self.reference = Census::default();
            return Err(FirewallError::ReadBack(msg));
        }
        self.reference = observed;
        Ok(())
    }

    /// Adds one instance's taps: one element batch, or a full replace when it is the host's
    /// first tap. The rules exist before the caller creates the taps.
    ///
    /// # Errors
    /// [`FirewallError::Plan`] for an invalid instance or one already present (`CONFLICT`);
    /// otherwise as [`Self::replace`].
    pub fn add_instance(&mut self, inst: &InstanceSpec) -> Result<(), FirewallError> {
        let entries = tap_entries(inst).map_err(FirewallError::Plan)?;
        if entries
            .iter()
            .any(|e| self.desired.taps.iter().any(|t| t.tap == e.tap))
        {
            return Err(FirewallError::Plan(Error::conflict(format!(
                "instance {}: its taps have rules on this host already",
                inst.id
            ))));
        }
        let mut next = self.desired.clone();
        next.taps.extend(entries.iter().cloned());
        next.taps.sort_by(|a, b| a.tap.cmp(&b.tap));
        self.change(next, &entries, Change::Add)
    }

    /// Removes one instance's taps (by instance id): one element batch, or a full replace when
    /// it was the host's last tap. Removing an instance without taps here does nothing.
    ///
    /// # Errors
    /// As [`Self::replace`].
    pub fn remove_instance(&mut self, instance_id: &str) -> Result<(), FirewallError> {
        let prefix = format!("bc{}n", instance_hash10(instance_id));
        let (gone, kept): (Vec<_>, Vec<_>) = self
            .desired
            .taps
            .iter()
            .cloned()
            .partition(|t| t.tap.as_str().starts_with(&prefix));
        if gone.is_empty() {
            return Ok(());
        }
        let next = Firewall {
            taps: kept,
            host: self.desired.host.clone(),
        };
        self.change(next, &gone, Change::Remove)
    }

    fn change(
        &mut self,
        next: Firewall,
        entries: &[vmnet_plan::pool::nft::TapEntry],
        change: Change,
    ) -> Result<(), FirewallError> {
        if !self.loaded || needs_full_replace(&self.desired, &next) {
            return self.replace(next);
        }
        let doc = render_instance(entries, change);
        self.exec.apply(&doc.to_string())?;
        self.planned.apply(&doc);
        self.desired = next;
        Ok(())
    }

    /// Re-applies the desired state in full (after the owner of the tables was restarted: the
    /// kernel deleted them with the old one). Does nothing before the first [`Self::replace`].
    ///
    /// # Errors
    /// As [`Self::replace`].
    pub fn reapply(&mut self) -> Result<(), FirewallError> {
        if !self.loaded {
            return Ok(());
        }
        self.replace(self.desired.clone())
    }

    /// Compares the kernel with what was loaded and re-applies on any difference.
    ///
    /// # Errors
    /// When the listing fails, or the repair fails (the next audit tries again).
    pub fn audit(&mut self) -> Result<AuditReport, FirewallError> {
        if !self.loaded {
            return Ok(AuditReport::default());
        }
        let observed = self.observe()?;
        let found = drift(&self.reference, &self.planned, &observed);
        if found.is_empty() {
            return Ok(AuditReport::default());
        }
        tracing::warn!(drift = ?found, "pool firewall drifted; re-applying the bcd tables");
        self.status.drift_repairs += 1;
        self.status.last_drift.clone_from(&found);
        self.replace(self.desired.clone())?;
        Ok(AuditReport {
            drift: found,
            repaired: true,
        })
    }
}

#[cfg(test)]
#[path = "firewall_tests.rs"]
mod tests;
