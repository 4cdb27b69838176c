//! nftables tables compared by content: a planned nft JSON document (a batch as it is applied)
//! against a listing (`nft -j list ruleset` or `list table …`), both read into one normalized
//! form ([`Tables`]) and compared ([`diff`]) into a list of [`Difference`]s. Empty: no drift.
//! Pool mode audits its three tables with it (owned tables named by the caller, element
//! digests kept between audits); namespace mode compares each table a planned transaction
//! replaces ([`diff_plan`], [`canonical_listing`]).
//!
//! # Design
//! [`Tables::read`] reads the tables it is told to own (by family and name) out of either
//! document, replaying a batch's commands (`add`/`create`/`insert`/`delete`/`destroy`/`flush`;
//! a bare object is an `add`) in order as the kernel would, so "add table, delete table, add
//! everything" reads as exactly what it leaves behind; everything else in the document is
//! ignored. What is compared, per table:
//!
//! - the table's flags (`dormant` switches every chain of it off);
//! - chains, with their type, hook, priority, policy, devices and comment;
//! - the rules of each chain, in order, with their comments;
//! - named sets and maps with their declaration (key type, data type, flags, timeout, comment)
//!   and their elements as a set;
//! - any other named object (counter, quota, flowtable, …, and any kind a newer nft lists) by
//!   kind and name, with its declaration.
//!
//! Listing details never count (normalized on both sides, [`normalize_rule`],
//! [`normalize_element`]):
//! - handles, the `metainfo` item, the order of objects, element order, the order of the
//!   members of an anonymous set (and duplicates in it);
//! - counter values (`packets`, `bytes`), a quota's `used`, an element's `expires` (an element
//!   written as `{"elem": {"val": …}}` reads as its value);
//! - how an address, prefix or MAC is spelled (`2001:DB8::1` and `2001:db8::1` are one address,
//!   a full-length prefix is its address, `10.0.0.0/8` is the prefix object);
//! - the dependency matches nft adds and then leaves out of its listing (`ether type ip` before
//!   an `ip …` match, `meta l4proto tcp` before a `tcp …` match);
//! - shape variants between nft versions: a missing `op` in a match (`==`), `{}` for a
//!   statement without arguments (`null`), a one-member anonymous set (the member), a priority
//!   given by name (its number), a base chain without a policy (`accept`), flags or devices as
//!   one string, `family` beside a literal address in `snat`/`dnat`.
//!
//! A listing shape none of this knows shows as a difference; namespace mode remembers such a
//! listing read right after its own transaction (`vmnet-kernel`'s `ns::nftcheck`), so it
//! re-applies at most once per plan.
//!
//! Elements are kept per set as a count and an order-independent digest (the wrapping sum of a
//! 64-bit hash of each normalized element), so a planned state can be kept between audits
//! without its elements ([`Tables::without_items`]) and updated by element batches
//! ([`Tables::apply`]) at a cost that does not depend on how many elements there are. A digest
//! that differs says which set drifted; the elements themselves are listed in the difference
//! when both sides were read with them.
//!
//! # Limitations
//! - [`Tables::read`] is lenient (for batches we render and listings nft prints): `delete rule`
//!   (by handle) and `replace rule` are not followed, unreadable items are skipped. The strict
//!   reading of [`diff_plan`] refuses those ([`NftCompareError`]), as it does rules placed by
//!   `index`/`handle`/`position`, and objects in a table the plan did not add.
//! - `add table` without flags leaves an existing table's flags as they are (as the kernel
//!   does): a plan that must clear them deletes the table and adds it again.
//! - Set declarations compare the key and data types, flags, timeout and comment only (not
//!   size, policy or `gc-interval`, which nft may fill in).
//! - An interval set the kernel merged (auto-merge) lists other elements than were added; plans
//!   must add merged intervals themselves.
//! - `flush table` empties the table's chains (not its sets).
//! - The digest uses the standard library's SipHash with fixed keys: stable within one process,
//!   not across Rust releases, so keep it (and [`canonical_listing`]) in memory only.

use std::collections::{BTreeMap, BTreeSet};
use std::hash::{DefaultHasher, Hash, Hasher};

use serde_json::Value;

mod compare;
mod normalize;
mod plan;
mod read;
pub use compare::{Difference, diff, has_element_digest_only};
pub use normalize::{normalize_element, normalize_rule};
pub use plan::{NftCompareError, canonical_listing, diff_plan};

/// The elements of one set or map.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Elements {
    /// How many.
    pub count: usize,
    /// The wrapping sum of [`element_hash`] over the elements.
    pub digest: u64,
    /// The normalized elements, when read with them ([`Tables::read`]); `None` in a summary.
    pub items: Option<BTreeSet<String>>,
}

impl Elements {
    fn add(&mut self, e: &str) {
        if let Some(items) = &mut self.items
            && !items.insert(e.to_owned())
        {
            return;
        }
        self.count += 1;
        self.digest = self.digest.wrapping_add(element_hash(e));
    }

    fn remove(&mut self, e: &str) {
        if let Some(items) = &mut self.items
            && !items.remove(e)
        {
            return;
        }
        self.count = self.count.saturating_sub(1);
        self.digest = self.digest.wrapping_sub(element_hash(e));
    }

    fn same(&self, other: &Self) -> bool {
        self.count == other.count && self.digest == other.digest
    }
}

/// The hash one normalized element adds to its set's digest.
#[must_use]
pub fn element_hash(e: &str) -> u64 {
    let mut h = DefaultHasher::new();
    e.hash(&mut h);
    h.finish()
}

/// A named set or map.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Set {
    /// `set` or `map`, then the compared declaration fields as canonical JSON.
    pub decl: String,
    /// Its elements.
    pub elements: Elements,
}

/// One table's normalized content.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Table {
    /// Chains by name: their declaration (`regular`, or `type … hook … prio … policy …`, then
    /// `dev […]` and `comment "…"` when present).
    pub chains: BTreeMap<String, String>,
    /// Rules by chain, in order, each as canonical JSON of its normalized expression (then
    /// ` comment "…"` when it has one).
    pub rules: BTreeMap<String, Vec<String>>,
    /// Named sets and maps by name.
    pub sets: BTreeMap<String, Set>,
    /// Other named objects, `kind name` → canonical JSON of their declaration.
    pub objects: BTreeMap<String, String>,
    /// The table's flags (`dormant`, `owner`, …), sorted: a dormant table's chains run no rule,
    /// so flags are content.
    pub flags: Vec<String>,
}

/// The owned tables of a document, keyed `family name` (e.g. `bridge bcd_instances`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tables {
    /// The tables present.
    pub tables: BTreeMap<String, Table>,
    /// Whether element items are kept (see [`Elements::items`]).
    items: bool,
}

impl Tables {
    /// Reads the tables `owned` (`(family, name)` pairs) out of nft JSON `doc`: a batch
    /// (`{"nftables":[{"add":{…}}, …]}`, its commands applied in order as the kernel would) or
    /// a listing. Elements are kept (see [`Self::without_items`]).
    #[must_use]
    pub fn read(doc: &Value, owned: &[(&str, &str)]) -> Self {
        let mut t = Self {
            tables: BTreeMap::new(),
            items: true,
        };
        t.apply_lenient(doc, owned);
        t
    }

    /// [`Self::read`] keeping only the count and digest of each set's elements (cheaper: no
    /// element is stored).
    #[must_use]
    pub fn read_summary(doc: &Value, owned: &[(&str, &str)]) -> Self {
        let mut t = Self::default();
        t.apply_lenient(doc, owned);
        t
    }

    /// The same tables with each set's count and digest only.
    #[must_use]
    pub fn without_items(mut self) -> Self {
        self.items = false;
        for t in self.tables.values_mut() {
            for s in t.sets.values_mut() {
                s.elements.items = None;
            }
        }
        self
    }

    /// Applies batch `doc` (element adds and deletes, new objects) to these tables, as the
    /// kernel would, for the tables already present and any table the batch adds among those
    /// of `owned`.
    pub fn apply(&mut self, doc: &Value, owned: &[(&str, &str)]) {
        self.apply_lenient(doc, owned);
    }

    /// Rules per table (for status reports).
    #[must_use]
    pub fn rule_counts(&self) -> BTreeMap<String, usize> {
        self.tables
            .iter()
            .map(|(k, t)| (k.clone(), t.rules.values().map(Vec::len).sum()))
            .collect()
    }

    /// Elements per `table set` (e.g. `bridge bcd_instances taps`), empty sets left out (for
    /// status reports).
    #[must_use]
    pub fn element_counts(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for (k, t) in &self.tables {
            for (name, s) in &t.sets {
                if s.elements.count > 0 {
                    m.insert(format!("{k} {name}"), s.elements.count);
                }
            }
        }
        m
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_plan;
