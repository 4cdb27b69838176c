//! The `instance_addresses` table (migration 0103): the addresses host status reports added to
//! instances, in arrival order. Written by [`crate::reports`], read with every instance
//! ([`crate::placement`]), cleared on a host loss ([`crate::loss`]). A leaf module.

use crate::error::IpamError;
use ipnet::IpNet;

use crate::db::{Tx, db_err, on_tx};
use crate::stored::parse_stored;

/// Appends one reported address; false when it was already stored (by a concurrent report).
pub(crate) async fn insert_reported(
    tx: &mut Tx,
    instance_id: &str,
    net: IpNet,
) -> Result<bool, IpamError> {
    let sql = match tx {
        Tx::Sqlite(_) => {
            "INSERT INTO instance_addresses (instance_id, address) VALUES ($1, $2) \
             ON CONFLICT (instance_id, address) DO NOTHING"
        }
        Tx::Postgres(_) => {
            "INSERT INTO instance_addresses (instance_id, address) VALUES ($1, $2::inet) \
             ON CONFLICT (instance_id, address) DO NOTHING"
        }
    };
    let n = on_tx!(tx, t => sqlx::query(sql)
        .bind(instance_id)
        .bind(net.to_string())
        .execute(&mut **t)
        .await
        .map_err(db_err)?
        .rows_affected());
    Ok(n == 1)
}

/// The reported addresses of one instance (`Some(id)`) or of every instance (`None`), as
/// `(instance_id, CIDR text)` ordered by instance id, then arrival.
pub(crate) async fn reported(
    tx: &mut Tx,
    instance_id: Option<&str>,
) -> Result<Vec<(String, String)>, IpamError> {
    let address = match tx {
        Tx::Sqlite(_) => "address",
        Tx::Postgres(_) => "text(address)",
    };
    let filter = if instance_id.is_some() {
        "WHERE instance_id = $1"
    } else {
        ""
    };
    let sql = sqlx::AssertSqlSafe(format!(
        "SELECT instance_id, {address} FROM instance_addresses {filter} ORDER BY instance_id, seq"
    ));
    let rows: Vec<(String, String)> = on_tx!(tx, t => {
        let q = sqlx::query_as(sql);
        let q = match instance_id {
            Some(id) => q.bind(id.to_owned()),
            None => q,
        };
        q.fetch_all(&mut **t).await.map_err(db_err)?
    });
    Ok(rows)
}

/// Appends reported addresses (CIDR text from the store) to `addresses` (which holds the lease,
/// if any), skipping any already listed.
pub(crate) fn append_stored(
    addresses: &mut Vec<String>,
    stored: &[String],
) -> Result<(), IpamError> {
    let mut nets: Vec<IpNet> = addresses
        .iter()
        .map(|a| parse_stored("address", a))
        .collect::<Result<_, _>>()?;
    let reported: Vec<IpNet> = stored
        .iter()
        .map(|a| parse_stored("reported address", a))
        .collect::<Result<_, _>>()?;
    vmnet_model::nic::append_reported(&mut nets, &reported);
    *addresses = nets.iter().map(ToString::to_string).collect();
    Ok(())
}

/// Forgets every reported address of an instance (its host was lost: they came from the old
/// machine).
pub(crate) async fn clear_reported(tx: &mut Tx, instance_id: &str) -> Result<(), IpamError> {
    on_tx!(tx, t => sqlx::query("DELETE FROM instance_addresses WHERE instance_id = $1")
        .bind(instance_id)
        .execute(&mut **t)
        .await
        .map_err(db_err)?
        .rows_affected());
    Ok(())
}
