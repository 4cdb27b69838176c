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

mod model;
mod norm;

use std::fmt;

use serde_json::{Value, json};

use model::{Table, listed_tables, planned_tables};
use norm::{canon, sorted};

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

#[cfg(test)]
mod tests;
