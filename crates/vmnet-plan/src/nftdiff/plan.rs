//! A planned transaction compared with the listing of the tables it replaces (namespace mode:
//! the host table and each VM's netns table), strictly: what the model does not cover is an
//! error, not a silent difference.

use std::collections::BTreeSet;

use serde_json::Value;

use super::read::Mode;
use super::{Difference, Tables, diff};

/// A plan or listing the comparison cannot read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NftCompareError {
    /// The JSON is not shaped as nft's (`{"nftables": [ {one key: {…}}, … ]}`).
    #[error("nft JSON: {0}")]
    Shape(String),
    /// The plan uses a command this comparison does not model.
    #[error("nft plan: {0} is not supported by the comparison")]
    Unsupported(String),
}

/// Every `(family, name)` of a table item in `doc` (an `add table`, `delete table`, … command,
/// or a listed table).
fn tables_named(doc: &Value) -> BTreeSet<(String, String)> {
    let mut out = BTreeSet::new();
    for item in doc
        .get("nftables")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let t = item
            .get("table")
            .or_else(|| item.as_object()?.values().next()?.get("table"));
        if let Some(t) = t
            && let (Some(f), Some(n)) = (
                t.get("family").and_then(Value::as_str),
                t.get("name").and_then(Value::as_str),
            )
        {
            out.insert((f.to_owned(), n.to_owned()));
        }
    }
    out
}

fn read(
    doc: &Value,
    owned: &BTreeSet<(String, String)>,
    mode: Mode,
) -> Result<Tables, NftCompareError> {
    let owned: Vec<(&str, &str)> = owned
        .iter()
        .map(|(f, n)| (f.as_str(), n.as_str()))
        .collect();
    let mut t = Tables {
        items: true,
        ..Tables::default()
    };
    t.apply_doc(doc, &owned, mode)?;
    Ok(t)
}

/// Compares every table `planned` (a transaction) adds or deletes with `listed` (nft's JSON
/// listing of those tables; `{"nftables": []}` when none exists). Empty when equal. A table the
/// plan deletes and does not add again must be absent; tables the plan never names are not
/// compared (they are not ours).
///
/// # Errors
/// [`NftCompareError`] when either side is not nft JSON or the plan uses a command outside the
/// model (see the module docs).
pub fn diff_plan(planned: &Value, listed: &Value) -> Result<Vec<Difference>, NftCompareError> {
    let owned = tables_named(planned);
    let want = read(planned, &owned, Mode::Plan)?;
    let have = read(listed, &owned, Mode::Listing)?;
    Ok(diff(&want, &have))
}

/// The listing's tables in canonical form (normalized as [`diff_plan`] reads them): equal for
/// two listings exactly when they hold the same content. For remembering, within one process,
/// what a table looked like (element digests are not stable across builds).
///
/// # Errors
/// When `listed` is not an nft JSON listing.
pub fn canonical_listing(listed: &Value) -> Result<String, NftCompareError> {
    let t = read(listed, &tables_named(listed), Mode::Listing)?;
    Ok(format!("{:?}", t.tables))
}
