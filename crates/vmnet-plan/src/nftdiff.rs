//! nftables tables compared by content: a planned nft JSON document (a batch as it is applied)
//! against a listing (`nft -j list ruleset`), both read into one normalized form ([`Tables`])
//! and compared ([`diff`]) into a list of [`Difference`]s. Empty: no drift.
//!
//! # Design
//! [`Tables::read`] reads the tables it is told to own (by family and name) out of either
//! document; everything else in the document is ignored. What is compared, per table:
//!
//! - chains, with their type, hook, priority, policy and device (a base chain without a policy
//!   has policy `accept`, as the kernel lists it);
//! - the rules of each chain, in order;
//! - named sets and maps with their declaration (key type, data type, flags, timeout) and their
//!   elements as a set;
//! - any other named object (counter, quota, flowtable, …) by kind and name.
//!
//! Listing details never count: handles, the `metainfo` item, element order, the order of
//! objects, the order of the elements of an anonymous set in a rule, counter values, how an
//! address or MAC is spelled (`2001:DB8::1` and `2001:db8::1` are one address), an element
//! written as `{"elem": {"val": …}}` or plainly, and the dependency matches nft adds and then
//! leaves out of its listing (`ether type ip` before an `ip …` match, `meta l4proto tcp` before a
//! `tcp …` match: [`normalize_rule`]).
//!
//! Elements are kept per set as a count and an order-independent digest (the wrapping sum of a
//! 64-bit hash of each normalized element), so a planned state can be kept between audits
//! without its elements ([`Tables::without_items`]) and updated by element batches
//! ([`Tables::apply`]) at a cost that does not depend on how many elements there are. A digest
//! that differs says which set drifted; the elements themselves are listed in the difference
//! when both sides were read with them.
//!
//! # Limitations
//! Rules are read from `add`/`create`/`insert` commands and listings; a batch's `delete rule`
//! (by handle) and `replace rule` are not followed. Set declarations compare the key and data
//! types, flags and timeout only (not size, policy or comments). The digest uses the standard
//! library's SipHash with fixed keys: stable within one process, not across Rust releases, so
//! keep it in memory only.

use std::collections::{BTreeMap, BTreeSet};
use std::hash::{DefaultHasher, Hash, Hasher};

use serde_json::{Map, Value};

mod compare;
mod normalize;
pub use compare::{Difference, diff, has_element_digest_only};
pub use normalize::{normalize_element, normalize_rule};

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
    /// Chains by name: their declaration (`regular`, or `type … hook … prio … policy …`).
    pub chains: BTreeMap<String, String>,
    /// Rules by chain, in order, each as canonical JSON of its normalized expression.
    pub rules: BTreeMap<String, Vec<String>>,
    /// Named sets and maps by name.
    pub sets: BTreeMap<String, Set>,
    /// Other named objects, `kind name` → canonical JSON of their declaration.
    pub objects: BTreeMap<String, String>,
}

/// The owned tables of a document, keyed `family name` (e.g. `bridge bcd_instances`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tables {
    /// The tables present.
    pub tables: BTreeMap<String, Table>,
    /// Whether element items are kept (see [`Elements::items`]).
    items: bool,
}

/// Keys of a chain body that are compared.
const CHAIN_KEYS: [&str; 5] = ["type", "hook", "prio", "policy", "dev"];
/// Keys of a set or map body that are compared.
const SET_KEYS: [&str; 4] = ["type", "map", "flags", "timeout"];
/// Object kinds a listing or batch may carry that are neither tables, chains, rules, sets, maps
/// nor elements.
const OTHER_KINDS: [&str; 9] = [
    "counter",
    "quota",
    "limit",
    "flowtable",
    "secmark",
    "synproxy",
    "ct helper",
    "ct timeout",
    "ct expectation",
];

fn str_of<'a>(o: &'a Value, k: &str) -> Option<&'a str> {
    o.get(k).and_then(Value::as_str)
}

fn chain_decl(body: &Value) -> String {
    if body.get("hook").is_none() {
        return "regular".to_owned();
    }
    let mut parts = Vec::new();
    for k in CHAIN_KEYS {
        let v = match (k, body.get(k)) {
            ("policy", None) => "accept".to_owned(),
            (_, None) => continue,
            (_, Some(Value::String(s))) => s.clone(),
            (_, Some(v)) => v.to_string(),
        };
        parts.push(format!("{k} {v}"));
    }
    parts.join(" ")
}

fn set_decl(kind: &str, body: &Value) -> String {
    let mut m = Map::new();
    for k in SET_KEYS {
        match (k, body.get(k)) {
            (_, None) => {}
            // One flag may be listed as a string or a one-element array.
            ("flags", Some(v)) => {
                let flags: BTreeSet<String> = match v {
                    Value::Array(a) => a.iter().map(|f| f.as_str().unwrap_or("").into()).collect(),
                    Value::String(s) => std::iter::once(s.clone()).collect(),
                    _ => BTreeSet::new(),
                };
                if !flags.is_empty() {
                    m.insert(k.into(), flags.into_iter().collect());
                }
            }
            (_, Some(v)) => {
                m.insert(k.into(), v.clone());
            }
        }
    }
    format!("{kind} {}", Value::Object(m))
}

fn other_decl(body: &Value) -> String {
    let mut b = body.clone();
    if let Some(o) = b.as_object_mut() {
        for k in [
            "family", "table", "name", "handle", "packets", "bytes", "used",
        ] {
            o.remove(k);
        }
    }
    b.to_string()
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
        t.apply_owned(doc, owned);
        t
    }

    /// [`Self::read`] keeping only the count and digest of each set's elements (cheaper: no
    /// element is stored).
    #[must_use]
    pub fn read_summary(doc: &Value, owned: &[(&str, &str)]) -> Self {
        let mut t = Self::default();
        t.apply_owned(doc, owned);
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
        self.apply_owned(doc, owned);
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

    fn apply_owned(&mut self, doc: &Value, owned: &[(&str, &str)]) {
        let Some(items) = doc.get("nftables").and_then(Value::as_array) else {
            return;
        };
        let key = |body: &Value, tbl_key: &str| -> Option<String> {
            let fam = str_of(body, "family")?;
            let tbl = str_of(body, tbl_key)?;
            owned
                .iter()
                .any(|(f, t)| *f == fam && *t == tbl)
                .then(|| format!("{fam} {tbl}"))
        };
        for item in items {
            let (verb, inner) = match item.as_object().and_then(|o| o.iter().next()) {
                Some((k, v))
                    if matches!(
                        k.as_str(),
                        "add" | "create" | "insert" | "delete" | "destroy" | "flush"
                    ) =>
                {
                    (k.as_str(), v)
                }
                _ => ("list", item),
            };
            let Some((kind, body)) = inner.as_object().and_then(|o| o.iter().next()) else {
                continue;
            };
            let gone = matches!(verb, "delete" | "destroy");
            if kind == "ruleset" && verb == "flush" {
                self.tables.clear();
                continue;
            }
            if kind == "table" {
                if let Some(k) = key(body, "name") {
                    if gone {
                        self.tables.remove(&k);
                    } else if verb == "flush" {
                        if let Some(t) = self.tables.get_mut(&k) {
                            t.rules.values_mut().for_each(Vec::clear);
                        }
                    } else {
                        self.tables.entry(k).or_default();
                    }
                }
                continue;
            }
            let Some(k) = key(body, "table") else {
                continue;
            };
            let keep_items = self.items;
            let t = self.tables.entry(k).or_default();
            let name = str_of(body, "name").unwrap_or("").to_owned();
            match kind.as_str() {
                "chain" => match verb {
                    "delete" | "destroy" => {
                        t.chains.remove(&name);
                        t.rules.remove(&name);
                    }
                    "flush" => {
                        t.rules.entry(name).or_default().clear();
                    }
                    _ => {
                        t.chains.insert(name.clone(), chain_decl(body));
                        t.rules.entry(name).or_default();
                    }
                },
                "rule" => {
                    let chain = str_of(body, "chain").unwrap_or("").to_owned();
                    let rule = normalize_rule(body.get("expr").unwrap_or(&Value::Null));
                    let list = t.rules.entry(chain).or_default();
                    match verb {
                        "insert" => list.insert(0, rule),
                        "delete" | "destroy" | "flush" => {}
                        _ => list.push(rule),
                    }
                }
                "set" | "map" | "element" => {
                    if kind != "element" {
                        if gone {
                            t.sets.remove(&name);
                            continue;
                        }
                        let s = t.sets.entry(name.clone()).or_insert_with(|| Set {
                            decl: String::new(),
                            elements: Elements {
                                items: keep_items.then(BTreeSet::new),
                                ..Elements::default()
                            },
                        });
                        s.decl = set_decl(kind, body);
                        if verb == "flush" {
                            s.elements = Elements {
                                items: keep_items.then(BTreeSet::new),
                                ..Elements::default()
                            };
                        }
                    }
                    let Some(elems) = body.get("elem").and_then(Value::as_array) else {
                        continue;
                    };
                    let Some(s) = t.sets.get_mut(&name) else {
                        continue;
                    };
                    for e in elems {
                        let e = normalize_element(e);
                        if gone && kind == "element" {
                            s.elements.remove(&e);
                        } else {
                            s.elements.add(&e);
                        }
                    }
                }
                other if OTHER_KINDS.contains(&other) => {
                    let k = format!("{other} {name}");
                    if gone {
                        t.objects.remove(&k);
                    } else {
                        t.objects.insert(k, other_decl(body));
                    }
                }
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests;
