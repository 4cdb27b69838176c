//! The table model both sides reduce to: a plan replayed command by command, a listing read
//! object by object.

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};

use super::norm::{chain_attrs, elems_of, object_attrs, rule_value, set_attrs, sorted};
use super::{NftCompareError, TableId};

#[derive(Debug, Default, Clone, PartialEq)]
pub(super) struct Table {
    pub(super) chains: BTreeMap<String, Chain>,
    pub(super) sets: BTreeMap<String, Set>,
    pub(super) objects: BTreeMap<(String, String), Value>,
}

#[derive(Debug, Clone, PartialEq)]
pub(super) struct Chain {
    pub(super) attrs: Value,
    pub(super) rules: Vec<Value>,
}

#[derive(Debug, Clone, PartialEq)]
pub(super) struct Set {
    pub(super) attrs: Value,
    pub(super) elems: Vec<Value>,
}

impl Table {
    pub(super) fn to_json(&self) -> Value {
        let chains: Map<String, Value> = self
            .chains
            .iter()
            .map(|(n, c)| (n.clone(), json!({"attrs": c.attrs, "rules": c.rules})))
            .collect();
        let sets: Map<String, Value> = self
            .sets
            .iter()
            .map(|(n, s)| {
                (
                    n.clone(),
                    json!({"attrs": s.attrs, "elems": sorted(&s.elems)}),
                )
            })
            .collect();
        let objects: Vec<Value> = self
            .objects
            .iter()
            .map(|((k, n), v)| json!([k, n, v]))
            .collect();
        json!({"chains": chains, "sets": sets, "objects": objects})
    }
}

/// Object kinds that are stateful objects of a table (named, not chains, sets or rules).
const STATEFUL: &[&str] = &[
    "counter",
    "quota",
    "limit",
    "ct helper",
    "ct timeout",
    "ct expectation",
    "secmark",
    "synproxy",
    "flowtable",
];

fn items(v: &Value) -> Result<&Vec<Value>, NftCompareError> {
    v.get("nftables")
        .and_then(Value::as_array)
        .ok_or_else(|| NftCompareError::Shape("no \"nftables\" array".into()))
}

/// The only key of a one-key object and its value.
pub(super) fn single(v: &Value) -> Result<(&str, &Value), NftCompareError> {
    match v.as_object() {
        Some(m) if m.len() == 1 => {
            let (k, v) = m.iter().next().expect("one entry");
            Ok((k.as_str(), v))
        }
        _ => Err(NftCompareError::Shape(format!(
            "expected an object with one key, got {}",
            super::norm::canon(v)
        ))),
    }
}

fn text<'a>(o: &'a Value, key: &str, kind: &str) -> Result<&'a str, NftCompareError> {
    o.get(key).and_then(Value::as_str).ok_or_else(|| {
        NftCompareError::Shape(format!(
            "{kind} without \"{key}\": {}",
            super::norm::canon(o)
        ))
    })
}

/// The table an object belongs to (`table` objects name themselves).
fn table_of(kind: &str, o: &Value) -> Result<TableId, NftCompareError> {
    let name_key = if kind == "table" { "name" } else { "table" };
    Ok(TableId {
        family: text(o, "family", kind)?.to_owned(),
        name: text(o, name_key, kind)?.to_owned(),
    })
}

pub(super) fn planned_tables(
    tx: &Value,
) -> Result<BTreeMap<TableId, Option<Table>>, NftCompareError> {
    let mut m: BTreeMap<TableId, Option<Table>> = BTreeMap::new();
    for cmd in items(tx)? {
        let (verb, body) = single(cmd)?;
        let (verb, kind, o) = match verb {
            "metainfo" => continue,
            "add" | "create" | "insert" | "delete" | "destroy" | "flush" | "replace" => {
                let (k, o) = single(body)?;
                (verb, k, o)
            }
            kind => ("add", kind, body),
        };
        let id = table_of(kind, o)?;
        let unsupported = || NftCompareError::Unsupported(format!("{verb} {kind}"));
        if kind == "table" {
            match verb {
                "add" | "create" => {
                    m.entry(id)
                        .or_insert(None)
                        .get_or_insert_with(Table::default);
                }
                "delete" | "destroy" => {
                    m.insert(id, None);
                }
                "flush" => {
                    if let Some(Some(t)) = m.get_mut(&id) {
                        t.chains.values_mut().for_each(|c| c.rules.clear());
                    }
                }
                _ => return Err(unsupported()),
            }
            continue;
        }
        let Some(Some(t)) = m.get_mut(&id) else {
            return Err(NftCompareError::Shape(format!(
                "{verb} {kind} in table {id}, which the transaction did not add"
            )));
        };
        apply_planned(t, verb, kind, o).map_err(|e| match e {
            Some(e) => e,
            None => unsupported(),
        })?;
    }
    Ok(m)
}

/// Replays one planned command on a table; `Err(None)` for an unsupported command.
fn apply_planned(
    t: &mut Table,
    verb: &str,
    kind: &str,
    o: &Value,
) -> Result<(), Option<NftCompareError>> {
    let missing = |what: &str, name: &str| {
        Some(NftCompareError::Shape(format!(
            "{verb} {kind} refers to {what} {name}, which the transaction did not add"
        )))
    };
    match (verb, kind) {
        ("add" | "create", "chain") => {
            let name = text(o, "name", kind)?;
            let family = text(o, "family", kind)?;
            let attrs = chain_attrs(family, o);
            let c = t.chains.entry(name.to_owned()).or_insert_with(|| Chain {
                attrs: attrs.clone(),
                rules: Vec::new(),
            });
            if o.get("hook").is_some() {
                c.attrs = attrs;
            }
        }
        ("delete" | "destroy", "chain") => {
            t.chains.remove(text(o, "name", kind)?);
        }
        ("flush", "chain") => {
            let name = text(o, "name", kind)?;
            t.chains
                .get_mut(name)
                .ok_or_else(|| missing("chain", name))?
                .rules
                .clear();
        }
        ("add" | "insert", "rule") => {
            if ["index", "handle", "position"]
                .iter()
                .any(|k| o.get(k).is_some())
            {
                return Err(None);
            }
            let chain = text(o, "chain", kind)?;
            let c = t
                .chains
                .get_mut(chain)
                .ok_or_else(|| missing("chain", chain))?;
            let r = rule_value(o);
            if verb == "add" {
                c.rules.push(r);
            } else {
                c.rules.insert(0, r);
            }
        }
        ("add" | "create", "set" | "map") => {
            let name = text(o, "name", kind)?;
            let s = t.sets.entry(name.to_owned()).or_insert_with(|| Set {
                attrs: set_attrs(kind, o),
                elems: Vec::new(),
            });
            s.elems.extend(elems_of(o));
        }
        ("delete" | "destroy", "set" | "map") => {
            t.sets.remove(text(o, "name", kind)?);
        }
        ("flush", "set" | "map") => {
            let name = text(o, "name", kind)?;
            t.sets
                .get_mut(name)
                .ok_or_else(|| missing("set", name))?
                .elems
                .clear();
        }
        ("add" | "create", "element") => {
            let name = text(o, "name", kind)?;
            let s = t.sets.get_mut(name).ok_or_else(|| missing("set", name))?;
            s.elems.extend(elems_of(o));
        }
        ("delete" | "destroy", "element") => {
            let name = text(o, "name", kind)?;
            let s = t.sets.get_mut(name).ok_or_else(|| missing("set", name))?;
            for e in elems_of(o) {
                if let Some(i) = s.elems.iter().position(|x| *x == e) {
                    s.elems.remove(i);
                }
            }
        }
        ("add" | "create", k) if STATEFUL.contains(&k) => {
            let name = text(o, "name", kind)?;
            t.objects
                .insert((k.to_owned(), name.to_owned()), object_attrs(o));
        }
        ("delete" | "destroy", k) if STATEFUL.contains(&k) => {
            t.objects
                .remove(&(k.to_owned(), text(o, "name", kind)?.to_owned()));
        }
        _ => return Err(None),
    }
    Ok(())
}

pub(super) fn listed_tables(listing: &Value) -> Result<BTreeMap<TableId, Table>, NftCompareError> {
    let mut m: BTreeMap<TableId, Table> = BTreeMap::new();
    for item in items(listing)? {
        let (kind, o) = single(item)?;
        if kind == "metainfo" {
            continue;
        }
        let t = m.entry(table_of(kind, o)?).or_default();
        match kind {
            "table" => {}
            "chain" => {
                let attrs = chain_attrs(text(o, "family", kind)?, o);
                t.chains
                    .entry(text(o, "name", kind)?.to_owned())
                    .or_insert_with(|| Chain {
                        attrs: Value::Null,
                        rules: Vec::new(),
                    })
                    .attrs = attrs;
            }
            "rule" => {
                // A rule listed before its chain (not nft's order, but harmless) creates the
                // chain entry; the chain object fills in its attributes.
                t.chains
                    .entry(text(o, "chain", kind)?.to_owned())
                    .or_insert_with(|| Chain {
                        attrs: Value::Null,
                        rules: Vec::new(),
                    })
                    .rules
                    .push(rule_value(o));
            }
            "set" | "map" => {
                let s = Set {
                    attrs: set_attrs(kind, o),
                    elems: elems_of(o),
                };
                t.sets.insert(text(o, "name", kind)?.to_owned(), s);
            }
            "element" => {
                let name = text(o, "name", kind)?;
                if let Some(s) = t.sets.get_mut(name) {
                    s.elems.extend(elems_of(o));
                }
            }
            k => {
                // Stateful objects, and any object kind a newer nft lists: compared opaquely.
                let name = o.get("name").and_then(Value::as_str).unwrap_or_default();
                t.objects
                    .insert((k.to_owned(), name.to_owned()), object_attrs(o));
            }
        }
    }
    Ok(m)
}
