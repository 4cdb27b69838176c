//! What the three tables hold — rules and set elements — read from nft JSON, for the drift audit
//! (spec: "bcd's 5-second check counts the rules of all three tables against what it loaded").
//!
//! [`Census::of`] reads either a rendered batch (`{"nftables":[{"add":{…}}, …]}`) or the output
//! of `nft -j list ruleset`; it looks only at the three owned tables. Rule *content* as the
//! kernel lists it differs from what was rendered (nft drops implied matches), so the audit keeps
//! the census read back right after a full apply as the reference for rules, and takes the
//! expected element counts from the plan.

use std::collections::BTreeMap;

use serde_json::Value;

use super::nft::OWNED_TABLES;

/// One table's contents.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TableCensus {
    /// The rules as `chain: expr-json`, in listing order (handles dropped).
    pub rules: Vec<String>,
    /// Elements per named set or map.
    pub elements: BTreeMap<String, usize>,
    /// The chains, sets and maps, as `chain NAME`, `set NAME`, `map NAME`.
    pub objects: std::collections::BTreeSet<String>,
}

/// The owned tables present, keyed `"family name"` (e.g. `"bridge bcd_instances"`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Census {
    /// Present tables.
    pub tables: BTreeMap<String, TableCensus>,
}

fn key(o: &Value) -> Option<String> {
    let fam = o.get("family")?.as_str()?;
    let tbl = o.get("table").or_else(|| o.get("name"))?.as_str()?;
    OWNED_TABLES
        .iter()
        .any(|(f, t)| *f == fam && *t == tbl)
        .then(|| format!("{fam} {tbl}"))
}

impl Census {
    /// Reads the owned tables out of an nft JSON document (a batch or a listing). In a batch,
    /// `delete table` removes what an earlier command added, so a full replace reads as its
    /// result.
    #[must_use]
    pub fn of(doc: &Value) -> Self {
        let mut c = Self::default();
        c.apply(doc);
        c
    }

    /// Updates this census with a batch (adds, deletes) as the kernel would apply it, or with
    /// a listing.
    pub fn apply(&mut self, doc: &Value) {
        let c = self;
        let Some(items) = doc.get("nftables").and_then(Value::as_array) else {
            return;
        };
        for item in items {
            let (verb, inner) = match item.as_object().and_then(|o| o.iter().next()) {
                Some((k, v)) if matches!(k.as_str(), "add" | "create" | "delete" | "insert") => {
                    (k.as_str(), v)
                }
                _ => ("list", item),
            };
            let Some((kind, body)) = inner.as_object().and_then(|o| o.iter().next()) else {
                continue;
            };
            if kind == "table" {
                if let Some(k) = key(body) {
                    if verb == "delete" {
                        c.tables.remove(&k);
                    } else {
                        c.tables.entry(k).or_default();
                    }
                }
                continue;
            }
            let Some(k) = key(body) else { continue };
            let t = c.tables.entry(k).or_default();
            match kind.as_str() {
                "rule" => {
                    let chain = body.get("chain").and_then(Value::as_str).unwrap_or("");
                    let expr = body.get("expr").map(Value::to_string).unwrap_or_default();
                    t.rules.push(format!("{chain}: {expr}"));
                }
                "set" | "map" | "element" => {
                    if kind != "element"
                        && let Some(n) = body.get("name").and_then(Value::as_str)
                    {
                        if verb == "delete" {
                            t.objects.remove(&format!("{kind} {n}"));
                        } else {
                            t.objects.insert(format!("{kind} {n}"));
                        }
                    }
                    let n = body
                        .get("elem")
                        .and_then(Value::as_array)
                        .map_or(0, Vec::len);
                    let name = body
                        .get("name")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_owned();
                    let e = t.elements.entry(name).or_insert(0);
                    if verb == "delete" {
                        *e = e.saturating_sub(n);
                    } else {
                        *e += n;
                    }
                }
                "chain" => {
                    if let Some(n) = body.get("name").and_then(Value::as_str) {
                        if verb == "delete" {
                            t.objects.remove(&format!("chain {n}"));
                        } else {
                            t.objects.insert(format!("chain {n}"));
                        }
                    }
                }
                _ => {}
            }
        }
    }

    /// Number of rules per table.
    #[must_use]
    pub fn rule_counts(&self) -> BTreeMap<String, usize> {
        self.tables
            .iter()
            .map(|(k, t)| (k.clone(), t.rules.len()))
            .collect()
    }

    /// Elements per table and set, empty sets left out.
    #[must_use]
    pub fn element_counts(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for (k, t) in &self.tables {
            for (s, n) in &t.elements {
                if *n > 0 {
                    m.insert(format!("{k} {s}"), *n);
                }
            }
        }
        m
    }
}

/// The differences between what is in the kernel (`observed`) and what was loaded: the rule
/// reference (`reference`, the census read back after the last full apply) and the element
/// counts the plan expects (`planned`). Empty when there is no drift.
#[must_use]
pub fn drift(reference: &Census, planned: &Census, observed: &Census) -> Vec<String> {
    let mut out = Vec::new();
    for k in planned.tables.keys() {
        if !observed.tables.contains_key(k) {
            out.push(format!("table {k} is missing"));
        }
    }
    for k in observed.tables.keys() {
        if !planned.tables.contains_key(k) {
            out.push(format!("table {k} is present but not planned"));
        }
    }
    for (k, t) in &observed.tables {
        if let Some(r) = reference.tables.get(k)
            && r.objects != t.objects
        {
            let extra: Vec<_> = t.objects.difference(&r.objects).collect();
            let gone: Vec<_> = r.objects.difference(&t.objects).collect();
            out.push(format!(
                "table {k}: objects added {extra:?}, missing {gone:?}"
            ));
        }
        if let Some(r) = reference.tables.get(k)
            && r.rules != t.rules
        {
            out.push(format!(
                "table {k}: {} rules, {} loaded, or a rule changed",
                t.rules.len(),
                r.rules.len()
            ));
        }
    }
    let (want, have) = (planned.element_counts(), observed.element_counts());
    for (k, n) in &want {
        let h = have.get(k).copied().unwrap_or(0);
        if h != *n {
            out.push(format!("set {k}: {h} elements, {n} loaded"));
        }
    }
    for (k, h) in &have {
        if !want.contains_key(k) {
            out.push(format!("set {k}: {h} elements, 0 loaded"));
        }
    }
    out
}
