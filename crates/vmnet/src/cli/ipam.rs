//! `vmnet pool|host|instance|lease …`: IPAM commands against the store (spec:
//! hosted-pool-networking.md, "Give a hosted pool a range", "How leases work").
//!
//! Each command opens the database (`--database-url`, `VMNET_DATABASE_URL`, or the SQLite file
//! `<state-dir>/vmnet.db`, created with its directory if missing), runs in one transaction and
//! commits. Output is a human table, or JSON with `--output json`. Errors are returned to `main`,
//! which prints `error: CODE: message` and exits with the code's documented status.

use std::fmt::Write as _;

use clap::Subcommand;
use serde::Serialize;
use vmnet_ipam::{Db, Host, Instance, IpRange, Lease, NewInstance, Pool, SetIpPool, Store, Tx};
use vmnet_model::Error;

use crate::{Global, Output};

/// `vmnet pool …`
#[derive(Debug, Subcommand)]
pub enum PoolCmd {
    /// Set (or replace) a pool's IPv4 range; creates the pool if needed. Existing leases stay.
    Set {
        /// The pool id.
        pool: String,
        /// The IPv4 network, e.g. 10.0.0.0/24.
        #[arg(long)]
        cidr: String,
        /// The gateway; never leased.
        #[arg(long)]
        gateway: String,
        /// The first address to lease (default: the address after the gateway).
        #[arg(long)]
        first_host: Option<String>,
        /// The last address to lease (default: the address before the broadcast address).
        #[arg(long)]
        last_host: Option<String>,
        /// DNS servers for the guests, comma-separated IPv4/IPv6 addresses.
        #[arg(long, value_delimiter = ',')]
        dns: Vec<String>,
    },
    /// Create a pool without a range (its instances are placed without an address).
    Create {
        /// The pool id.
        pool: String,
    },
    /// Show a pool's range and lease count.
    Show {
        /// The pool id.
        pool: String,
    },
    /// List every pool.
    List,
}

/// `vmnet host …`
#[derive(Debug, Subcommand)]
pub enum HostCmd {
    /// Add a host with its capacity.
    Add {
        /// The host id.
        host: String,
        /// vCPUs the host offers.
        #[arg(long)]
        vcpus: u32,
        /// Memory the host offers, MiB.
        #[arg(long)]
        memory_mib: u32,
    },
    /// Mark a host lost: its instances return their leases and claims; those with
    /// --recreate-on-host-loss are placed elsewhere with a new lease (or move to error).
    Lose {
        /// The host id.
        host: String,
    },
    /// List every host with its claims.
    List,
}

/// `vmnet instance …`
#[derive(Debug, Subcommand)]
pub enum InstanceCmd {
    /// Create an instance: claim capacity on a host and take the lowest free address, in one
    /// transaction.
    Create {
        /// The instance id.
        id: String,
        /// The hosted pool.
        #[arg(long)]
        pool: String,
        /// Place on this host (default: the first ready host by id with room).
        #[arg(long)]
        host: Option<String>,
        /// Requested vCPUs.
        #[arg(long, default_value_t = vmnet_model::pool::DEFAULT_VCPUS)]
        vcpus: u32,
        /// Requested memory, MiB.
        #[arg(long, default_value_t = vmnet_model::pool::DEFAULT_MEMORY_MIB)]
        memory_mib: u32,
        /// Place it again on another host after a host loss.
        #[arg(long)]
        recreate_on_host_loss: bool,
        /// What traffic it may exchange: public, private (private address space only) or none.
        /// Anything else is refused with INVALID_INPUT naming network_policy.
        #[arg(long, default_value = "public", value_name = "public|private|none")]
        network_policy: String,
        /// Accept SSH (tcp/22) only from the host's own addresses.
        #[arg(long)]
        sandbox: bool,
    },
    /// Delete an instance, returning its lease and claim.
    Delete {
        /// The instance id.
        id: String,
    },
    /// Show an instance.
    Show {
        /// The instance id.
        id: String,
    },
    /// List every instance.
    List,
}

/// `vmnet lease …`
#[derive(Debug, Subcommand)]
pub enum LeaseCmd {
    /// List a pool's leases in address order.
    List {
        /// The pool id.
        pool: String,
    },
}

async fn open(g: &Global) -> Result<(Db, Tx), Error> {
    let db = Db::connect(&g.database_url()).await?;
    let tx = db.begin().await?;
    Ok((db, tx))
}

async fn finish<T: Serialize>(
    db: Db,
    tx: Tx,
    g: &Global,
    value: &T,
    table: impl FnOnce(&T) -> String,
) -> Result<(), Error> {
    tx.commit().await?;
    db.close().await;
    match g.output {
        Output::Json => {
            let s =
                serde_json::to_string_pretty(value).map_err(|e| Error::internal(e.to_string()))?;
            println!("{s}");
        }
        Output::Table => print!("{}", table(value)),
    }
    Ok(())
}

/// Renders rows as left-aligned columns separated by two spaces.
fn render(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    let mut out = String::new();
    let mut line = |cells: Vec<&str>| {
        let mut l = String::new();
        for (i, (c, w)) in cells.iter().zip(&widths).enumerate() {
            if i + 1 == cells.len() {
                l.push_str(c);
            } else {
                let _ = write!(l, "{c:<w$}  ");
            }
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(header.to_vec());
    for r in rows {
        line(r.iter().map(String::as_str).collect());
    }
    out
}

fn opt<T: ToString>(v: Option<&T>) -> String {
    v.map_or_else(|| "-".to_owned(), ToString::to_string)
}

fn range_row(pool_id: &str, r: Option<&IpRange>, leases: Option<u64>) -> Vec<String> {
    let mut row = vec![pool_id.to_owned()];
    match r {
        Some(r) => row.extend([
            r.cidr.to_string(),
            r.gateway.to_string(),
            r.first_host.to_string(),
            r.last_host.to_string(),
            if r.dns.is_empty() {
                "-".into()
            } else {
                r.dns
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            },
        ]),
        None => row.extend(["(no range)", "-", "-", "-", "-"].map(String::from)),
    }
    if let Some(n) = leases {
        row.push(n.to_string());
    }
    row
}

const RANGE_HEADER: [&str; 6] = ["POOL", "CIDR", "GATEWAY", "FIRST", "LAST", "DNS"];
const POOL_HEADER: [&str; 7] = ["POOL", "CIDR", "GATEWAY", "FIRST", "LAST", "DNS", "LEASES"];

fn pools_table(pools: &[Pool]) -> String {
    let rows: Vec<_> = pools
        .iter()
        .map(|p| range_row(&p.pool_id, p.range.as_ref(), Some(p.leases)))
        .collect();
    render(&POOL_HEADER, &rows)
}

fn hosts_table(hosts: &[Host]) -> String {
    let rows: Vec<_> = hosts
        .iter()
        .map(|h| {
            vec![
                h.host_id.clone(),
                format!("{:?}", h.state).to_lowercase(),
                format!("{}/{}", h.used_vcpus, h.vcpus),
                format!("{}/{}", h.used_memory_mib, h.memory_mib),
            ]
        })
        .collect();
    render(
        &["HOST", "STATE", "VCPUS USED/TOTAL", "MEMORY MIB USED/TOTAL"],
        &rows,
    )
}

fn instances_table(instances: &[Instance]) -> String {
    let rows: Vec<_> = instances
        .iter()
        .map(|i| {
            let conditions: Vec<String> = i
                .conditions
                .iter()
                .map(|c| format!("{}: {}", c.kind, c.message))
                .collect();
            vec![
                i.instance_id.clone(),
                i.pool_id.clone(),
                opt(i.host_id.as_ref()),
                i.state.to_string(),
                opt(i.address.as_ref()),
                i.vcpus.to_string(),
                i.memory_mib.to_string(),
                i.recreate_on_host_loss.to_string(),
                i.network_policy.to_string(),
                i.sandbox.to_string(),
                if i.allocation_id.is_empty() {
                    "-".into()
                } else {
                    i.allocation_id.clone()
                },
                if conditions.is_empty() {
                    "-".into()
                } else {
                    conditions.join("; ")
                },
            ]
        })
        .collect();
    render(
        &[
            "INSTANCE",
            "POOL",
            "HOST",
            "STATE",
            "ADDRESS",
            "VCPUS",
            "MEMORY_MIB",
            "RECREATE",
            "POLICY",
            "SANDBOX",
            "ALLOCATION",
            "CONDITIONS",
        ],
        &rows,
    )
}

fn leases_table(leases: &[Lease]) -> String {
    let rows: Vec<_> = leases
        .iter()
        .map(|l| vec![l.address.to_string(), l.instance_id.clone()])
        .collect();
    render(&["ADDRESS", "INSTANCE"], &rows)
}

/// Runs `vmnet pool …`.
///
/// # Errors
/// The store's errors (`INVALID_INPUT`, `NOT_FOUND`, `UNAVAILABLE`).
pub async fn pool(g: &Global, c: PoolCmd) -> Result<(), Error> {
    let (db, mut tx) = open(g).await?;
    match c {
        PoolCmd::Set {
            pool,
            cidr,
            gateway,
            first_host,
            last_host,
            dns,
        } => {
            let req = SetIpPool {
                pool_id: pool,
                cidr,
                gateway,
                first_host,
                last_host,
                dns,
            };
            let r = vmnet_ipam::set_ip_pool(&mut tx, req).await?;
            finish(db, tx, g, &r, |r| {
                render(&RANGE_HEADER, &[range_row(&r.pool_id, Some(r), None)])
            })
            .await
        }
        PoolCmd::Create { pool } => {
            vmnet_ipam::create_pool(&mut tx, &pool).await?;
            let p = vmnet_ipam::get_pool(&mut tx, &pool).await?;
            finish(db, tx, g, &p, |p| pools_table(std::slice::from_ref(p))).await
        }
        PoolCmd::Show { pool } => {
            let p = vmnet_ipam::get_pool(&mut tx, &pool).await?;
            finish(db, tx, g, &p, |p| pools_table(std::slice::from_ref(p))).await
        }
        PoolCmd::List => {
            let pools = vmnet_ipam::list_pools(&mut tx).await?;
            finish(db, tx, g, &pools, |p| pools_table(p)).await
        }
    }
}

/// Runs `vmnet host …`.
///
/// # Errors
/// The store's errors (`INVALID_INPUT`, `NOT_FOUND`, `CONFLICT`, `UNAVAILABLE`).
pub async fn host(g: &Global, c: HostCmd) -> Result<(), Error> {
    let (db, mut tx) = open(g).await?;
    match c {
        HostCmd::Add {
            host,
            vcpus,
            memory_mib,
        } => {
            let h = vmnet_ipam::add_host(&mut tx, &host, vcpus, memory_mib).await?;
            finish(db, tx, g, &h, |h| hosts_table(std::slice::from_ref(h))).await
        }
        HostCmd::Lose { host } => {
            let loss = vmnet_ipam::lose_host(&mut tx, &host).await?;
            finish(db, tx, g, &loss, |l| instances_table(&l.instances)).await
        }
        HostCmd::List => {
            let hosts = vmnet_ipam::list_hosts(&mut tx).await?;
            finish(db, tx, g, &hosts, |h| hosts_table(h)).await
        }
    }
}

/// Runs `vmnet instance …`.
///
/// # Errors
/// The store's errors (`INVALID_INPUT`, `NOT_FOUND`, `CONFLICT`, `CAPACITY_UNAVAILABLE`,
/// `UNAVAILABLE`).
pub async fn instance(g: &Global, c: InstanceCmd) -> Result<(), Error> {
    let (db, mut tx) = open(g).await?;
    match c {
        InstanceCmd::Create {
            id,
            pool,
            host,
            vcpus,
            memory_mib,
            recreate_on_host_loss,
            network_policy,
            sandbox,
        } => {
            let req = NewInstance {
                instance_id: id,
                pool_id: pool,
                host_id: host,
                vcpus,
                memory_mib,
                recreate_on_host_loss,
                network_policy: network_policy.parse()?,
                sandbox,
            };
            let i = vmnet_ipam::create_instance(&mut tx, &req).await?;
            finish(db, tx, g, &i, |i| instances_table(std::slice::from_ref(i))).await
        }
        InstanceCmd::Delete { id } => {
            let i = vmnet_ipam::delete_instance(&mut tx, &id).await?;
            let d = Deleted::of(i);
            finish(db, tx, g, &d, Deleted::line).await
        }
        InstanceCmd::Show { id } => {
            let i = vmnet_ipam::get_instance(&mut tx, &id).await?;
            finish(db, tx, g, &i, |i| instances_table(std::slice::from_ref(i))).await
        }
        InstanceCmd::List => {
            let all = vmnet_ipam::list_instances(&mut tx).await?;
            finish(db, tx, g, &all, |i| instances_table(i)).await
        }
    }
}

/// The output of `instance delete`: JSON
/// `{"deleted": true, "instance_id": …, "released": {pool_id, address, instance_id} | null,
/// "instance": {… as it was}}`, or one line in table mode.
#[derive(Debug, Serialize)]
struct Deleted {
    deleted: bool,
    instance_id: String,
    released: Option<Lease>,
    instance: Instance,
}

impl Deleted {
    fn of(i: Instance) -> Self {
        Self {
            deleted: true,
            instance_id: i.instance_id.clone(),
            released: i.address.map(|address| Lease {
                pool_id: i.pool_id.clone(),
                address,
                instance_id: i.instance_id.clone(),
            }),
            instance: i,
        }
    }

    /// `deleted instance vm3 (released 10.0.0.4)` or `deleted instance vm3 (it held no lease)`.
    fn line(&self) -> String {
        match &self.released {
            Some(l) => format!(
                "deleted instance {} (released {})\n",
                self.instance_id, l.address
            ),
            None => format!("deleted instance {} (it held no lease)\n", self.instance_id),
        }
    }
}

/// Runs `vmnet lease …`.
///
/// # Errors
/// The store's errors (`INVALID_INPUT`, `NOT_FOUND`, `UNAVAILABLE`).
pub async fn lease(g: &Global, c: LeaseCmd) -> Result<(), Error> {
    let (db, mut tx) = open(g).await?;
    match c {
        LeaseCmd::List { pool } => {
            let leases = vmnet_ipam::list_leases(&mut tx, &pool).await?;
            finish(db, tx, g, &leases, |l| leases_table(l)).await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Deleted, render};
    use vmnet_ipam::{Instance, InstanceState};

    #[test]
    fn table_columns_align() {
        let t = render(&["A", "BB"], &[vec!["xyz".into(), "1".into()]]);
        assert_eq!(t, "A    BB\nxyz  1\n");
    }

    #[test]
    fn delete_says_what_was_released() {
        let mut i = Instance {
            instance_id: "vm3".into(),
            pool_id: "p1".into(),
            host_id: Some("h1".into()),
            vcpus: 1,
            memory_mib: 512,
            recreate_on_host_loss: false,
            state: InstanceState::Running,
            conditions: vec![],
            address: Some("10.0.0.4".parse().unwrap()),
            network_policy: vmnet_ipam::NetworkPolicy::Private,
            sandbox: true,
            allocation_id: "alloc-1-vm3".into(),
        };
        let d = Deleted::of(i.clone());
        assert_eq!(d.line(), "deleted instance vm3 (released 10.0.0.4)\n");
        let v = serde_json::to_value(&d).unwrap();
        assert_eq!(v["deleted"], true);
        assert_eq!(v["instance"]["network_policy"], "private");
        assert_eq!(v["instance"]["sandbox"], true);
        assert_eq!(v["instance"]["allocation_id"], "alloc-1-vm3");
        assert_eq!(
            v["released"],
            serde_json::json!({"pool_id": "p1", "address": "10.0.0.4", "instance_id": "vm3"})
        );
        i.address = None;
        let d = Deleted::of(i);
        assert_eq!(d.line(), "deleted instance vm3 (it held no lease)\n");
        assert_eq!(
            serde_json::to_value(&d).unwrap()["released"],
            serde_json::Value::Null
        );
    }
}
