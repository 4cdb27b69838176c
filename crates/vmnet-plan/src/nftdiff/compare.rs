//! The comparison of two normalized documents (see the parent module's docs).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use super::{Table, Tables};

/// One difference between a planned table and the listed one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Difference {
    /// A planned table is not listed.
    TableMissing {
        /// `family name`.
        table: String,
    },
    /// A listed table is not planned.
    TableUnexpected {
        /// `family name`.
        table: String,
    },
    /// A chain, set, map or other object is planned but not listed, or listed but not planned.
    Object {
        /// `family name`.
        table: String,
        /// `chain NAME`, `set NAME`, `counter NAME`, …
        object: String,
        /// Whether it is missing (planned, not listed) rather than unexpected.
        missing: bool,
    },
    /// A chain's, set's or object's declaration differs (e.g. a base chain's policy).
    Declaration {
        /// `family name`.
        table: String,
        /// `chain NAME`, `set NAME`, …
        object: String,
        /// As planned.
        planned: String,
        /// As listed.
        listed: String,
    },
    /// A chain's rules differ.
    Rules {
        /// `family name`.
        table: String,
        /// The chain.
        chain: String,
        /// Rules planned.
        planned: usize,
        /// Rules listed.
        listed: usize,
        /// The first position (from 0) where they differ.
        first: usize,
        /// Planned rules not listed (each as in [`super::Table::rules`]); with `unexpected`
        /// empty too, the same rules are listed in another order.
        missing: Vec<String>,
        /// Listed rules not planned.
        unexpected: Vec<String>,
    },
    /// A set's or map's elements differ.
    Elements {
        /// `family name`.
        table: String,
        /// The set or map.
        set: String,
        /// Elements planned.
        planned: usize,
        /// Elements listed.
        listed: usize,
        /// Planned elements not listed (empty when the planned side kept no elements).
        missing: Vec<String>,
        /// Listed elements not planned (likewise).
        unexpected: Vec<String>,
    },
}

/// Shows at most this many elements of each side of a [`Difference::Elements`].
const SHOWN: usize = 4;

fn shown(v: &[String]) -> String {
    let mut s = v
        .iter()
        .take(SHOWN)
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join(", ");
    if v.len() > SHOWN {
        s.push_str(&format!(", … ({} in all)", v.len()));
    }
    s
}

impl fmt::Display for Difference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TableMissing { table } => write!(f, "table {table} is missing"),
            Self::TableUnexpected { table } => {
                write!(f, "table {table} is present but not planned")
            }
            Self::Object {
                table,
                object,
                missing: true,
            } => write!(f, "table {table}: {object} is missing"),
            Self::Object { table, object, .. } => {
                write!(f, "table {table}: {object} is present but not planned")
            }
            Self::Declaration {
                table,
                object,
                planned,
                listed,
            } => write!(
                f,
                "table {table}: {object} is `{listed}`, planned `{planned}`"
            ),
            Self::Rules {
                table,
                chain,
                planned,
                listed,
                first,
                ..
            } => write!(
                f,
                "table {table}: chain {chain} has {listed} rules, {planned} planned, the first \
                 difference at rule {first}"
            ),
            Self::Elements {
                table,
                set,
                planned,
                listed,
                missing,
                unexpected,
            } => {
                write!(
                    f,
                    "table {table}: set {set} has {listed} elements, {planned} planned"
                )?;
                if missing.is_empty() && unexpected.is_empty() {
                    return write!(f, ", content differs");
                }
                if !missing.is_empty() {
                    write!(f, "; missing {}", shown(missing))?;
                }
                if !unexpected.is_empty() {
                    write!(f, "; unexpected {}", shown(unexpected))?;
                }
                Ok(())
            }
        }
    }
}

/// The differences between `planned` and `listed` (empty: they hold the same content). A table
/// missing on either side is one difference (its contents are not listed one by one); so is a
/// chain (its rules are not compared).
#[must_use]
pub fn diff(planned: &Tables, listed: &Tables) -> Vec<Difference> {
    let mut out = Vec::new();
    for k in planned.tables.keys() {
        if !listed.tables.contains_key(k) {
            out.push(Difference::TableMissing { table: k.clone() });
        }
    }
    for k in listed.tables.keys() {
        if !planned.tables.contains_key(k) {
            out.push(Difference::TableUnexpected { table: k.clone() });
        }
    }
    for (k, p) in &planned.tables {
        if let Some(l) = listed.tables.get(k) {
            diff_table(k, p, l, &mut out);
        }
    }
    out
}

/// Missing, unexpected and changed entries of two maps, as `(name, planned, listed)`.
fn entries<'a, V>(
    p: &'a BTreeMap<String, V>,
    l: &'a BTreeMap<String, V>,
) -> impl Iterator<Item = (&'a String, Option<&'a V>, Option<&'a V>)> {
    let names: BTreeSet<&String> = p.keys().chain(l.keys()).collect();
    names.into_iter().map(|n| (n, p.get(n), l.get(n)))
}

fn diff_table(k: &str, p: &Table, l: &Table, out: &mut Vec<Difference>) {
    let object = |kind: &str, name: &str, missing: bool| Difference::Object {
        table: k.to_owned(),
        object: format!("{kind} {name}"),
        missing,
    };
    let decl = |kind: &str, name: &str, planned: &str, listed: &str| Difference::Declaration {
        table: k.to_owned(),
        object: format!("{kind} {name}"),
        planned: planned.to_owned(),
        listed: listed.to_owned(),
    };
    if p.flags != l.flags {
        out.push(decl(
            "table",
            "flags",
            &p.flags.join(","),
            &l.flags.join(","),
        ));
    }
    for (name, pc, lc) in entries(&p.chains, &l.chains) {
        match (pc, lc) {
            (Some(_), None) => out.push(object("chain", name, true)),
            (None, Some(_)) => out.push(object("chain", name, false)),
            (Some(a), Some(b)) => {
                if a != b {
                    out.push(decl("chain", name, a, b));
                }
                let empty = Vec::new();
                let pr = p.rules.get(name).unwrap_or(&empty);
                let lr = l.rules.get(name).unwrap_or(&empty);
                if pr != lr {
                    let first = pr.iter().zip(lr).take_while(|(a, b)| a == b).count();
                    out.push(Difference::Rules {
                        table: k.to_owned(),
                        chain: name.clone(),
                        planned: pr.len(),
                        listed: lr.len(),
                        first,
                        missing: minus(pr, lr),
                        unexpected: minus(lr, pr),
                    });
                }
            }
            (None, None) => {}
        }
    }
    for (name, ps, ls) in entries(&p.sets, &l.sets) {
        match (ps, ls) {
            (Some(_), None) => out.push(object("set", name, true)),
            (None, Some(_)) => out.push(object("set", name, false)),
            (Some(a), Some(b)) => {
                if a.decl != b.decl {
                    out.push(decl("set", name, &a.decl, &b.decl));
                }
                if !a.elements.same(&b.elements) {
                    let (missing, unexpected) = match (&a.elements.items, &b.elements.items) {
                        (Some(x), Some(y)) => (
                            x.difference(y).cloned().collect(),
                            y.difference(x).cloned().collect(),
                        ),
                        _ => (Vec::new(), Vec::new()),
                    };
                    out.push(Difference::Elements {
                        table: k.to_owned(),
                        set: name.clone(),
                        planned: a.elements.count,
                        listed: b.elements.count,
                        missing,
                        unexpected,
                    });
                }
            }
            (None, None) => {}
        }
    }
    for (name, po, lo) in entries(&p.objects, &l.objects) {
        match (po, lo) {
            (Some(_), None) => out.push(Difference::Object {
                table: k.to_owned(),
                object: name.clone(),
                missing: true,
            }),
            (None, Some(_)) => out.push(Difference::Object {
                table: k.to_owned(),
                object: name.clone(),
                missing: false,
            }),
            (Some(a), Some(b)) if a != b => out.push(Difference::Declaration {
                table: k.to_owned(),
                object: name.clone(),
                planned: a.clone(),
                listed: b.clone(),
            }),
            _ => {}
        }
    }
}

/// `a` without one occurrence of each member of `b` (multiset difference, order of `a` kept).
fn minus(a: &[String], b: &[String]) -> Vec<String> {
    let mut left: Vec<&String> = b.iter().collect();
    a.iter()
        .filter(|x| match left.iter().position(|y| y == x) {
            Some(i) => {
                left.swap_remove(i);
                false
            }
            None => true,
        })
        .cloned()
        .collect()
}

/// Whether any difference is about elements only (a repair may then name the elements by
/// reading the full plan, see [`Difference::Elements`]).
#[must_use]
pub fn has_element_digest_only(d: &[Difference]) -> bool {
    d.iter().any(|x| {
        matches!(x, Difference::Elements { missing, unexpected, .. }
            if missing.is_empty() && unexpected.is_empty())
    })
}
