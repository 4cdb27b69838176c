//! Reading instances with their leases and `Instance.addresses` (spec: "Addresses on an
//! instance"): the IPv4 lease first, then the IPv6 lease, each in CIDR form with the prefix
//! length of the pool's range that contains it (`/32`, `/128` when none does), then the
//! addresses host status reports added ([`crate::reports`]). Provider instances carry their
//! machine's addresses instead ([`crate::providers`]).

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use sqlx::Row;
use vmnet_model::ids::validate_id;
use vmnet_model::pool::{Instance, PoolRange};

use crate::addresses::{append_stored, reported};
use crate::db::{Tx, db_err, on_tx};
use crate::error::IpamError;
use crate::pool_ranges::ranges_of;
use crate::stored::parse_stored;

fn to_u32(field: &str, v: i64) -> Result<u32, IpamError> {
    u32::try_from(v).map_err(|_| IpamError::Corrupt(format!("stored {field} {v} is out of range")))
}

pub(crate) fn instance_sql(tx: &Tx, filter: &str) -> sqlx::AssertSqlSafe<String> {
    let (address, address6) = match tx {
        Tx::Sqlite(_) => ("l.address", "l6.address"),
        Tx::Postgres(_) => ("host(l.address)", "host(l6.address)"),
    };
    sqlx::AssertSqlSafe(format!(
        "SELECT i.instance_id, i.pool_id, i.host_id, i.vcpus, i.memory_mib, i.recreate_on_host_loss, \
         i.state, i.conditions, i.network_policy, i.sandbox, i.allocation_id, {address} AS address, \
         {address6} AS address6, m.server_id, m.node, m.vmid, m.addresses AS machine_addresses, \
         m.polled_at, m.stale \
         FROM instances i LEFT JOIN ip_leases l ON l.instance_id = i.instance_id \
         LEFT JOIN ip6_leases l6 ON l6.instance_id = i.instance_id \
         LEFT JOIN provider_machines m ON m.instance_id = i.instance_id {filter}"
    ))
}

/// An instance as its row holds it; a hosted instance's `addresses` are filled in by
/// [`complete`].
pub(crate) fn instance_row<R: Row>(r: &R) -> Result<Instance, IpamError>
where
    for<'a> &'a str: sqlx::ColumnIndex<R>,
    for<'a> i64: sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
    for<'a> bool: sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
    for<'a> String: sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
    for<'a> Option<String>: sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
    for<'a> Option<i64>: sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
    for<'a> Option<bool>: sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
{
    let state: String = r.try_get("state").map_err(db_err)?;
    let conditions: String = r.try_get("conditions").map_err(db_err)?;
    let address: Option<String> = r.try_get("address").map_err(db_err)?;
    let address6: Option<String> = r.try_get("address6").map_err(db_err)?;
    let policy: String = r.try_get("network_policy").map_err(db_err)?;
    let address = address
        .map(|a| parse_stored::<Ipv4Addr>("address", &a))
        .transpose()?;
    let address6 = address6
        .map(|a| parse_stored::<Ipv6Addr>("IPv6 lease", &a))
        .transpose()?;
    // An instance of a provider pool: its machine and the addresses of the last good poll.
    let machine_addresses: Option<String> = r.try_get("machine_addresses").map_err(db_err)?;
    let (addresses, machine) = match &machine_addresses {
        Some(json) => (
            crate::providers::stored_addresses(json)?,
            Some(crate::providers::machine_of(
                r.try_get("server_id").map_err(db_err)?,
                r.try_get("node").map_err(db_err)?,
                r.try_get("vmid").map_err(db_err)?,
            )?),
        ),
        None => (Vec::new(), None),
    };
    let stale: Option<bool> = r.try_get("stale").map_err(db_err)?;
    Ok(Instance {
        instance_id: r.try_get("instance_id").map_err(db_err)?,
        pool_id: r.try_get("pool_id").map_err(db_err)?,
        host_id: r.try_get("host_id").map_err(db_err)?,
        vcpus: to_u32("vcpus", r.try_get("vcpus").map_err(db_err)?)?,
        memory_mib: to_u32("memory_mib", r.try_get("memory_mib").map_err(db_err)?)?,
        recreate_on_host_loss: r.try_get("recreate_on_host_loss").map_err(db_err)?,
        state: state
            .parse()
            .map_err(|e| IpamError::Corrupt(format!("stored {e}")))?,
        conditions: serde_json::from_str(&conditions).map_err(|source| IpamError::Json {
            what: format!("stored conditions {conditions:?}"),
            source,
        })?,
        address,
        address6,
        network_policy: policy
            .parse()
            .map_err(|e| IpamError::Corrupt(format!("stored {e}")))?,
        sandbox: r.try_get("sandbox").map_err(db_err)?,
        allocation_id: r.try_get("allocation_id").map_err(db_err)?,
        addresses,
        machine,
        addresses_stale: stale.unwrap_or(false),
        addresses_polled_at_unix_ms: r.try_get("polled_at").map_err(db_err)?,
    })
}

/// A lease in CIDR form: the address with the prefix length of the first of `ranges` whose
/// `cidr` contains it, or a host prefix (`/32`, `/128`) when none does (the range was replaced
/// since). For the first IPv4 range this is [`vmnet_model::nic::lease_cidr`], the rule the host
/// plan uses too.
#[must_use]
pub fn lease_net(address: IpAddr, ranges: &[PoolRange]) -> IpNet {
    ranges
        .iter()
        .find(|r| r.cidr.contains(&address))
        .and_then(|r| IpNet::new(address, r.cidr.prefix_len()).ok())
        .unwrap_or_else(|| IpNet::from(address))
}

/// Fills in the `addresses` of hosted instances: the IPv4 lease, the IPv6 lease (CIDR form,
/// [`lease_net`]), then the reported addresses in arrival order. `one` limits the read of
/// reports to one instance.
pub(crate) async fn complete(
    tx: &mut Tx,
    one: Option<&str>,
    list: &mut [Instance],
) -> Result<(), IpamError> {
    let mut by_pool: HashMap<String, Vec<PoolRange>> = HashMap::new();
    for inst in list.iter_mut() {
        if inst.machine.is_some() || (inst.address.is_none() && inst.address6.is_none()) {
            continue;
        }
        if !by_pool.contains_key(&inst.pool_id) {
            let ranges = ranges_of(tx, &inst.pool_id, None, false).await?;
            by_pool.insert(
                inst.pool_id.clone(),
                ranges.into_iter().map(|s| s.range).collect(),
            );
        }
        let ranges = by_pool.get(&inst.pool_id).map_or(&[][..], Vec::as_slice);
        let leases = inst
            .address
            .map(IpAddr::V4)
            .into_iter()
            .chain(inst.address6.map(IpAddr::V6));
        inst.addresses = leases.map(|a| lease_net(a, ranges).to_string()).collect();
    }
    let mut reports: HashMap<String, Vec<String>> = HashMap::new();
    for (id, a) in reported(tx, one).await? {
        reports.entry(id).or_default().push(a);
    }
    for inst in list.iter_mut() {
        if let Some(stored) = reports.get(&inst.instance_id) {
            append_stored(&mut inst.addresses, stored)?;
        }
    }
    Ok(())
}

/// An instance with its leases and its `addresses` (the IPv4 lease, the IPv6 lease, then
/// reported addresses; see [`crate::reports`]).
///
/// # Errors
/// `INVALID_INPUT` for a bad id; `NOT_FOUND` for an unknown instance; `UNAVAILABLE` on a database failure.
pub async fn get_instance(tx: &mut Tx, instance_id: &str) -> Result<Instance, IpamError> {
    validate_id("instance_id", instance_id)?;
    let sql = instance_sql(tx, "WHERE i.instance_id = $1");
    let row = on_tx!(tx, t => match sqlx::query(sql).bind(instance_id).fetch_optional(&mut **t).await.map_err(db_err)? {
        Some(r) => Some(instance_row(&r)?),
        None => None,
    });
    let mut inst = row.ok_or_else(|| IpamError::not_found(format!("instance {instance_id}")))?;
    complete(tx, Some(instance_id), std::slice::from_mut(&mut inst)).await?;
    Ok(inst)
}

/// Every instance, ordered by id.
///
/// # Errors
/// `UNAVAILABLE` on a database failure.
pub async fn list_instances(tx: &mut Tx) -> Result<Vec<Instance>, IpamError> {
    let sql = instance_sql(tx, "ORDER BY i.instance_id");
    let mut list: Vec<Instance> = on_tx!(tx, t => sqlx::query(sql).fetch_all(&mut **t).await.map_err(db_err)?.iter().map(instance_row).collect::<Result<_, _>>()?);
    complete(tx, None, &mut list).await?;
    Ok(list)
}
