//! The three bcd nftables tables on one host: full replace, one instance added or removed as a
//! small element batch, and the drift audit (spec: "bcd's nftables tables").
//!
//! # Design
//! [`PoolFirewall`] holds the desired [`Firewall`] (plain data from `vmnet-plan`) and the content
//! the plan gives the three tables, read by [`vmnet_plan::nftdiff`]: chains with their hook,
//! priority and policy, the rules, the set declarations, and per set the count and digest of
//! its elements (not the elements). Every change is one nft transaction through an
//! [`NftExec`] — libnftables in-process ([`LibNft`]) or the agent's root helper. The first tap
//! on a host and the last one going away are full replaces (the backstop tables appear and go);
//! everything else is element adds/deletes whose size does not depend on how many taps exist.
//! An instance whose spec changes under the same taps ([`PoolFirewall::replace_instance`]) has
//! its changed elements swapped in one batch, so its taps are never without rules.
//!
//! Element batches update the planned digests as they go, so keeping the plan costs nothing
//! per NIC. [`PoolFirewall::audit`] lists the ruleset once, reads it the same way and compares
//! content: a flushed ruleset, a missing table or chain, a base chain whose policy, hook or
//! priority changed, a rule deleted, added or changed, a set element deleted, added or swapped
//! for another (the count alone would not show a swap: the digest does). On any difference it
//! re-applies the whole desired state atomically, logs the differences (naming the elements, by
//! reading the full plan only then) and counts the repair. A full replace reads the tables back
//! and fails unless they hold what was planned, so an unchanged ruleset is never re-applied
//! (listing details never count, see [`vmnet_plan::nftdiff`]).
//!
//! # The drift gap
//! Between someone else's `nft flush ruleset` and the next audit (at most one audit period, 5 s
//! in the agent) the three tables are gone. Guests are still filtered then, by layers that do not
//! live in nftables: a tap's bridge port is locked with learning off and a static FDB entry for
//! the NIC's MAC ([`super::tap`]), and the tap guard ([`super::guard`], BPF on each tap) repeats
//! every source check and policy of chain `from_tap` on what a guest sends and lets nothing
//! reach a guest that chain `to_tap` did not mark. So in the gap a guest can send only what the
//! rules would let it send, and receives nothing (tested: `tests/pool_guard.rs`,
//! `tests/pool_drift.rs`). Taps are created only after their rules exist.
//!
//! Considered and not used: the table flag `owner` (another process's `flush ruleset` then skips
//! the tables) works in nft 1.0.6's text syntax only — its JSON parser ignores table flags — and
//! without `persist` (not in nft 1.0.6) the tables vanish when the helper process dies, which
//! fails open.

use serde_json::Value;
use vmnet_model::ValidationError;
use vmnet_model::nic::{IfName, InstanceSpec, instance_hash10};
use vmnet_plan::nftdiff::{Tables, diff, has_element_digest_only};
use vmnet_plan::pool::nft::{
    Change, Firewall, OWNED_TABLES, needs_full_replace, render_full, render_instance, tap_entries,
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
}

/// The nft JSON command that lists the ruleset.
pub const LIST_RULESET: &str = r#"{"nftables":[{"list":{"ruleset":null}}]}"#;

impl NftExec for LibNft {
    fn apply(&self, batch: &str) -> Result<(), FirewallError> {
        self.run(batch).map(drop).map_err(FirewallError::Nft)
    }

    fn list(&self) -> Result<String, FirewallError> {
        self.run(LIST_RULESET).map_err(FirewallError::Nft)
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
    /// The plan refused the input (an instance that does not validate).
    #[error(transparent)]
    Plan(ValidationError),
    /// An instance whose taps have rules on this host already.
    #[error("instance {0}: its taps have rules on this host already")]
    Duplicate(String),
    /// The listing could not be read, or did not show what was just loaded.
    #[error("read-back: {0}")]
    ReadBack(String),
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
    /// The plan's content of the three tables, element digests only.
    planned: Tables,
    loaded: bool,
    status: FirewallStatus,
}

impl<E: NftExec> PoolFirewall<E> {
    /// A driver that has loaded nothing yet; call [`Self::replace`] before any VM starts.
    pub fn new(exec: E) -> Self {
        Self {
            exec,
            desired: Firewall::default(),
            planned: Tables::default(),
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

    /// Whether elements are held for instance `instance_id` (what [`Self::remove_instance`]
    /// would remove).
    pub fn holds(&self, instance_id: &str) -> bool {
        let prefix = format!("bc{}n", instance_hash10(instance_id));
        self.desired
            .taps
            .iter()
            .any(|t| t.tap.as_str().starts_with(&prefix))
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
    pub fn observe(&self) -> Result<Tables, FirewallError> {
        Ok(Tables::read_summary(&self.listing()?, &OWNED_TABLES))
    }

    /// The ruleset as nft lists it.
    fn listing(&self) -> Result<Value, FirewallError> {
        let out = self.exec.list()?;
        serde_json::from_str(&out)
            .map_err(|e| FirewallError::ReadBack(format!("listing is not JSON: {e}")))
    }

    /// Replaces all three tables with `fw` in one transaction, then reads them back. On failure
    /// the previous tables stay as they were (the batch is atomic).
    ///
    /// # Errors
    /// [`FirewallError::Nft`] when nft refuses the batch; [`FirewallError::ReadBack`] when the
    /// listing does not hold, by content, what was just loaded (naming the differences).
    pub fn replace(&mut self, fw: Firewall) -> Result<(), FirewallError> {
        let doc = render_full(&fw);
        self.exec.apply(&doc.to_string())?;
        let planned = Tables::read(&doc, &OWNED_TABLES);
        let listed = Tables::read(&self.listing()?, &OWNED_TABLES);
        self.desired = fw;
        self.loaded = true;
        let found = diff(&planned, &listed);
        self.planned = planned.without_items();
        if !found.is_empty() {
            let found: Vec<String> = found.iter().map(ToString::to_string).collect();
            return Err(FirewallError::ReadBack(format!(
                "the tables do not hold what was loaded: {}",
                found.join("; ")
            )));
        }
        Ok(())
    }

    /// Adds one instance's taps: one element batch, or a full replace when it is the host's
    /// first tap. The rules exist before the caller creates the taps.
    ///
    /// # Errors
    /// [`FirewallError::Plan`] for an invalid instance, [`FirewallError::Duplicate`] for one
    /// already present; otherwise as [`Self::replace`].
    pub fn add_instance(&mut self, inst: &InstanceSpec) -> Result<(), FirewallError> {
        let entries = tap_entries(inst).map_err(FirewallError::Plan)?;
        if entries
            .iter()
            .any(|e| self.desired.taps.iter().any(|t| t.tap == e.tap))
        {
            return Err(FirewallError::Duplicate(inst.id.clone()));
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

    /// Sets one instance's taps to those of `inst` in one transaction: the entries held under
    /// its id (what [`Self::remove_instance`] would remove) are swapped for `inst`'s, the batch
    /// deleting only the set elements that change and adding only the new ones (a changed lease,
    /// policy or sandbox flag), so an element that stays is never absent and nothing is applied
    /// when no element changes (e.g. only the nameservers or the gateway of a NIC changed,
    /// which no element carries). With nothing held it is [`Self::add_instance`] without the
    /// `CONFLICT` for its own taps; the first tap on the host or the last going away (`inst`
    /// without NICs) is a full replace, as for the other changes. The caller keeps the taps.
    ///
    /// # Errors
    /// [`FirewallError::Plan`] for an invalid instance; otherwise as [`Self::replace`]. On an
    /// error the previous entries stay.
    pub fn replace_instance(&mut self, inst: &InstanceSpec) -> Result<(), FirewallError> {
        let entries = tap_entries(inst).map_err(FirewallError::Plan)?;
        let prefix = format!("bc{}n", instance_hash10(&inst.id));
        let (held, kept): (Vec<_>, Vec<_>) = self
            .desired
            .taps
            .iter()
            .cloned()
            .partition(|t| t.tap.as_str().starts_with(&prefix));
        let mut next = Firewall {
            taps: kept,
            host: self.desired.host.clone(),
        };
        next.taps.extend(entries.iter().cloned());
        next.taps.sort_by(|a, b| a.tap.cmp(&b.tap));
        if next == self.desired {
            return Ok(());
        }
        if !self.loaded || needs_full_replace(&self.desired, &next) {
            return self.replace(next);
        }
        let doc = element_swap(
            &render_instance(&held, Change::Remove),
            &render_instance(&entries, Change::Add),
        );
        if !doc["nftables"].as_array().is_some_and(Vec::is_empty) {
            self.exec.apply(&doc.to_string())?;
            self.planned.apply(&doc, &OWNED_TABLES);
        }
        self.desired = next;
        Ok(())
    }

    /// Removes, in one batch, the entries of every tap for which `keep` is false (e.g. taps
    /// loaded for an instance that is no longer placed here), or does a full replace when no
    /// tap is left. Returns the taps removed (none: nothing applied).
    ///
    /// # Errors
    /// As [`Self::replace`]; the entries stay then.
    pub fn retain_taps(
        &mut self,
        keep: impl Fn(&IfName) -> bool,
    ) -> Result<Vec<IfName>, FirewallError> {
        let (kept, gone): (Vec<_>, Vec<_>) = self
            .desired
            .taps
            .iter()
            .cloned()
            .partition(|t| keep(&t.tap));
        if gone.is_empty() {
            return Ok(Vec::new());
        }
        let next = Firewall {
            taps: kept,
            host: self.desired.host.clone(),
        };
        self.change(next, &gone, Change::Remove)?;
        Ok(gone.into_iter().map(|t| t.tap).collect())
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
        self.planned.apply(&doc, &OWNED_TABLES);
        self.desired = next;
        Ok(())
    }

    /// Compares the kernel's tables with the plan by content (see the module docs) and
    /// re-applies on any difference.
    ///
    /// # Errors
    /// When the listing fails, or the repair fails (the next audit tries again).
    pub fn audit(&mut self) -> Result<AuditReport, FirewallError> {
        if !self.loaded {
            return Ok(AuditReport::default());
        }
        let listing = self.listing()?;
        let mut found = diff(
            &self.planned,
            &Tables::read_summary(&listing, &OWNED_TABLES),
        );
        if found.is_empty() {
            return Ok(AuditReport::default());
        }
        if has_element_digest_only(&found) {
            // Name the elements: the full plan and the listing with their elements, read only
            // now that a digest differs.
            let named = diff(
                &Tables::read(&render_full(&self.desired), &OWNED_TABLES),
                &Tables::read(&listing, &OWNED_TABLES),
            );
            if !named.is_empty() {
                found = named;
            }
        }
        let found: Vec<String> = found.iter().map(ToString::to_string).collect();
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

/// One batch that turns the elements deleted by `remove` into those added by `add` (both from
/// [`render_instance`]): per set, the elements in both are left out, then the deletes come
/// before the adds (a verdict map's key whose verdict changes is deleted, then added again).
fn element_swap(remove: &Value, add: &Value) -> Value {
    fn sets(doc: &Value, verb: &str) -> Vec<(Value, Vec<Value>)> {
        doc["nftables"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| {
                let mut body = c.get(verb)?.get("element")?.clone();
                let elems = body.as_object_mut()?.remove("elem")?.as_array()?.clone();
                Some((body, elems))
            })
            .collect()
    }
    fn elems_of<'a>(list: &'a [(Value, Vec<Value>)], set: &Value) -> &'a [Value] {
        list.iter()
            .find(|(b, _)| b == set)
            .map_or(&[], |(_, e)| e.as_slice())
    }
    let (gone, new) = (sets(remove, "delete"), sets(add, "add"));
    let mut cmds = Vec::new();
    for (verb, from, other) in [("delete", &gone, &new), ("add", &new, &gone)] {
        for (body, elems) in from {
            let same = elems_of(other, body);
            let diff: Vec<Value> = elems
                .iter()
                .filter(|e| !same.contains(e))
                .cloned()
                .collect();
            if diff.is_empty() {
                continue;
            }
            let mut body = body.clone();
            if let Some(o) = body.as_object_mut() {
                o.insert("elem".into(), Value::Array(diff));
            }
            cmds.push(serde_json::json!({ verb: { "element": body } }));
        }
    }
    serde_json::json!({ "nftables": cmds })
}

#[cfg(test)]
mod tests;
