//! Read-back of the nft tables namespace mode owns (the host table, each VM netns table),
//! compared with the plan by content ([`vmnet_plan::nftdiff::diff_plan`]).
//!
//! # Design
//! A table is in sync when its listing equals the planned transaction under the comparison's
//! normalization. As a guard against a listing shape the normalization does not know (another
//! nft version printing our rules differently), [`ListingMemo`] remembers, per table and plan
//! fingerprint, the listing read right after our own transaction whenever it still differed
//! from the plan: that listing then counts as in sync, so such a table is re-applied at most once
//! per plan and driver, never on every pass. The differences are logged once, naming them, so
//! the normalization can learn the shape. Only a difference of form is remembered: a listing
//! that lacks or adds a table, chain, set, rule or element (counted) was changed by someone
//! else right after our transaction (a program deleting a rule again and again), and counting
//! it as in sync would hide that change from every later check.

use std::collections::HashMap;
use std::sync::Mutex;

use serde_json::{Value, json};
use vmnet_plan::nftdiff::{Difference, NftCompareError, canonical_listing, diff_plan};

use super::NsError;

/// Remembered listings: table key (`<netns> <family> <name>`) → (plan fingerprint, canonical
/// listing).
#[derive(Debug, Default)]
pub(super) struct ListingMemo(Mutex<HashMap<String, (String, String)>>);

fn compare_err(netns: &str) -> impl Fn(NftCompareError) -> NsError + '_ {
    move |e| NsError::Nft {
        netns: netns.to_owned(),
        message: e.to_string(),
    }
}

/// `listing`, or an empty listing when the table does not exist.
pub(super) fn or_empty(listing: Option<Value>) -> Value {
    listing.unwrap_or_else(|| json!({"nftables": []}))
}

impl ListingMemo {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (String, String)>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The differences between `planned` (fingerprint `fp`) and `listing` of the table `key` in
    /// `netns`, rendered one line each; empty when in sync or when `listing` is the one
    /// remembered for this plan.
    pub(super) fn drift(
        &self,
        netns: &str,
        key: &str,
        fp: &str,
        planned: &Value,
        listing: &Value,
    ) -> Result<Vec<String>, NsError> {
        let diffs = diff_plan(planned, listing).map_err(compare_err(netns))?;
        if diffs.is_empty() {
            return Ok(Vec::new());
        }
        if let Some((mfp, canonical)) = self.lock().get(key)
            && mfp == fp
            && *canonical == canonical_listing(listing).map_err(compare_err(netns))?
        {
            return Ok(Vec::new());
        }
        Ok(diffs.iter().map(ToString::to_string).collect())
    }

    /// Called with the listing read right after our own transaction applied `planned`: when it
    /// still differs (a listing shape the comparison does not normalize), remembers it as this
    /// plan's form and logs the differences; otherwise forgets any remembered form.
    pub(super) fn after_apply(
        &self,
        netns: &str,
        key: &str,
        fp: &str,
        planned: &Value,
        listing: &Value,
    ) -> Result<(), NsError> {
        let diffs = diff_plan(planned, listing).map_err(compare_err(netns))?;
        if diffs.is_empty() {
            self.lock().remove(key);
            return Ok(());
        }
        let lines: Vec<String> = diffs.iter().map(ToString::to_string).collect();
        if diffs.iter().any(changes_content) {
            self.lock().remove(key);
            tracing::warn!(table = key, differences = ?lines, "the table just applied was changed again at once; the next check repairs it");
            return Ok(());
        }
        let canonical = canonical_listing(listing).map_err(compare_err(netns))?;
        tracing::warn!(table = key, differences = ?lines, "nft lists the table just applied differently from the plan; accepting this listing as the plan's form");
        self.lock()
            .insert(key.to_owned(), (fp.to_owned(), canonical));
        Ok(())
    }

    /// Forgets every table of `netns` (the VM is gone).
    pub(super) fn forget_netns(&self, netns: &str) {
        let prefix = format!("{netns} ");
        self.lock().retain(|k, _| !k.starts_with(&prefix));
    }
}

/// Whether `d` is more than a difference of form: something planned is missing or something
/// unplanned is there (tables, objects, or a different number of rules or elements).
fn changes_content(d: &Difference) -> bool {
    match d {
        Difference::TableMissing { .. }
        | Difference::TableUnexpected { .. }
        | Difference::Object { .. } => true,
        Difference::Rules {
            planned, listed, ..
        }
        | Difference::Elements {
            planned, listed, ..
        } => planned != listed,
        Difference::Declaration { .. } => false,
    }
}

/// The memo key of table `family name` in `netns`.
pub(super) fn key(netns: &str, family: &str, name: &str) -> String {
    format!("{netns} {family} {name}")
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn plan() -> Value {
        json!({"nftables": [{"add": {"table": {"family": "ip", "name": "t"}}},
            {"add": {"chain": {"family": "ip", "table": "t", "name": "c"}}},
            {"add": {"rule": {"family": "ip", "table": "t", "chain": "c", "expr": [{"accept": null}]}}}]})
    }

    /// A listing of the table whose rule has `verdict`, printed by an imagined nft version that
    /// adds an expression of its own the comparison does not know.
    fn listing(verdict: &str) -> Value {
        json!({"nftables": [{"table": {"family": "ip", "name": "t", "handle": 1}},
            {"chain": {"family": "ip", "table": "t", "name": "c", "handle": 2}},
            {"rule": {"family": "ip", "table": "t", "chain": "c", "handle": 3,
                "expr": [{"xt-note": "v9"}, {verdict: null}]}}]})
    }

    #[test]
    fn an_unknown_listing_shape_is_reapplied_once_not_on_every_pass() {
        let m = ListingMemo::default();
        let k = key("ns1", "ip", "t");
        // A listing nft prints with a field the comparison does not know.
        let odd = listing("accept");
        assert_eq!(m.drift("ns1", &k, "fp1", &plan(), &odd).unwrap().len(), 1);
        m.after_apply("ns1", &k, "fp1", &plan(), &odd).unwrap();
        assert!(m.drift("ns1", &k, "fp1", &plan(), &odd).unwrap().is_empty());
        // A real edit of that table is still drift, and so is the same listing under another plan.
        let edited = listing("drop");
        assert!(
            !m.drift("ns1", &k, "fp1", &plan(), &edited)
                .unwrap()
                .is_empty()
        );
        assert!(!m.drift("ns1", &k, "fp2", &plan(), &odd).unwrap().is_empty());
        m.forget_netns("ns1");
        assert!(!m.drift("ns1", &k, "fp1", &plan(), &odd).unwrap().is_empty());
        // A listing equal to the plan needs no memory.
        let plain = json!({"nftables": [{"table": {"family": "ip", "name": "t", "handle": 1}},
            {"chain": {"family": "ip", "table": "t", "name": "c", "handle": 2}},
            {"rule": {"family": "ip", "table": "t", "chain": "c", "handle": 3, "expr": [{"accept": null}]}}]});
        m.after_apply("ns1", &k, "fp1", &plan(), &plain).unwrap();
        assert!(m.lock().is_empty());
        // A listing that lost its rule right after the apply (someone deleted it) is no
        // listing shape: never remembered, still drift.
        let flushed = json!({"nftables": [{"table": {"family": "ip", "name": "t", "handle": 1}},
            {"chain": {"family": "ip", "table": "t", "name": "c", "handle": 2}}]});
        m.after_apply("ns1", &k, "fp1", &plan(), &flushed).unwrap();
        assert!(m.lock().is_empty());
        assert!(
            !m.drift("ns1", &k, "fp1", &plan(), &flushed)
                .unwrap()
                .is_empty()
        );
        assert!(
            m.drift("ns1", &k, "fp1", &plan(), &plain)
                .unwrap()
                .is_empty()
        );
    }
}
