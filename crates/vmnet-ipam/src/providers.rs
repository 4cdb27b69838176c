//! Provider pools in the store (migration 0120; spec: hosted-pool-networking.md, the table of
//! pools, "Provider", and "Addresses on an instance", provider pools).
//!
//! * A pool is a provider pool when it has a `provider_pools` row: the provider, the API base
//!   URL, where the credentials are (a file path or an environment variable name, never the
//!   secret) and the poll interval. It has no range and leases nothing: [`set_ip_pool`] on it
//!   is `CONFLICT`, and so is [`set_provider_pool`] on a pool with a range or with instances
//!   that are not machines.
//! * Its instances are not placed on hosts: [`create_instance`] stores the instance (no host,
//!   no claim, no lease, state `running`, its id as allocation id) and its machine in
//!   `provider_machines`. A machine belongs to one instance per pool (`CONFLICT` naming the
//!   holder).
//! * `Instance.addresses` of such an instance is the JSON array the last good poll wrote
//!   ([`record_poll`]): each poll replaces it as a whole. A failed poll marks it stale and keeps
//!   it.
//!
//! [`set_ip_pool`]: crate::set_ip_pool
//! [`create_instance`]: crate::create_instance

use ipnet::IpNet;
use vmnet_model::ids::validate_id;
use vmnet_model::pool::{Credentials, Machine, Provider, ProviderPool, SetProviderPool};

use crate::db::{Tx, db_err, on_tx};
use crate::error::IpamError;
use crate::stored::parse_stored;

/// Makes `req.pool_id` a provider pool, or replaces its settings, and returns them with the
/// defaults filled in. Creates the pool if it does not exist. On PostgreSQL the `ip_pools`
/// table is locked against range writes first (as [`crate::set_ip_pool`] does), so a range and
/// a provider cannot be set on one pool at the same time.
///
/// # Errors
/// `INVALID_INPUT` naming the pool and the field ([`SetProviderPool::validate`]); `CONFLICT`
/// when the pool has a range (`pool p1 has a range; a provider pool leases nothing`), has
/// instances without a machine, or has machines and the request changes the provider;
/// `UNAVAILABLE` on a database failure. On error nothing was written.
pub async fn set_provider_pool(
    tx: &mut Tx,
    req: &SetProviderPool,
) -> Result<ProviderPool, IpamError> {
    let p = req.validate()?;
    if let Tx::Postgres(t) = tx {
        sqlx::query("LOCK TABLE ip_pools IN SHARE ROW EXCLUSIVE MODE")
            .execute(&mut **t)
            .await
            .map_err(db_err)?;
    }
    let id = p.pool_id.as_str();
    let has_range: Option<String> = on_tx!(tx, t => sqlx::query_scalar("SELECT pool_id FROM ip_pools WHERE pool_id = $1")
        .bind(id)
        .fetch_optional(&mut **t)
        .await
        .map_err(db_err)?);
    if has_range.is_some() {
        return Err(IpamError::Conflict(format!(
            "pool {id} has a range; a provider pool leases nothing (use another pool id)"
        )));
    }
    let (hosted, machines): (i64, i64) = on_tx!(tx, t => sqlx::query_as(
        "SELECT COUNT(*) FILTER (WHERE m.instance_id IS NULL), COUNT(m.instance_id) FROM instances i \
         LEFT JOIN provider_machines m ON m.instance_id = i.instance_id WHERE i.pool_id = $1")
        .bind(id)
        .fetch_one(&mut **t)
        .await
        .map_err(db_err)?);
    if hosted > 0 {
        return Err(IpamError::Conflict(format!(
            "pool {id} has {hosted} hosted instance(s) without a machine; a provider pool's instances are machines"
        )));
    }
    if machines > 0
        && let Some(old) = provider_of(tx, id).await?
        && old.provider != p.provider
    {
        return Err(IpamError::Conflict(format!(
            "pool {id} has {machines} {} machine(s); delete their instances before changing the provider to {}",
            old.provider, p.provider
        )));
    }
    on_tx!(tx, t => sqlx::query("INSERT INTO pools (pool_id) VALUES ($1) ON CONFLICT (pool_id) DO NOTHING")
        .bind(id)
        .execute(&mut **t)
        .await
        .map_err(db_err)?
        .rows_affected());
    let (file, env) = match &p.credentials {
        Credentials::File(f) => (Some(f.as_str()), None),
        Credentials::Env(e) => (None, Some(e.as_str())),
    };
    on_tx!(tx, t => sqlx::query(
        "INSERT INTO provider_pools (pool_id, provider, api_url, credentials_file, credentials_env, \
         poll_interval_secs) VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (pool_id) DO UPDATE SET \
         provider = excluded.provider, api_url = excluded.api_url, \
         credentials_file = excluded.credentials_file, credentials_env = excluded.credentials_env, \
         poll_interval_secs = excluded.poll_interval_secs")
        .bind(id)
        .bind(p.provider.as_str())
        .bind(&p.api_url)
        .bind(file)
        .bind(env)
        .bind(i64::from(p.poll_interval_secs))
        .execute(&mut **t)
        .await
        .map_err(db_err)?
        .rows_affected());
    Ok(p)
}

/// `(instance_id, server_id, node, vmid)` as stored.
type MachineRow = (String, Option<i64>, Option<String>, Option<i64>);

type PoolRow = (String, String, String, Option<String>, Option<String>, i64);

const POOL_COLS: &str = "SELECT pool_id, provider, api_url, credentials_file, credentials_env, \
                         poll_interval_secs FROM provider_pools";

fn pool_row(
    (pool_id, provider, api_url, file, env, secs): PoolRow,
) -> Result<ProviderPool, IpamError> {
    let provider: Provider = provider.parse().map_err(|_| {
        IpamError::Corrupt(format!("stored provider {provider:?} of pool {pool_id}"))
    })?;
    let credentials = match (file, env) {
        (Some(f), None) => Credentials::File(f),
        (None, Some(e)) => Credentials::Env(e),
        _ => {
            return Err(IpamError::Corrupt(format!(
                "pool {pool_id}: stored credentials name neither a file nor a variable"
            )));
        }
    };
    Ok(ProviderPool {
        provider,
        api_url,
        credentials,
        poll_interval_secs: u32::try_from(secs)
            .map_err(|_| IpamError::Corrupt(format!("stored poll_interval_secs {secs}")))?,
        pool_id,
    })
}

/// The provider settings of a pool, `None` for a hosted (or unknown) pool.
pub(crate) async fn provider_of(
    tx: &mut Tx,
    pool_id: &str,
) -> Result<Option<ProviderPool>, IpamError> {
    let sql = sqlx::AssertSqlSafe(format!("{POOL_COLS} WHERE pool_id = $1"));
    let row: Option<PoolRow> = on_tx!(tx, t => sqlx::query_as(sql)
        .bind(pool_id)
        .fetch_optional(&mut **t)
        .await
        .map_err(db_err)?);
    row.map(pool_row).transpose()
}

/// Every provider pool, ordered by id (what the agent's poller polls).
///
/// # Errors
/// `UNAVAILABLE` on a database failure.
pub async fn list_provider_pools(tx: &mut Tx) -> Result<Vec<ProviderPool>, IpamError> {
    let sql = sqlx::AssertSqlSafe(format!("{POOL_COLS} ORDER BY pool_id"));
    let rows: Vec<PoolRow> = on_tx!(tx, t => sqlx::query_as(sql)
        .fetch_all(&mut **t)
        .await
        .map_err(db_err)?);
    rows.into_iter().map(pool_row).collect()
}

/// Records the machine of a new instance of a provider pool.
///
/// # Errors
/// `CONFLICT` naming the instance that has the machine already; `UNAVAILABLE` on a database
/// failure.
pub(crate) async fn insert_machine(
    tx: &mut Tx,
    pool_id: &str,
    instance_id: &str,
    m: &Machine,
) -> Result<(), IpamError> {
    let server_id = m.server_id.map(i64::try_from).transpose().map_err(|_| {
        IpamError::invalid(format!(
            "instance {instance_id}: machine.server_id is too large"
        ))
    })?;
    let vmid = m.vmid.map(i64::from);
    let n = on_tx!(tx, t => sqlx::query(
        "INSERT INTO provider_machines (instance_id, pool_id, server_id, node, vmid) \
         VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING")
        .bind(instance_id)
        .bind(pool_id)
        .bind(server_id)
        .bind(m.node.as_deref())
        .bind(vmid)
        .execute(&mut **t)
        .await
        .map_err(db_err)?
        .rows_affected());
    if n == 1 {
        return Ok(());
    }
    let holder: Option<String> = on_tx!(tx, t => sqlx::query_scalar(
        "SELECT instance_id FROM provider_machines WHERE pool_id = $1 AND (server_id = $2 OR vmid = $3)")
        .bind(pool_id)
        .bind(server_id)
        .bind(vmid)
        .fetch_optional(&mut **t)
        .await
        .map_err(db_err)?);
    Err(IpamError::Conflict(format!(
        "instance {instance_id}: machine {m} of pool {pool_id} is instance {}",
        holder.unwrap_or_else(|| "unknown".into())
    )))
}

/// Every instance of provider pool `pool_id` with its machine, ordered by instance id.
///
/// # Errors
/// `INVALID_INPUT` for a bad id; `UNAVAILABLE` on a database failure.
pub async fn provider_machines(
    tx: &mut Tx,
    pool_id: &str,
) -> Result<Vec<(String, Machine)>, IpamError> {
    validate_id("pool_id", pool_id)?;
    let rows: Vec<MachineRow> = on_tx!(tx, t => sqlx::query_as(
        "SELECT instance_id, server_id, node, vmid FROM provider_machines WHERE pool_id = $1 ORDER BY instance_id")
        .bind(pool_id)
        .fetch_all(&mut **t)
        .await
        .map_err(db_err)?);
    rows.into_iter()
        .map(|(id, server_id, node, vmid)| Ok((id, machine_of(server_id, node, vmid)?)))
        .collect()
}

/// The machine of stored columns.
pub(crate) fn machine_of(
    server_id: Option<i64>,
    node: Option<String>,
    vmid: Option<i64>,
) -> Result<Machine, IpamError> {
    let bad = |what: &str| IpamError::Corrupt(format!("stored machine {what} is out of range"));
    Ok(Machine {
        server_id: server_id
            .map(u64::try_from)
            .transpose()
            .map_err(|_| bad("server_id"))?,
        node,
        vmid: vmid
            .map(u32::try_from)
            .transpose()
            .map_err(|_| bad("vmid"))?,
    })
}

/// The stored addresses (a JSON array of CIDR text) of a machine.
pub(crate) fn stored_addresses(json: &str) -> Result<Vec<String>, IpamError> {
    let list: Vec<String> = serde_json::from_str(json).map_err(|source| IpamError::Json {
        what: format!("stored machine addresses {json:?}"),
        source,
    })?;
    for a in &list {
        parse_stored::<IpNet>("machine address", a)?;
    }
    Ok(list)
}

/// What one poll found for one machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MachinePoll {
    /// The instance.
    pub instance_id: String,
    /// The machine's addresses as the provider reports them now (they replace the stored
    /// ones), or `None` when this machine's poll failed (the stored ones stay, marked stale).
    pub addresses: Option<Vec<IpNet>>,
}

/// Writes one poll of provider pool `pool_id`, finished at `polled_at_unix_ms`: each machine
/// with addresses gets exactly those (replaced, never appended), that time and `stale` false;
/// each machine whose poll failed keeps its addresses and is marked stale. Instances not in
/// `results` (say, created during the poll) are left as they are; an instance deleted during the
/// poll is skipped. Returns how many machines were written.
///
/// # Errors
/// `UNAVAILABLE` on a database failure.
pub async fn record_poll(
    tx: &mut Tx,
    pool_id: &str,
    polled_at_unix_ms: i64,
    results: &[MachinePoll],
) -> Result<u64, IpamError> {
    let mut written = 0;
    for r in results {
        written += match &r.addresses {
            Some(list) => {
                let text: Vec<String> = list.iter().map(ToString::to_string).collect();
                let json = serde_json::to_string(&text).map_err(|source| IpamError::Json {
                    what: "machine addresses".into(),
                    source,
                })?;
                on_tx!(tx, t => sqlx::query(
                    "UPDATE provider_machines SET addresses = $3, polled_at = $4, stale = $5 \
                     WHERE pool_id = $1 AND instance_id = $2")
                    .bind(pool_id)
                    .bind(&r.instance_id)
                    .bind(json)
                    .bind(polled_at_unix_ms)
                    .bind(false)
                    .execute(&mut **t)
                    .await
                    .map_err(db_err)?
                    .rows_affected())
            }
            None => on_tx!(tx, t => sqlx::query(
                "UPDATE provider_machines SET stale = $3 WHERE pool_id = $1 AND instance_id = $2")
                .bind(pool_id)
                .bind(&r.instance_id)
                .bind(true)
                .execute(&mut **t)
                .await
                .map_err(db_err)?
                .rows_affected()),
        };
    }
    Ok(written)
}

/// Marks every machine of `pool_id` stale (the whole poll failed: the list call, the
/// credentials); their addresses stay. Returns how many were marked.
///
/// # Errors
/// `UNAVAILABLE` on a database failure.
pub async fn mark_pool_stale(tx: &mut Tx, pool_id: &str) -> Result<u64, IpamError> {
    Ok(
        on_tx!(tx, t => sqlx::query("UPDATE provider_machines SET stale = $2 WHERE pool_id = $1")
        .bind(pool_id)
        .bind(true)
        .execute(&mut **t)
        .await
        .map_err(db_err)?
        .rows_affected()),
    )
}
