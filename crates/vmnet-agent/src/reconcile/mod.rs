//! The reconcile pass: read the store, observe the kernel, apply the desired VMs, collect
//! orphans. A *full* pass runs at start and every interval; a *change* pass runs when woken
//! ([`Agent::wake`], debounced). API changes do not wake it: they apply their VM themselves.
//!
//! # Design
//! - Passes run one at a time (the pass lock). Every driver call holds the kernel lock, taken
//!   per step of up to [`PASS_BATCH`] VMs: API changes interleave between the steps of a pass
//!   (a pass at 1000 VMs does not stall the API for seconds), and the pass re-reads each VM's
//!   row under the lock, so it never applies a config older than the store's. The VMs of a
//!   step whose desired config is applied without error converge concurrently (the driver
//!   takes different VMs at once; each waits on netlink answers and its netns thread, so
//!   together they keep both cores busy); any other VM of the step converges alone after them
//!   ([`order::together`]). Before each step a pass yields to API changes:
//!   it waits until none was seen for [`API_QUIET`] (at most [`API_YIELD_MAX`] per step), so a
//!   burst of PUTs or DELETEs runs without a pass competing for the kernel lock, the CPU and
//!   the kernel's own locks; under endless API changes a pass still takes one step per
//!   [`API_YIELD_MAX`]. Garbage collection reads the desired set afresh
//!   under the lock. When a stored VM no longer plans (e.g. the agent restarted with a smaller
//!   transit range), collection is skipped and reported: nothing a stored VM may own is removed.
//! - A full pass first checks and repairs the host-wide state (forwarding, router
//!   advertisements on the uplink, the host nft table), then applies every desired VM with its
//!   *desired* config (the driver is idempotent: an applied VM costs a per-VM observe and no
//!   change), which is also the drift audit: a link, address, route, rule or nft table (compared
//!   by content) changed behind our back is repaired in place within the pass. Each repair is
//!   logged with what differed and counted (`drift_repairs_total`): a change made to a VM whose
//!   stored config was applied without error is drift, a change to any other VM is not.
//! - A change pass observes the host once (namespaces, host veths) and applies only the VMs
//!   that are not known good: not applied yet, failed, or with their netns or host veth missing.
//!   The API already applied the VM it changed, so a burst of PUTs does not cost a full pass each.
//! - A pass converges the VMs with a route via a gateway VM's mesh address after the others
//!   ([`order::pass_order`]): a gateway repaired in the pass (its host route lost, its veth down) is
//!   in place when the VMs behind it resolve their routes, instead of their routes getting the
//!   `unreachable` guard until the next pass.
//! - When an apply fails, the last good config is re-applied and the error recorded on the VM;
//!   the next pass tries again.
//! - Garbage collection gets the user ids of every desired VM (the desired config's and, while
//!   it differs, the applied config's), so nothing a stored VM uses is ever collected. Each
//!   config must plan (a config that no longer plans stops the collection): one the pass
//!   itself planned for the VM counts with its user id, any other is planned and its plan
//!   dropped at once. A pass holds one plan at a time, so its memory does not grow with the
//!   VM count, and it plans each VM once (a VM whose apply fails, twice: its last good config).
//! - The store is written only when a VM's outcome changed, so an idle agent does not write.
//! - Between passes the loop also runs the firewall audit every `--firewall-audit-secs`
//!   ([`Agent::audit_firewalls`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;

use vmnet_ipam::vm_store::{self, VmRow};
use vmnet_kernel::ns::{Change, ObjectKind, ObservedVm};
use vmnet_model::Error;
use vmnet_model::vm::parse_vm_config;

use crate::agent::{Agent, store_tx};
use crate::events::{Applied, EventBody};
use crate::repairs::{Repaired, Trigger};
use crate::status::now_ms;

mod order;

/// The most VMs a pass converges together under one hold of the kernel lock (see the module
/// docs).
const PASS_BATCH: usize = 2;

/// How long the loop waits after a wake-up before its pass, so a burst of API changes costs one
/// pass.
pub const WAKE_DEBOUNCE: std::time::Duration = std::time::Duration::from_millis(200);

/// A pass takes the kernel lock for its next step only once no VM change through the API has
/// been seen for this long (or after [`API_YIELD_MAX`]): a burst of PUTs or DELETEs, one right
/// after the other, is not slowed by a pass observing and applying other VMs in between.
pub const API_QUIET: Duration = Duration::from_millis(20);

/// The longest a pass waits for [`API_QUIET`] before one step: under endless API changes it
/// still makes progress, one step per this interval.
pub const API_YIELD_MAX: Duration = Duration::from_millis(100);

/// What one pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PassOutcome {
    /// VMs applied without error.
    pub applied: u64,
    /// Errors, one line each, naming the VM or object.
    pub errors: Vec<String>,
    /// User ids whose orphaned objects were removed.
    pub collected: Vec<u32>,
    /// VMs (by user id) the kernel showed with our prefix before the pass.
    pub observed: u64,
    /// Drift repaired by the pass, one line per repair: `host: …` for the host-wide state,
    /// `vm <id>: <changes>` for a VM.
    pub repaired: Vec<String>,
    /// The kinds of object those repairs put back, once per repair that touched them (the
    /// mesh's repairs count as `other`).
    pub repaired_kinds: Vec<ObjectKind>,
}

impl PassOutcome {
    fn add(&mut self, r: Repaired) {
        self.repaired.push(r.line);
        self.repaired_kinds.extend(r.kinds);
    }

    fn add_lines(&mut self, lines: Vec<String>) {
        self.repaired_kinds
            .extend(std::iter::repeat_n(ObjectKind::Other, lines.len()));
        self.repaired.extend(lines);
    }
}

impl Agent {
    /// Runs one full reconcile pass now (waiting for any change in progress) and records it in
    /// the status.
    ///
    /// # Errors
    /// `UNAVAILABLE` when the store cannot be read (nothing was changed then). Per-VM failures
    /// do not fail the pass; they are in the outcome and on the VMs.
    pub async fn reconcile(&self) -> Result<PassOutcome, Error> {
        self.run_pass(true, Trigger::Pass).await
    }

    /// A full pass run on a kernel change notification (lost notifications, or a change no
    /// narrower check covers): as [`Agent::reconcile`], its repairs counted as found by a
    /// notification.
    pub(crate) async fn reconcile_notified(&self) -> Result<PassOutcome, Error> {
        self.run_pass(true, Trigger::Notification).await
    }

    /// Runs one change pass now (see the module docs): applies only the VMs that are not known
    /// good, then collects orphans.
    ///
    /// # Errors
    /// As [`Agent::reconcile`].
    pub async fn reconcile_changes(&self) -> Result<PassOutcome, Error> {
        self.run_pass(false, Trigger::Pass).await
    }

    async fn run_pass(&self, full: bool, trigger: Trigger) -> Result<PassOutcome, Error> {
        let _pass = self.pass_lock.lock().await;
        self.pass_progress();
        let started = now_ms();
        let clock = Instant::now();
        if let Ok(mut r) = self.record.lock() {
            r.last_started_at_unix_ms = Some(started);
        }
        let mut result = self.pass(full, trigger).await;
        // Pool mode: converge this host's instances in the same pass (every pass is cheap for
        // it: unchanged instances cost a listing, nothing is rewritten).
        if let Some(pool) = self.pool() {
            let pooled = pool.converge(self.db()).await;
            if let Ok(o) = &mut result {
                match pooled {
                    Ok(p) => o
                        .errors
                        .extend(p.errors.into_iter().map(|e| format!("pool: {e}"))),
                    Err(e) => o.errors.push(format!("pool: {}", e.message)),
                }
            }
        }
        // The mesh: on a full pass, the device runs and every managed peer and route is there.
        if full && let Some(mesh) = self.mesh().ok() {
            let converged = mesh.converge(self.db()).await;
            if let Ok(o) = &mut result {
                match converged {
                    Ok(r) => {
                        self.emit_host_lines("mesh", &r, trigger.into());
                        o.add_lines(r);
                    }
                    Err(e) => o.errors.push(format!("mesh: {}", e.message)),
                }
            }
            // Its VMs: every veth's program and local entry, this host's registrations, the
            // locations from the whole set.
            if mesh.located().is_some() {
                let vms = match self.mesh_locals().await {
                    Ok(l) => mesh.converge_vms(l).await.map(|(_, r)| r),
                    Err(e) => Err(e),
                };
                if let Ok(o) = &mut result {
                    match vms {
                        Ok(r) => {
                            self.emit_host_lines("mesh", &r, trigger.into());
                            o.add_lines(r);
                        }
                        Err(e) => o.errors.push(format!("mesh registrations: {}", e.message)),
                    }
                }
            }
        }
        crate::malloc::release_free();
        self.metrics.observe_pass(full, clock.elapsed());
        if let Ok(o) = &result {
            self.metrics
                .count_repairs(crate::metrics::Trigger::Pass, &o.repaired);
            if full {
                self.loops.set_converged();
            }
        }
        self.pass_progress();
        let took = u64::try_from(clock.elapsed().as_millis()).unwrap_or(u64::MAX);
        if let Ok(mut r) = self.record.lock() {
            r.passes += 1;
            r.last_finished_at_unix_ms = Some(now_ms());
            r.last_duration_ms = Some(took);
            match &result {
                Ok(o) => {
                    r.last_ok = Some(o.errors.is_empty());
                    r.last_errors.clone_from(&o.errors);
                    r.orphans_removed_total += o.collected.len() as u64;
                    r.drift_repairs_total += o.repaired.len() as u64;
                    r.pass_repairs_total += o.repaired.len() as u64;
                    r.repairs
                        .record(trigger, o.repaired.len() as u64, &o.repaired_kinds);
                }
                Err(e) => {
                    r.last_ok = Some(false);
                    r.last_errors = vec![e.message.clone()];
                }
            }
        }
        result
    }

    /// Waits until no VM change through the API was seen for [`API_QUIET`], at most
    /// [`API_YIELD_MAX`].
    pub(crate) async fn yield_to_api(&self) {
        let start = tokio::time::Instant::now();
        loop {
            let last = self.last_api_change.lock().ok().and_then(|t| *t);
            let Some(last) = last else { return };
            let now = tokio::time::Instant::now();
            let quiet_at = last + API_QUIET;
            let give_up = start + API_YIELD_MAX;
            if now >= quiet_at || now >= give_up {
                return;
            }
            tokio::time::sleep_until(quiet_at.min(give_up)).await;
        }
    }

    async fn pass(&self, full: bool, trigger: Trigger) -> Result<PassOutcome, Error> {
        let groups = {
            let rows = store_tx!(self.db(), tx => vm_store::list(tx).await)?;
            order::pass_order(rows)
        };
        let mut out = PassOutcome::default();
        // A host without VMs has no host-wide state to keep (gc removes it with the last VM).
        if full && groups.iter().any(|g| !g.is_empty()) {
            self.yield_to_api().await;
            let _kernel = self.kernel.lock("reconcile: host state", [None]).await;
            self.pass_progress();
            match self.driver().repair_host().await {
                Ok(changes) => {
                    self.emit_drift(None, &changes, trigger.into());
                    for r in changes.iter().filter_map(|c| Repaired::of("host", &[c])) {
                        out.add(r);
                    }
                }
                Err(e) => out.errors.push(format!("host: {e}")),
            }
        }
        let observed = {
            self.yield_to_api().await;
            // Reads only: nothing quiet.
            let _kernel = self.kernel.lock("reconcile: observe", []).await;
            self.pass_progress();
            self.driver().observe().await
        };
        let seen: Option<BTreeMap<u32, ObservedVm>> = match observed {
            Ok(seen) => {
                out.observed = seen.len() as u64;
                Some(seen.into_iter().map(|o| (o.user_id, o)).collect())
            }
            Err(e) => {
                out.errors.push(format!("observe: {e}"));
                None
            }
        };
        // Up to PASS_BATCH VMs per hold of the kernel lock, re-reading their rows, so API
        // changes interleave between steps and a pass never applies a config older than the
        // store's. The configs that planned are remembered with their user id for the
        // collection below.
        let mut planned: HashMap<String, (String, u32)> = HashMap::new();
        for group in &groups {
            for ids in group.chunks(PASS_BATCH) {
                self.yield_to_api().await;
                // The host now, the VMs' netns as their rows are read.
                let _kernel = self
                    .kernel
                    .lock(format!("reconcile: vm {}", ids.join(", ")), [None])
                    .await;
                self.pass_progress();
                let mut rows = Vec::with_capacity(ids.len());
                for id in ids {
                    let Some(row) = store_tx!(self.db(), tx => vm_store::get(tx, id).await)? else {
                        continue;
                    };
                    self.kernel.quiet_also(self.row_spaces(&row));
                    if !full && self.known_good(&row, seen.as_ref()) {
                        out.applied += 1;
                        planned.insert(row.id, (row.config, row.user_id));
                    } else {
                        rows.push(row);
                    }
                }
                let (together, alone) = order::together(rows);
                let done = join_all(together.iter().map(|r| self.converge(r, trigger))).await;
                let mut results: Vec<_> = together.into_iter().zip(done).collect();
                for row in alone {
                    let r = self.converge(&row, trigger).await;
                    results.push((row, r));
                }
                for (row, r) in results {
                    match r {
                        Ok(repaired) => {
                            out.applied += 1;
                            planned.insert(row.id, (row.config, row.user_id));
                            if let Some(r) = repaired {
                                out.add(r);
                            }
                        }
                        Err(e) => out.errors.push(e.message),
                    }
                }
            }
        }
        // Collect orphans against the store as it is now: every plan a stored VM may be using
        // (its desired config's and, while they differ, its applied config's).
        self.yield_to_api().await;
        // The host now; the netns it may remove once the VMs kept are known.
        let _kernel = self
            .kernel
            .lock("reconcile: garbage collection", [None])
            .await;
        self.pass_progress();
        let rows = store_tx!(self.db(), tx => vm_store::list(tx).await)?;
        if let Some(m) = self.metadata() {
            m.retain(&rows.iter().map(|r| r.id.clone()).collect());
        }
        // Only the user ids are kept: each plan is dropped as soon as it proved the config plans
        // (a plan carries its nft ruleset, ~40 KiB; holding all of them made every pass's peak,
        // and with it the agent's RSS, grow by that much per VM).
        let mut keep: BTreeSet<u32> = BTreeSet::new();
        let mut unplanned = Vec::new();
        for row in &rows {
            for json in std::iter::once(row.config.as_str()).chain(row.applied.as_deref()) {
                if let Some((_, uid)) = planned.get(&row.id).filter(|(c, _)| c == json) {
                    keep.insert(*uid);
                    continue;
                }
                match parse_vm_config(json.as_bytes())
                    .map_err(Error::from)
                    .and_then(|c| self.plan(&c))
                {
                    Ok(p) => {
                        keep.insert(p.user_id);
                    }
                    Err(_) => unplanned.push(row.id.clone()),
                }
            }
        }
        if !unplanned.is_empty() {
            // Never collect what a stored VM may own: without its plan we cannot tell.
            unplanned.dedup();
            out.errors.push(format!(
                "garbage collection skipped: stored vms {} do not plan under the current settings",
                unplanned.join(", ")
            ));
            return Ok(out);
        }
        let keep: Vec<u32> = keep.into_iter().collect();
        self.kernel.quiet_also(self.collectable_spaces(&keep));
        match self.driver().gc(&keep).await {
            Ok(uids) => out.collected = uids,
            Err(e) => out.errors.push(format!("garbage collection: {e}")),
        }
        Ok(out)
    }

    /// Whether a VM needs nothing in a change pass: its desired config is applied without error
    /// and the observed host still has its netns (and host veth, if it has one).
    fn known_good(&self, row: &VmRow, seen: Option<&BTreeMap<u32, ObservedVm>>) -> bool {
        if row.last_error.is_some() || row.applied.as_deref() != Some(row.config.as_str()) {
            return false;
        }
        let Some(plan) = parse_vm_config(row.config.as_bytes())
            .ok()
            .and_then(|c| self.plan(&c).ok())
        else {
            return false;
        };
        let Some(o) = seen.and_then(|s| s.get(&plan.user_id)) else {
            return false;
        };
        let netns_ok = o.netns.as_deref() == Some(plan.netns.as_str());
        let veth_ok = match &plan.veth {
            Some(v) => o
                .host_veth
                .as_ref()
                .is_some_and(|(name, _)| *name == v.host_name),
            None => true,
        };
        netns_ok && veth_ok
    }

    /// Applies one stored VM's desired config; on failure re-applies its last good config.
    /// Returns the drift repaired: the changes made to a VM whose config was already applied
    /// without error (one line, logged, with the kinds of object put back), else nothing.
    /// Publishes the repairs, and the VM's applied or failed state when it changed, as events
    /// of `trigger`.
    pub(crate) async fn converge(
        &self,
        row: &VmRow,
        trigger: Trigger,
    ) -> Result<Option<Repaired>, Error> {
        let desired = parse_vm_config(row.config.as_bytes()).map_err(|e| {
            Error::internal(format!(
                "vm {}: stored config does not parse: {}",
                row.id,
                e.message()
            ))
        })?;
        let good = row
            .applied
            .as_deref()
            .and_then(|a| parse_vm_config(a.as_bytes()).ok());
        let plan = self.plan(&desired)?;
        // The last good config is planned only when it is needed (the apply failed): a VM in
        // sync has it equal to the desired one, and its user id is in the config.
        let in_sync =
            row.last_error.is_none() && row.applied.as_deref() == Some(row.config.as_str());
        let mut repaired = None;
        let (applied, error) = match self.driver().apply(&plan).await {
            Ok(changes) => {
                let upgrades: Vec<String> = changes
                    .iter()
                    .filter(|c| !c.is_drift())
                    .map(ToString::to_string)
                    .collect();
                if !upgrades.is_empty() {
                    tracing::info!(vm = %row.id, op = "adopt", changes = ?upgrades, "configure on start: replaced an earlier agent's objects");
                }
                let changes: Vec<&Change> = changes.iter().filter(|c| c.is_drift()).collect();
                if in_sync && let Some(r) = Repaired::of(&format!("vm {}", row.id), &changes) {
                    if plan.firewall.is_some()
                        && let Some(Change::ReplaceNft { differences, .. }) = changes
                            .iter()
                            .find(|c| matches!(c, Change::ReplaceNft { .. }))
                    {
                        self.count_firewall_repair(
                            (&row.id, desired.user_id),
                            differences,
                            trigger.into(),
                        );
                    }
                    let at = Some((row.id.as_str(), desired.user_id, plan.netns.as_str()));
                    self.emit_drift(at, changes.iter().copied(), trigger.into());
                    tracing::warn!(vm = %row.id, op = "repair", changes = %r.line, "kernel state changed behind the agent's back; repaired");
                    repaired = Some(r);
                }
                if let Some(g) = good.as_ref().filter(|g| g.user_id != plan.user_id) {
                    let _ = self.driver().release_public(g.user_id);
                    let _ = self.driver().remove(g.user_id).await;
                }
                self.sync_metadata(&plan);
                (Some(row.config.clone()), None)
            }
            Err(e) => {
                let mut msg = format!(
                    "vm {}: apply failed: {}",
                    row.id,
                    vmnet_model::error::chain(&e)
                );
                if let Some(g) = &good.as_ref().and_then(|g| self.plan(g).ok()) {
                    if g.user_id != plan.user_id {
                        let _ = self.driver().remove(plan.user_id).await;
                    }
                    match self.driver().apply(g).await {
                        Ok(_) => {
                            self.sync_metadata(g);
                            msg.push_str("; the previous config stays applied");
                        }
                        Err(e2) => msg.push_str(&format!(
                            "; re-applying the previous config also failed: {e2}"
                        )),
                    }
                }
                (row.applied.clone(), Some(msg))
            }
        };
        let outcome = match &error {
            // Once per change of error, not every pass that fails again the same way.
            Some(m) if error != row.last_error => Some(EventBody::VmFailed {
                code: vmnet_model::ErrorCode::Unavailable,
                message: m.clone(),
                trigger: trigger.into(),
            }),
            None if !in_sync => Some(EventBody::VmApplied {
                change: if row.applied.is_none() {
                    Applied::Created
                } else {
                    Applied::Changed
                },
                trigger: trigger.into(),
            }),
            _ => None,
        };
        if let Some(body) = outcome {
            self.emit_vm(&row.id, desired.user_id, body);
        }
        if applied != row.applied || error != row.last_error {
            store_tx!(self.db(), tx => vm_store::set_result(tx, &row.id, applied.as_deref(), error.as_deref(), now_ms()).await)?;
        }
        match error {
            Some(m) => Err(Error::unavailable(m)),
            None => Ok(repaired),
        }
    }

    /// Stops the reconcile loop `task` between two kernel changes (never in the middle of one
    /// VM's apply): waits for the kernel lock, then aborts the loop.
    pub async fn stop_loop(&self, task: tokio::task::JoinHandle<()>) {
        let _kernel = self.kernel.lock("stopping the reconcile loop", []).await;
        task.abort();
        let _ = task.await;
    }

    /// Asks the background loop for a pass soon.
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    /// Runs the reconcile loop until the task is dropped: a full pass now and one interval after
    /// the end of each full pass, a change pass after every wake-up.
    pub async fn run_loop(self: Arc<Self>) {
        let mut full = true;
        let mut next_full = tokio::time::Instant::now();
        let mut next_audit = tokio::time::Instant::now() + self.firewall_audit_period();
        loop {
            if tokio::time::Instant::now() >= next_full {
                full = true;
            }
            match self.run_pass(full, Trigger::Pass).await {
                Ok(o) if o.errors.is_empty() => {
                    tracing::debug!(full, applied = o.applied, collected = ?o.collected, "reconcile pass ok");
                }
                Ok(o) => tracing::warn!(full, errors = ?o.errors, "reconcile pass had errors"),
                Err(e) => tracing::warn!(full, "reconcile pass failed: {e}"),
            }
            if full {
                // The interval runs from the end of a full pass, so a pass that takes longer than
                // the interval (many VMs) still leaves the agent idle in between.
                next_full = tokio::time::Instant::now() + self.interval();
            }
            loop {
                self.loops.beat(crate::health::Loop::Reconcile);
                tokio::select! {
                    // The loop is alive while it waits: it beats every `Loops::idle_beat`.
                    () = tokio::time::sleep(self.loops.idle_beat()) => continue,
                    () = self.wake.notified() => {
                        // Coalesce a burst of changes into one pass.
                        tokio::time::sleep(WAKE_DEBOUNCE).await;
                        full = false;
                    }
                    () = tokio::time::sleep_until(next_full) => full = true,
                    () = tokio::time::sleep_until(next_audit) => {
                        if let Err(e) = self.audit_firewalls().await {
                            tracing::warn!("firewall audit failed: {e}");
                        }
                        // The period runs from the end of an audit, like the passes'.
                        next_audit = tokio::time::Instant::now() + self.firewall_audit_period();
                        continue;
                    }
                }
                break;
            }
        }
    }
}
