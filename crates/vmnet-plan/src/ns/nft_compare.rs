//! Comparing nftables tables by content: a planned transaction (`nft -j -f -` input) against a
//! listing (`nft -j list table …` or `list ruleset` output) → the differences, empty when the
//! kernel holds exactly what the plan makes. Pure: the caller lists, this module compares.
//!
//! # Design
//! Both sides are reduced to one model per table: chains (type, hook, priority, policy, devices,
//! comment) with their rules in order, sets and maps (attributes and elements) and stateful
//! objects (counters, quotas, flowtables, …). The plan's model comes from replaying its commands
//! (`add`/`create`/`insert`/`delete`/`destroy`/`flush`; a bare object is an `add`), so the usual
//! "add table, delete table, add everything" replacement models to exactly what it leaves behind;
//! a table the plan deletes and does not re-add must be absent. Tables the plan never mentions
//! are not compared (they are not ours).
//!
//! What never counts as a difference (listing details, not content):
//! - handles, the `metainfo` object, the order of objects in the listing (rules keep their order
//!   within a chain: that order is content), the order of set elements and of the members of an
//!   anonymous set;
//! - counter values (`packets`, `bytes`), a quota's `used`, an element's `expires`;
//! - shape variants between nft versions: a missing `op` in a match (`==`), `{}` for a statement
//!   without arguments (`null`), a one-member anonymous set (the member), a full-length prefix
//!   (the address), an address or `addr/len` written non-canonically, a priority given by name
//!   (its number), a base chain without a policy (`accept`), a set's flags as one string,
//!   `family` beside a literal address in `snat`/`dnat`, a single device as a string.
//!
//! # Limitations
//! - An interval set the kernel merged (auto-merge) lists other elements than were added; plans
//!   compared here must add merged intervals themselves.
//! - `insert`/`add` of a rule at a position (`index`, `handle`), `replace`, and table flags are not
//!   modelled: a plan using them is refused with [`NftCompareError`].
//! - `flush table` empties the table's chains (not its sets).

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;
use serde_json::{Map, Value, json};

/// A table: its family and name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TableId {
    /// `ip`, `ip6`, `inet`, `arp`, `bridge` or `netdev`.
    pub family: String,
    /// The table name.
    pub name: String,
}

impl fmt::Display for TableId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.family, self.name)
    }
}

/// The object of a table a [`Difference`] is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NftObject {
    /// The table itself.
    Table,
    /// A chain, by name (its type, hook, priority, policy, devices or comment).
    Chain(String),
    /// One rule of a chain, rendered as canonical JSON (`{"comment":…,"expr":[…]}`).
    Rule {
        /// The chain.
        chain: String,
        /// The rule.
        rule: String,
    },
    /// The order of a chain's rules (the same rules, in another order).
    RuleOrder(String),
    /// A set or map, by name (its attributes).
    Set(String),
    /// One element of a set or map, rendered as canonical JSON.
    Element {
        /// The set or map.
        set: String,
        /// The element.
        element: String,
    },
    /// A stateful object (`counter`, `quota`, `flowtable`, …) by kind and name.
    Stateful {
        /// The kind, as nft's JSON names it.
        kind: String,
        /// The name.
        name: String,
    },
}

impl fmt::Display for NftObject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Table => f.write_str("table"),
            Self::Chain(c) => write!(f, "chain {c}"),
            Self::Rule { chain, rule } => write!(f, "rule {rule} in chain {chain}"),
            Self::RuleOrder(c) => write!(f, "order of the rules in chain {c}"),
            Self::Set(s) => write!(f, "set {s}"),
            Self::Element { set, element } => write!(f, "element {element} of set {set}"),
            Self::Stateful { kind, name } => write!(f, "{kind} {name}"),
        }
    }
}

/// How the kernel differs from the plan for one object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiffKind {
    /// Planned, not in the kernel.
    Missing,
    /// In the kernel, not planned.
    Unexpected,
    /// In both with other attributes (canonical JSON of each side).
    Changed {
        /// What the plan has.
        planned: String,
        /// What the kernel lists.
        listed: String,
    },
}

/// One difference between the plan and the kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Difference {
    /// The table.
    pub table: TableId,
    /// The object in it.
    pub object: NftObject,
    /// How it differs.
    pub kind: DiffKind,
}

impl fmt::Display for Difference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} ", self.table, self.object)?;
        match &self.kind {
            DiffKind::Missing => f.write_str("missing"),
            DiffKind::Unexpected => f.write_str("unexpected"),
            DiffKind::Changed { planned, listed } => {
                write!(f, "changed (planned {planned}, listed {listed})")
            }
        }
    }
}

/// A plan or listing this module cannot read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NftCompareError {
    /// The JSON is not shaped as nft's (`{"nftables": [ {one key: {…}}, … ]}`).
    #[error("nft JSON: {0}")]
    Shape(String),
    /// The plan uses a command this comparison does not model.
    #[error("nft plan: {0} is not supported by the comparison")]
    Unsupported(String),
}

/// Compares every table `planned` (a transaction) adds or deletes with `listed` (nft's JSON
/// listing of those tables; `{"nftables": []}` when none exists). Empty when equal.
///
/// # Errors
/// [`NftCompareError`] when either side is not nft JSON or the plan uses a command outside the
/// model (see the module docs).
pub fn diff(planned: &Value, listed: &Value) -> Result<Vec<Difference>, NftCompareError> {
    let want = planned_tables(planned)?;
    let have = listed_tables(listed)?;
    let mut out = Vec::new();
    for (id, w) in &want {
        let push = |out: &mut Vec<Difference>, kind| {
            out.push(Difference {
                table: id.clone(),
                object: NftObject::Table,
                kind,
            });
        };
        match (w, have.get(id)) {
            (None, None) => {}
            (None, Some(_)) => push(&mut out, DiffKind::Unexpected),
            (Some(_), None) => push(&mut out, DiffKind::Missing),
            (Some(w), Some(h)) => diff_table(id, w, h, &mut out),
        }
    }
    Ok(out)
}

/// The listing's tables in canonical form (one JSON text, keys sorted, listing details
/// normalized away as [`diff`] does): equal for two listings exactly when [`diff`] would find
/// no difference between them. For remembering what a table looked like.
///
/// # Errors
/// When `listed` is not an nft JSON listing.
pub fn canonical_listing(listed: &Value) -> Result<String, NftCompareError> {
    let tables = listed_tables(listed)?;
    let v: Vec<Value> = tables
        .iter()
        .map(|(id, t)| json!({"family": id.family, "name": id.name, "content": t.to_json()}))
        .collect();
    Ok(canon(&Value::Array(v)))
}

#[derive(Debug, Default, Clone, PartialEq)]
struct Table {
    chains: BTreeMap<String, Chain>,
    sets: BTreeMap<String, Set>,
    objects: BTreeMap<(String, String), Value>,
}

#[derive(Debug, Clone, PartialEq)]
struct Chain {
    attrs: Value,
    rules: Vec<Value>,
}

#[derive(Debug, Clone, PartialEq)]
struct Set {
    attrs: Value,
    elems: Vec<Value>,
}

impl Table {
    fn to_json(&self) -> Value {
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
fn single(v: &Value) -> Result<(&str, &Value), NftCompareError> {
    match v.as_object() {
        Some(m) if m.len() == 1 => {
            let (k, v) = m.iter().next().expect("one entry");
            Ok((k.as_str(), v))
        }
        _ => Err(NftCompareError::Shape(format!(
            "expected an object with one key, got {}",
            canon(v)
        ))),
    }
}

fn text<'a>(o: &'a Value, key: &str, kind: &str) -> Result<&'a str, NftCompareError> {
    o.get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| NftCompareError::Shape(format!("{kind} without \"{key}\": {}", canon(o))))
}

/// The table an object belongs to (`table` objects name themselves).
fn table_of(kind: &str, o: &Value) -> Result<TableId, NftCompareError> {
    let name_key = if kind == "table" { "name" } else { "table" };
    Ok(TableId {
        family: text(o, "family", kind)?.to_owned(),
        name: text(o, name_key, kind)?.to_owned(),
    })
}

fn planned_tables(tx: &Value) -> Result<BTreeMap<TableId, Option<Table>>, NftCompareError> {
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

fn listed_tables(listing: &Value) -> Result<BTreeMap<TableId, Table>, NftCompareError> {
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

fn diff_table(id: &TableId, want: &Table, have: &Table, out: &mut Vec<Difference>) {
    let mut push = |object, kind| {
        out.push(Difference {
            table: id.clone(),
            object,
            kind,
        });
    };
    for (name, w) in &want.chains {
        let Some(h) = have.chains.get(name) else {
            push(NftObject::Chain(name.clone()), DiffKind::Missing);
            continue;
        };
        if w.attrs != h.attrs {
            push(NftObject::Chain(name.clone()), changed(&w.attrs, &h.attrs));
        }
        if w.rules != h.rules {
            let missing = minus(&w.rules, &h.rules);
            let unexpected = minus(&h.rules, &w.rules);
            if missing.is_empty() && unexpected.is_empty() {
                push(NftObject::RuleOrder(name.clone()), DiffKind::Missing);
            }
            for (rules, kind) in [
                (missing, DiffKind::Missing),
                (unexpected, DiffKind::Unexpected),
            ] {
                for r in rules {
                    let object = NftObject::Rule {
                        chain: name.clone(),
                        rule: canon(r),
                    };
                    push(object, kind.clone());
                }
            }
        }
    }
    for name in have.chains.keys().filter(|n| !want.chains.contains_key(*n)) {
        push(NftObject::Chain(name.clone()), DiffKind::Unexpected);
    }
    for (name, w) in &want.sets {
        let Some(h) = have.sets.get(name) else {
            push(NftObject::Set(name.clone()), DiffKind::Missing);
            continue;
        };
        if w.attrs != h.attrs {
            push(NftObject::Set(name.clone()), changed(&w.attrs, &h.attrs));
        }
        let (ws, hs) = (sorted(&w.elems), sorted(&h.elems));
        for (elems, kind) in [
            (minus(&ws, &hs), DiffKind::Missing),
            (minus(&hs, &ws), DiffKind::Unexpected),
        ] {
            for e in elems {
                let object = NftObject::Element {
                    set: name.clone(),
                    element: canon(e),
                };
                push(object, kind.clone());
            }
        }
    }
    for name in have.sets.keys().filter(|n| !want.sets.contains_key(*n)) {
        push(NftObject::Set(name.clone()), DiffKind::Unexpected);
    }
    for ((kind, name), w) in &want.objects {
        let object = NftObject::Stateful {
            kind: kind.clone(),
            name: name.clone(),
        };
        match have.objects.get(&(kind.clone(), name.clone())) {
            None => push(object, DiffKind::Missing),
            Some(h) if h != w => push(object, changed(w, h)),
            Some(_) => {}
        }
    }
    for (kind, name) in have
        .objects
        .keys()
        .filter(|k| !want.objects.contains_key(*k))
    {
        let object = NftObject::Stateful {
            kind: kind.clone(),
            name: name.clone(),
        };
        push(object, DiffKind::Unexpected);
    }
}

fn changed(planned: &Value, listed: &Value) -> DiffKind {
    DiffKind::Changed {
        planned: canon(planned),
        listed: canon(listed),
    }
}

/// `a` without one occurrence of each member of `b` (multiset difference, order of `a` kept).
fn minus<'a>(a: &'a [Value], b: &[Value]) -> Vec<&'a Value> {
    let mut left: Vec<&Value> = b.iter().collect();
    a.iter()
        .filter(|x| match left.iter().position(|y| y == x) {
            Some(i) => {
                left.swap_remove(i);
                false
            }
            None => true,
        })
        .collect()
}

fn sorted(v: &[Value]) -> Vec<Value> {
    let mut keyed: Vec<(String, Value)> = v.iter().map(|x| (canon(x), x.clone())).collect();
    keyed.sort_by(|a, b| a.0.cmp(&b.0));
    keyed.into_iter().map(|(_, x)| x).collect()
}

/// The standard priority names (nft's `priority filter` etc.) as numbers, per family.
fn prio_number(family: &str, name: &str) -> Option<i64> {
    Some(match (family, name) {
        ("bridge", "dstnat") => -300,
        ("bridge", "filter") => -200,
        ("bridge", "out") => 100,
        ("bridge", "srcnat") => 300,
        (_, "raw") => -300,
        (_, "mangle") => -150,
        (_, "dstnat") => -100,
        (_, "filter") => 0,
        (_, "security") => 50,
        (_, "srcnat") => 100,
        _ => return None,
    })
}

fn chain_attrs(family: &str, o: &Value) -> Value {
    let mut a = Map::new();
    for k in ["type", "hook", "comment"] {
        if let Some(v) = o.get(k) {
            a.insert(k.into(), norm(v));
        }
    }
    let hook = o.get("hook").and_then(Value::as_str);
    if let Some(p) = o.get("prio") {
        let p = match p.as_str().and_then(|n| prio_number(family, n)) {
            Some(n) => Value::from(n),
            None => norm(p),
        };
        a.insert("prio".into(), p);
    }
    if let Some(d) = o.get("dev").or_else(|| o.get("devices")) {
        a.insert("dev".into(), string_list(d));
    }
    if hook.is_some() {
        let policy = o.get("policy").map_or_else(|| Value::from("accept"), norm);
        a.insert("policy".into(), policy);
    }
    Value::Object(a)
}

/// A string or list of strings as a sorted list.
fn string_list(v: &Value) -> Value {
    let mut l: Vec<Value> = match v {
        Value::Array(a) => a.iter().map(norm).collect(),
        other => vec![norm(other)],
    };
    l.sort_by_key(canon);
    Value::Array(l)
}

fn set_attrs(kind: &str, o: &Value) -> Value {
    let mut a = Map::new();
    a.insert("kind".into(), Value::from(kind));
    for (k, v) in o.as_object().into_iter().flatten() {
        match k.as_str() {
            "family" | "table" | "name" | "handle" | "elem" => {}
            "flags" => {
                a.insert(k.clone(), string_list(v));
            }
            _ => {
                a.insert(k.clone(), norm(v));
            }
        }
    }
    Value::Object(a)
}

fn elems_of(o: &Value) -> Vec<Value> {
    match o.get("elem") {
        Some(Value::Array(a)) => a.iter().map(norm).collect(),
        Some(v) => vec![norm(v)],
        None => Vec::new(),
    }
}

fn object_attrs(o: &Value) -> Value {
    let mut a = Map::new();
    for (k, v) in o.as_object().into_iter().flatten() {
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
    Value::Object(a)
}

fn rule_value(o: &Value) -> Value {
    let mut r = Map::new();
    r.insert(
        "expr".into(),
        o.get("expr").map_or_else(|| Value::Array(Vec::new()), norm),
    );
    if let Some(c) = o.get("comment") {
        r.insert("comment".into(), c.clone());
    }
    Value::Object(r)
}

/// Normalizes an expression, statement or element (see the module docs).
fn norm(v: &Value) -> Value {
    match v {
        Value::String(s) => norm_str(s),
        Value::Array(a) => Value::Array(a.iter().map(norm).collect()),
        Value::Object(m) => norm_obj(m),
        other => other.clone(),
    }
}

fn norm_str(s: &str) -> Value {
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Value::String(ip.to_string());
    }
    if s.contains('/')
        && let Ok(net) = s.parse::<IpNet>()
    {
        return norm_prefix(net.addr(), net.prefix_len());
    }
    Value::String(s.to_owned())
}

fn norm_prefix(addr: IpAddr, len: u8) -> Value {
    let full = if addr.is_ipv4() { 32 } else { 128 };
    if len == full {
        Value::String(addr.to_string())
    } else {
        json!({"prefix": {"addr": addr.to_string(), "len": len}})
    }
}

fn norm_obj(m: &Map<String, Value>) -> Value {
    if m.len() == 1 {
        let (k, inner) = m.iter().next().expect("one entry");
        match (k.as_str(), inner) {
            ("set", Value::Array(members)) => {
                let mut xs = sorted(&members.iter().map(norm).collect::<Vec<_>>());
                xs.dedup();
                if xs.len() == 1 {
                    return xs.remove(0);
                }
                return json!({"set": xs});
            }
            ("counter", Value::Object(_)) => return json!({"counter": null}),
            ("prefix", Value::Object(p)) => {
                let addr = p.get("addr").and_then(Value::as_str);
                let len = p.get("len").and_then(Value::as_u64);
                if let (Some(Ok(addr)), Some(Ok(len))) =
                    (addr.map(str::parse::<IpAddr>), len.map(u8::try_from))
                {
                    return norm_prefix(addr, len);
                }
            }
            ("match", Value::Object(mm)) => {
                let mut mm = mm.clone();
                mm.entry("op").or_insert_with(|| Value::from("=="));
                return json!({"match": norm_obj(&mm)});
            }
            ("snat" | "dnat", Value::Object(n)) if n.contains_key("addr") => {
                let mut n = n.clone();
                n.remove("family");
                return json!({k: norm_obj(&n)});
            }
            ("elem", Value::Object(e)) => {
                let mut e = e.clone();
                e.remove("expires");
                if e.len() == 1
                    && let Some(val) = e.get("val")
                {
                    return norm(val);
                }
                return json!({"elem": norm_obj(&e)});
            }
            (_, Value::Object(o)) if o.is_empty() => return json!({k: null}),
            _ => {}
        }
    }
    Value::Object(m.iter().map(|(k, v)| (k.clone(), norm(v))).collect())
}

/// Canonical JSON text: object keys sorted at every level, whatever the map implementation.
fn canon(v: &Value) -> String {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            let parts: Vec<String> = keys
                .into_iter()
                .map(|k| format!("{}:{}", Value::String(k.clone()), canon(&m[k])))
                .collect();
            format!("{{{}}}", parts.join(","))
        }
        Value::Array(a) => format!("[{}]", a.iter().map(canon).collect::<Vec<_>>().join(",")),
        other => other.to_string(),
    }
}

#[cfg(test)]
#[path = "nft_compare_tests.rs"]
mod tests;
