//! The mesh's VM registrations: where each VM of the fleet lives (table `mesh_vms`, migration
//! 0130; spec "Atlas WG Mesh", design `design/mesh.md`, "Locations").
//!
//! A registration is keyed by (host, mesh address): the host is the registering host's mesh
//! address, its identity in the mesh. Each host writes only its own rows (every writing function
//! takes the host and touches no other host's row). Two hosts may claim one mesh address for a
//! while (a VM moved before its old host unregistered it, a misconfiguration); [`resolve`]
//! decides between them deterministically: the oldest registration wins, then the smallest host.
//!
//! On PostgreSQL every change notifies channel [`CHANNEL`] at commit (a statement trigger), so
//! the peers re-read at once; [`listener`] opens such a listener. SQLite has no notifications:
//! with the embedded store there is one host and every VM is local.
//!
//! Like [`crate::vm_store`] the store is dumb: addresses and blocks are canonical text, validated
//! by the agent. Every function takes the caller's transaction.

use std::collections::BTreeMap;

use crate::db::{Db, Tx, db_err, on_tx};
use crate::error::IpamError;

/// The PostgreSQL notification channel of registration changes.
pub const CHANNEL: &str = "vmnet_mesh_vms";

/// One registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeshVmRow {
    /// The registering host's mesh address, canonical IPv6 text.
    pub host: String,
    /// The VM's mesh address, canonical IPv6 text.
    pub mesh_address: String,
    /// The VM's user id on `host`.
    pub user_id: u32,
    /// The VM's tenant (0 is privileged).
    pub tenant: u32,
    /// The VM's public IPv6 block (canonical prefix text), if any.
    pub public_block: Option<String>,
    /// Whether the VM serves as a gateway.
    pub gateway: bool,
    /// Milliseconds since the Unix epoch of the claim's first registration.
    pub registered_at: i64,
}

impl MeshVmRow {
    /// Whether `self` and `other` say the same, whenever each was first registered.
    #[must_use]
    pub fn same_claim(&self, other: &Self) -> bool {
        Self {
            registered_at: 0,
            ..self.clone()
        } == Self {
            registered_at: 0,
            ..other.clone()
        }
    }
}

type Raw = (String, String, i64, i64, Option<String>, i64, i64);

fn from_raw(r: Raw) -> Result<MeshVmRow, IpamError> {
    let num = |v: i64, what: &str| {
        u32::try_from(v).map_err(|_| {
            IpamError::Corrupt(format!(
                "mesh registration {} on {}: stored {what} {v} is out of range",
                r.1, r.0
            ))
        })
    };
    Ok(MeshVmRow {
        user_id: num(r.2, "user_id")?,
        tenant: num(r.3, "tenant")?,
        host: r.0,
        mesh_address: r.1,
        public_block: r.4,
        gateway: r.5 != 0,
        registered_at: r.6,
    })
}

macro_rules! select {
    ($tail:literal) => {
        concat!(
            "SELECT host, mesh_address, user_id, tenant, public_block, gateway, registered_at \
             FROM mesh_vms ",
            $tail
        )
    };
}

/// Every registration of the fleet, ordered by mesh address, registration time and host.
///
/// # Errors
/// `UNAVAILABLE` on a database failure; `CORRUPT` for a number out of range.
pub async fn list(tx: &mut Tx) -> Result<Vec<MeshVmRow>, IpamError> {
    let rows: Vec<Raw> = on_tx!(tx, c => sqlx::query_as(
        select!("ORDER BY mesh_address, registered_at, host")).fetch_all(&mut **c).await)
    .map_err(db_err)?;
    rows.into_iter().map(from_raw).collect()
}

/// The registrations of `host`, ordered by mesh address.
///
/// # Errors
/// As [`list`].
pub async fn of_host(tx: &mut Tx, host: &str) -> Result<Vec<MeshVmRow>, IpamError> {
    let rows: Vec<Raw> = on_tx!(tx, c => sqlx::query_as(
        select!("WHERE host = $1 ORDER BY mesh_address")).bind(host).fetch_all(&mut **c).await)
    .map_err(db_err)?;
    rows.into_iter().map(from_raw).collect()
}

/// Registers `row` for its host: inserted, or rewritten in place when the host already claims
/// the address (its `registered_at` is then kept). Writes nothing when the stored row says the
/// same. Returns whether it wrote.
///
/// # Errors
/// `UNAVAILABLE` on a database failure.
pub async fn register(tx: &mut Tx, row: &MeshVmRow) -> Result<bool, IpamError> {
    let n = on_tx!(tx, c => sqlx::query(
        "INSERT INTO mesh_vms (host, mesh_address, user_id, tenant, public_block, gateway, \
         registered_at) VALUES ($1, $2, $3, $4, $5, $6, $7) \
         ON CONFLICT (host, mesh_address) DO UPDATE SET user_id = excluded.user_id, \
         tenant = excluded.tenant, public_block = excluded.public_block, \
         gateway = excluded.gateway \
         WHERE mesh_vms.user_id <> excluded.user_id OR mesh_vms.tenant <> excluded.tenant \
            OR mesh_vms.gateway <> excluded.gateway \
            OR COALESCE(mesh_vms.public_block, '') <> COALESCE(excluded.public_block, '')")
        .bind(&row.host)
        .bind(&row.mesh_address)
        .bind(i64::from(row.user_id))
        .bind(i64::from(row.tenant))
        .bind(&row.public_block)
        .bind(i64::from(row.gateway))
        .bind(row.registered_at)
        .execute(&mut **c).await.map(|r| r.rows_affected()))
    .map_err(db_err)?;
    Ok(n > 0)
}

/// Removes `host`'s registration of `mesh_address`; returns whether there was one.
///
/// # Errors
/// `UNAVAILABLE` on a database failure.
pub async fn unregister(tx: &mut Tx, host: &str, mesh_address: &str) -> Result<bool, IpamError> {
    let n = on_tx!(tx, c => sqlx::query(
        "DELETE FROM mesh_vms WHERE host = $1 AND mesh_address = $2")
        .bind(host)
        .bind(mesh_address)
        .execute(&mut **c).await.map(|r| r.rows_affected()))
    .map_err(db_err)?;
    Ok(n > 0)
}

/// What [`replace_host`] changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Replaced {
    /// Mesh addresses registered or rewritten.
    pub written: Vec<String>,
    /// Mesh addresses no longer registered by the host.
    pub removed: Vec<String>,
}

/// Makes `rows` (all of `host`) the complete set of `host`'s registrations, writing only the
/// rows that differ: missing or changed ones are registered, the host's others removed.
///
/// # Errors
/// [`IpamError::Corrupt`] when a row names another host (a caller's bug); `UNAVAILABLE` on a
/// database failure.
pub async fn replace_host(
    tx: &mut Tx,
    host: &str,
    rows: &[MeshVmRow],
) -> Result<Replaced, IpamError> {
    if let Some(r) = rows.iter().find(|r| r.host != host) {
        return Err(IpamError::Corrupt(format!(
            "mesh registration {} names host {}, not {host}: a host writes only its own rows",
            r.mesh_address, r.host
        )));
    }
    let have: BTreeMap<String, MeshVmRow> = of_host(tx, host)
        .await?
        .into_iter()
        .map(|r| (r.mesh_address.clone(), r))
        .collect();
    let mut out = Replaced::default();
    for r in rows {
        if have.get(&r.mesh_address).is_some_and(|h| h.same_claim(r)) {
            continue;
        }
        register(tx, r).await?;
        out.written.push(r.mesh_address.clone());
    }
    for gone in have
        .keys()
        .filter(|a| !rows.iter().any(|r| &r.mesh_address == *a))
    {
        unregister(tx, host, gone).await?;
        out.removed.push(gone.clone());
    }
    Ok(out)
}

/// A mesh address claimed by more than one host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conflict {
    /// The address.
    pub mesh_address: String,
    /// The host whose claim wins.
    pub winner: String,
    /// The hosts whose claims lose, in order.
    pub losers: Vec<String>,
}

/// The registrations in force: one per mesh address, the oldest claim winning, then the
/// smallest host (text order); and every conflict found.
#[must_use]
pub fn resolve(rows: &[MeshVmRow]) -> (BTreeMap<String, MeshVmRow>, Vec<Conflict>) {
    let mut by: BTreeMap<&str, Vec<&MeshVmRow>> = BTreeMap::new();
    for r in rows {
        by.entry(r.mesh_address.as_str()).or_default().push(r);
    }
    let mut winners = BTreeMap::new();
    let mut conflicts = Vec::new();
    for (addr, mut claims) in by {
        claims.sort_by(|a, b| (a.registered_at, &a.host).cmp(&(b.registered_at, &b.host)));
        let w = claims[0];
        if claims.len() > 1 {
            conflicts.push(Conflict {
                mesh_address: addr.to_owned(),
                winner: w.host.clone(),
                losers: claims[1..].iter().map(|c| c.host.clone()).collect(),
            });
        }
        winners.insert(addr.to_owned(), w.clone());
    }
    (winners, conflicts)
}

/// A listener on [`CHANNEL`] for a PostgreSQL store (`None` for SQLite, which has no
/// notifications). Its `recv` reconnects by itself after a lost connection; notifications sent
/// meanwhile are lost, so the caller re-reads the whole set after an error.
///
/// # Errors
/// `UNAVAILABLE` when the listening connection cannot be opened.
pub async fn listener(db: &Db) -> Result<Option<sqlx::postgres::PgListener>, IpamError> {
    let Db::Postgres(pg) = db else {
        return Ok(None);
    };
    let mut l = sqlx::postgres::PgListener::connect_with(&pg.pool)
        .await
        .map_err(db_err)?;
    l.listen(CHANNEL).await.map_err(db_err)?;
    Ok(Some(l))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(host: &str, addr: &str, at: i64) -> MeshVmRow {
        MeshVmRow {
            host: host.into(),
            mesh_address: addr.into(),
            user_id: 1,
            tenant: 1,
            public_block: None,
            gateway: false,
            registered_at: at,
        }
    }

    #[test]
    fn the_oldest_claim_wins_then_the_smallest_host() {
        let rows = [
            row("fdaa::2", "fdaa:1::1", 5),
            row("fdaa::3", "fdaa:1::1", 4),
            row("fdaa::1", "fdaa:1::1", 5),
            row("fdaa::2", "fdaa:1::2", 9),
        ];
        let (w, c) = resolve(&rows);
        assert_eq!(w["fdaa:1::1"].host, "fdaa::3");
        assert_eq!(w["fdaa:1::2"].host, "fdaa::2");
        assert_eq!(
            c,
            [Conflict {
                mesh_address: "fdaa:1::1".into(),
                winner: "fdaa::3".into(),
                losers: vec!["fdaa::1".into(), "fdaa::2".into()],
            }]
        );
        // The same whatever the input order.
        let mut rev = rows.to_vec();
        rev.reverse();
        assert_eq!(resolve(&rev), (w, c));
    }

    #[test]
    fn a_claim_is_the_same_whenever_it_was_registered() {
        assert!(row("h", "a", 1).same_claim(&row("h", "a", 2)));
        let mut t = row("h", "a", 1);
        t.tenant = 2;
        assert!(!t.same_claim(&row("h", "a", 1)));
    }
}
