//! Reading an nft JSON document (a batch replayed command by command, or a listing) into
//! [`Tables`], leniently ([`Tables::read`]) or strictly ([`super::diff_plan`]).

use std::collections::BTreeSet;

use serde_json::{Map, Value};

use super::normalize::{canon, norm, prio_number, string_list};
use super::{Elements, NftCompareError, Set, Tables, normalize_element, normalize_rule};

/// How a document is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// Anything unreadable or unmodelled is skipped (batches we render, listings nft prints).
    Lenient,
    /// A planned transaction: unreadable items, unmodelled commands and objects in a table the
    /// transaction did not add are errors.
    Plan,
    /// A listing: unreadable items are errors.
    Listing,
}

/// Keys of a base chain's body that are compared, in the order they are shown.
const CHAIN_KEYS: [&str; 6] = ["type", "hook", "prio", "policy", "dev", "comment"];
/// Keys of a set or map body that are compared.
const SET_KEYS: [&str; 5] = ["type", "map", "flags", "timeout", "comment"];
/// Object kinds a batch may carry that are neither tables, chains, rules, sets, maps nor
/// elements (a listing's other kinds are compared the same way).
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

/// The only key of a one-key object and its value (leniently: the first key).
fn single(v: &Value, mode: Mode) -> Result<Option<(&str, &Value)>, NftCompareError> {
    match v.as_object() {
        Some(m) if m.len() == 1 || (mode == Mode::Lenient && !m.is_empty()) => {
            let (k, v) = m.iter().next().expect("one entry");
            Ok(Some((k.as_str(), v)))
        }
        _ if mode == Mode::Lenient => Ok(None),
        _ => Err(NftCompareError::Shape(format!(
            "expected an object with one key, got {}",
            canon(v)
        ))),
    }
}

fn chain_decl(family: &str, body: &Value) -> String {
    let comment = body.get("comment").map(|c| format!(" comment {c}"));
    if body.get("hook").is_none() {
        return format!("regular{}", comment.unwrap_or_default());
    }
    let mut parts = Vec::new();
    for k in CHAIN_KEYS {
        let v = match (k, body.get(k)) {
            ("policy", None) => "accept".to_owned(),
            ("dev", None) => match body.get("devices") {
                Some(d) => canon(&string_list(d)),
                None => continue,
            },
            (_, None) => continue,
            ("dev", Some(d)) => canon(&string_list(d)),
            ("prio", Some(Value::String(p))) => {
                prio_number(family, p).map_or_else(|| p.clone(), |n| n.to_string())
            }
            ("comment", Some(c)) => c.to_string(),
            (_, Some(Value::String(s))) => s.clone(),
            (_, Some(v)) => canon(v),
        };
        parts.push(format!("{k} {v}"));
    }
    parts.join(" ")
}

/// The table flags nft knows by name.
const TABLE_FLAGS: [&str; 3] = ["dormant", "owner", "persist"];

/// A table's flags, listed as one string or an array: sorted, each once. Any flag counts,
/// whatever its spelling: nft 1.0.6 lists a table with one flag with a string out of freed
/// memory (often the table's own name, `"flags": "x"` for table `x`), so a name nft does not
/// give a flag is kept as an unreadable flag (and reported so, not as a flag of that name).
fn table_flags(v: &Value) -> Vec<String> {
    let named = |s: &str| {
        if TABLE_FLAGS.contains(&s) {
            s.to_owned()
        } else {
            format!("a flag nft listed as {s:?}")
        }
    };
    let mut f: Vec<String> = match v {
        Value::Array(a) => a.iter().filter_map(Value::as_str).map(named).collect(),
        Value::String(s) => vec![named(s)],
        _ => Vec::new(),
    };
    f.sort();
    f.dedup();
    f
}

fn set_decl(kind: &str, body: &Value) -> String {
    let mut m = Map::new();
    for k in SET_KEYS {
        match (k, body.get(k)) {
            (_, None) => {}
            // Flags may be listed as a string or an array.
            ("flags", Some(v)) => {
                let flags = string_list(v);
                if flags.as_array().is_some_and(|a| !a.is_empty()) {
                    m.insert(k.into(), flags);
                }
            }
            (_, Some(v)) => {
                m.insert(k.into(), norm(v));
            }
        }
    }
    format!("{kind} {}", canon(&Value::Object(m)))
}

fn other_decl(body: &Value) -> String {
    let mut a = Map::new();
    for (k, v) in body.as_object().into_iter().flatten() {
        match k.as_str() {
            "family" | "table" | "name" | "handle" | "packets" | "bytes" | "used" => {}
            "dev" => {
                a.insert(k.clone(), string_list(v));
            }
            _ => {
                a.insert(k.clone(), norm(v));
            }
        }
    }
    canon(&Value::Object(a))
}

fn rule_text(body: &Value) -> String {
    let expr = normalize_rule(body.get("expr").unwrap_or(&Value::Null));
    match body.get("comment") {
        Some(c) => format!("{expr} comment {c}"),
        None => expr,
    }
}

fn elems_of(body: &Value) -> Vec<String> {
    match body.get("elem") {
        Some(Value::Array(a)) => a.iter().map(normalize_element).collect(),
        Some(v) => vec![normalize_element(v)],
        None => Vec::new(),
    }
}

impl Tables {
    /// [`Self::apply_doc`] leniently (it cannot fail then).
    pub(super) fn apply_lenient(&mut self, doc: &Value, owned: &[(&str, &str)]) {
        let _ = self.apply_doc(doc, owned, Mode::Lenient);
    }

    /// Applies `doc` to the tables `owned` (`(family, name)`), as the kernel would.
    pub(super) fn apply_doc(
        &mut self,
        doc: &Value,
        owned: &[(&str, &str)],
        mode: Mode,
    ) -> Result<(), NftCompareError> {
        let strict = mode != Mode::Lenient;
        let Some(items) = doc.get("nftables").and_then(Value::as_array) else {
            if strict {
                return Err(NftCompareError::Shape("no \"nftables\" array".into()));
            }
            return Ok(());
        };
        for item in items {
            let Some((first, inner)) = single(item, mode)? else {
                continue;
            };
            let (verb, kind, body) = match first {
                "metainfo" => continue,
                "add" | "create" | "insert" | "delete" | "destroy" | "flush" | "replace" => {
                    let Some((k, b)) = single(inner, mode)? else {
                        continue;
                    };
                    (first, k, b)
                }
                kind => ("add", kind, inner),
            };
            self.apply_item(verb, kind, body, owned, mode)?;
        }
        Ok(())
    }

    fn apply_item(
        &mut self,
        verb: &str,
        kind: &str,
        body: &Value,
        owned: &[(&str, &str)],
        mode: Mode,
    ) -> Result<(), NftCompareError> {
        let strict = mode != Mode::Lenient;
        let plan = mode == Mode::Plan;
        let unsupported = || Err(NftCompareError::Unsupported(format!("{verb} {kind}")));
        if kind == "ruleset" && verb == "flush" {
            self.tables.clear();
            return Ok(());
        }
        let tbl_key = if kind == "table" { "name" } else { "table" };
        let (Some(fam), Some(tbl)) = (str_of(body, "family"), str_of(body, tbl_key)) else {
            if strict {
                return Err(NftCompareError::Shape(format!(
                    "{kind} without \"family\" or \"{tbl_key}\": {}",
                    canon(body)
                )));
            }
            return Ok(());
        };
        let k = format!("{fam} {tbl}");
        let is_owned = owned.iter().any(|(f, t)| *f == fam && *t == tbl);
        let gone = matches!(verb, "delete" | "destroy");
        if kind == "table" {
            if !is_owned {
                return Ok(());
            }
            match verb {
                "delete" | "destroy" => {
                    self.tables.remove(&k);
                }
                "flush" => {
                    if let Some(t) = self.tables.get_mut(&k) {
                        t.rules.values_mut().for_each(Vec::clear);
                    }
                }
                "add" | "create" => {
                    let t = self.tables.entry(k).or_default();
                    if let Some(f) = body.get("flags") {
                        t.flags = table_flags(f);
                    }
                }
                _ if plan => return unsupported(),
                _ => {
                    self.tables.entry(k).or_default();
                }
            }
            return Ok(());
        }
        if plan && !(is_owned && self.tables.contains_key(&k)) {
            return Err(NftCompareError::Shape(format!(
                "{verb} {kind} in table {k}, which the transaction did not add"
            )));
        }
        if !is_owned {
            return Ok(());
        }
        let missing = |what: &str, name: &str| {
            Err(NftCompareError::Shape(format!(
                "{verb} {kind} refers to {what} {name}, which the transaction did not add"
            )))
        };
        let keep_items = self.items;
        let t = self.tables.entry(k).or_default();
        let name = str_of(body, "name").unwrap_or("").to_owned();
        match kind {
            "chain" => match verb {
                "delete" | "destroy" => {
                    t.chains.remove(&name);
                    t.rules.remove(&name);
                }
                "flush" => {
                    if plan && !t.chains.contains_key(&name) {
                        return missing("chain", &name);
                    }
                    t.rules.entry(name).or_default().clear();
                }
                "insert" | "replace" if plan => return unsupported(),
                _ => {
                    // Adding an existing chain without a hook leaves it as it is.
                    if body.get("hook").is_some() || !t.chains.contains_key(&name) {
                        t.chains.insert(name.clone(), chain_decl(fam, body));
                    }
                    t.rules.entry(name).or_default();
                }
            },
            "rule" => {
                let chain = str_of(body, "chain").unwrap_or("").to_owned();
                let placed = ["index", "handle", "position"]
                    .iter()
                    .any(|x| body.get(x).is_some());
                if plan {
                    if !matches!(verb, "add" | "insert") || placed {
                        return unsupported();
                    }
                    if !t.chains.contains_key(&chain) {
                        return missing("chain", &chain);
                    }
                }
                let rule = rule_text(body);
                let list = t.rules.entry(chain).or_default();
                match verb {
                    "insert" => list.insert(0, rule),
                    "delete" | "destroy" | "flush" | "replace" => {}
                    _ => list.push(rule),
                }
            }
            "set" | "map" | "element" => {
                if kind != "element" {
                    if gone {
                        t.sets.remove(&name);
                        return Ok(());
                    }
                    if plan && !matches!(verb, "add" | "create" | "flush") {
                        return unsupported();
                    }
                    if verb == "flush" {
                        match t.sets.get_mut(&name) {
                            Some(s) => {
                                s.elements = Elements {
                                    items: keep_items.then(BTreeSet::new),
                                    ..Elements::default()
                                };
                            }
                            None if plan => return missing("set", &name),
                            None => {}
                        }
                        return Ok(());
                    }
                    let s = t.sets.entry(name.clone()).or_insert_with(|| Set {
                        decl: String::new(),
                        elements: Elements {
                            items: keep_items.then(BTreeSet::new),
                            ..Elements::default()
                        },
                    });
                    s.decl = set_decl(kind, body);
                } else if plan && !matches!(verb, "add" | "create" | "delete" | "destroy") {
                    return unsupported();
                }
                let Some(s) = t.sets.get_mut(&name) else {
                    return if plan { missing("set", &name) } else { Ok(()) };
                };
                for e in elems_of(body) {
                    if gone && kind == "element" {
                        s.elements.remove(&e);
                    } else {
                        s.elements.add(&e);
                    }
                }
            }
            other if OTHER_KINDS.contains(&other) || mode == Mode::Listing => {
                let k = format!("{other} {name}");
                match verb {
                    "delete" | "destroy" => {
                        t.objects.remove(&k);
                    }
                    "add" | "create" => {
                        t.objects.insert(k, other_decl(body));
                    }
                    _ if plan => return unsupported(),
                    _ => {}
                }
            }
            _ if plan => return unsupported(),
            _ => {}
        }
        Ok(())
    }
}
