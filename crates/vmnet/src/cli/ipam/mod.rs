//! `vmnet pool|host|instance|lease …`: IPAM commands against the store (spec:
//! hosted-pool-networking.md, "Give a hosted pool a range", "How leases work", "Addresses on an
//! instance": `host report` and the ADDRESSES column).
//!
//! Each command opens the database (`--database-url`, `VMNET_DATABASE_URL`, or the SQLite file
//! `<state-dir>/vmnet.db`, created with its directory if missing), runs in one transaction and
//! commits. Output is a human table, or JSON with `--output json`. Errors ([`IpamError`]) are
//! returned to `main`, the CLI's edge, which maps them to their documented code once, prints
//! `error: CODE: message` and exits with the code's documented status.

use clap::Subcommand;
use serde::Serialize;
use vmnet_agent::table::render;
use vmnet_ipam::{
    AddRange, Credentials, Db, Instance, IpamError, Lease, Machine, NewInstance, ReportedInstance,
    SetIpPool, SetProviderPool, StatusReport, Store, Tx,
};
use vmnet_model::ValidationError;

use crate::{Global, Output};

pub use self::range_cmd::RangeCmd;

/// `vmnet pool …`
#[derive(Debug, Clone, Subcommand)]
pub enum PoolCmd {
    /// Set (or replace) a hosted pool's IPv4 range (`--cidr`, `--gateway`, …) or make the pool
    /// a provider pool (`--provider`, `--credentials-file|--credentials-env`, …); creates the
    /// pool if needed. Existing leases stay. A range overlapping another pool's is refused
    /// (CONFLICT), and so are a range on a provider pool and a provider on a pool with a range.
    Set(Box<PoolSetArgs>),
    /// Add, remove or list a pool's ranges: IPv4 ranges after the first (which `pool set`
    /// sets) and IPv6 ranges. An instance leases one address per family, from the first range
    /// of that family with room.
    #[command(subcommand)]
    Range(RangeCmd),
    /// Create a pool without a range (its instances are placed without an address).
    Create {
        /// The pool id.
        pool: String,
    },
    /// Show a pool's ranges and lease counts (IPv4 and IPv6).
    Show {
        /// The pool id.
        pool: String,
    },
    /// List every pool.
    List,
}

/// The arguments of `vmnet pool set`.
#[derive(Debug, Clone, clap::Args)]
pub struct PoolSetArgs {
    /// The pool id.
    pool: String,
    /// The IPv4 network, e.g. 10.0.0.0/24; prefix /16 to /32, not in 0/8, 127/8,
    /// 169.254/16, 224/4 or 240/4.
    #[arg(
        long,
        required_unless_present = "provider",
        conflicts_with = "provider"
    )]
    cidr: Option<String>,
    /// The gateway; never leased.
    #[arg(
        long,
        required_unless_present = "provider",
        conflicts_with = "provider"
    )]
    gateway: Option<String>,
    /// The first address to lease (default: the address after the gateway).
    #[arg(long)]
    first_host: Option<String>,
    /// The last address to lease (default: the address before the broadcast address).
    #[arg(long)]
    last_host: Option<String>,
    /// DNS servers for the guests, comma-separated IPv4/IPv6 unicast addresses (at most 8,
    /// each once).
    #[arg(long, value_delimiter = ',')]
    dns: Vec<String>,
    /// Make it a provider pool of `hetzner-cloud` or `proxmox-ve` (it leases nothing; its
    /// instances are machines whose addresses the agent polls).
    #[arg(long, value_name = "hetzner-cloud|proxmox-ve", conflicts_with_all = ["first_host", "last_host", "dns"])]
    provider: Option<String>,
    /// The provider's API base URL (default for hetzner-cloud: https://api.hetzner.cloud/v1;
    /// required for proxmox-ve, e.g. https://pve1.example.com:8006/api2/json).
    #[arg(long, requires = "provider")]
    api_url: Option<String>,
    /// A file the agent reads the API token from at every poll (never stored).
    #[arg(
        long,
        value_name = "PATH",
        requires = "provider",
        conflicts_with = "credentials_env"
    )]
    credentials_file: Option<String>,
    /// An environment variable of the agent holding the API token (never stored).
    #[arg(long, value_name = "NAME", requires = "provider")]
    credentials_env: Option<String>,
    /// Seconds between polls, 5 to 86400 (default 30).
    #[arg(long, requires = "provider")]
    poll_interval_secs: Option<u32>,
}

/// `vmnet host …`
#[derive(Debug, Clone, Subcommand)]
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
    /// Apply a host status report (spec: "Addresses on an instance", hosted pools): append the
    /// addresses the host sees on its instances to their `addresses`, after the lease, in
    /// arrival order. Reports only add: nothing is removed or reordered, and what an instance
    /// already lists is not repeated. Entries for unknown instances or instances placed on
    /// another host are skipped and listed; the rest is applied. A malformed address is
    /// INVALID_INPUT and nothing is written.
    ///
    /// Either one instance: `vmnet host report h1 --instance vm1 --address 10.0.0.2/29
    /// --address 2001:db8::5/64`, or a whole report with `--file report.json` (`-` reads
    /// stdin): `{"instances": [{"instance_id": "vm1", "addresses": ["10.0.0.2/29"]}]}`.
    Report {
        /// The reporting host.
        host: String,
        /// The instance the addresses belong to; needs at least one `--address` (a report
        /// with none would change nothing).
        #[arg(
            long,
            required_unless_present = "file",
            conflicts_with = "file",
            requires = "addresses"
        )]
        instance: Option<String>,
        /// An address in CIDR form (address and prefix length, host bits kept), IPv4 or IPv6;
        /// repeat for more.
        #[arg(
            long = "address",
            value_name = "CIDR",
            requires = "instance",
            conflicts_with = "file"
        )]
        addresses: Vec<String>,
        /// A JSON status report (`{"instances": [{"instance_id": …, "addresses": […]}]}`;
        /// unknown fields are refused); `-` reads stdin.
        #[arg(long, value_name = "PATH")]
        file: Option<std::path::PathBuf>,
    },
}

/// `vmnet instance …`
#[derive(Debug, Clone, Subcommand)]
pub enum InstanceCmd {
    /// Create an instance: claim capacity on a host and take the lowest free address, in one
    /// transaction. In a provider pool the instance is a machine (`--server-id`, or `--node`
    /// with `--vmid`): no host, no claim, no lease.
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
        /// The machine of an instance of a hetzner-cloud pool: its server id.
        #[arg(long, conflicts_with_all = ["node", "vmid", "host"])]
        server_id: Option<u64>,
        /// The machine of an instance of a proxmox-ve pool: its node (with --vmid).
        #[arg(long, requires = "vmid", conflicts_with = "host")]
        node: Option<String>,
        /// The machine of an instance of a proxmox-ve pool: its vmid (with --node).
        #[arg(long, requires = "node")]
        vmid: Option<u32>,
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
#[derive(Debug, Clone, Subcommand)]
pub enum LeaseCmd {
    /// List a pool's leases: IPv4 in address order, then IPv6 in address order.
    List {
        /// The pool id.
        pool: String,
    },
}

async fn open(g: &Global) -> Result<(Db, Tx), IpamError> {
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
) -> Result<(), IpamError> {
    tx.commit().await?;
    db.close().await;
    match g.output {
        Output::Json => {
            let s = serde_json::to_string_pretty(value).map_err(|source| IpamError::Json {
                what: "output".into(),
                source,
            })?;
            println!("{s}");
        }
        Output::Table => print!("{}", table(value)),
    }
    Ok(())
}

mod range_cmd;
mod tables;
#[cfg(test)]
mod tests;

use self::tables::{
    RANGE_HEADER, hosts_table, instances_table, leases_table, pools_table, range_row, ranges_table,
    report_table,
};

/// Runs `vmnet pool …`.
///
/// # Errors
/// The store's errors (`INVALID_INPUT`, `NOT_FOUND`, `UNAVAILABLE`).
pub async fn pool(g: &Global, c: PoolCmd) -> Result<(), IpamError> {
    let (db, mut tx) = open(g).await?;
    match c {
        PoolCmd::Set(args) => {
            let PoolSetArgs {
                pool,
                cidr,
                gateway,
                first_host,
                last_host,
                dns,
                provider,
                api_url,
                credentials_file,
                credentials_env,
                poll_interval_secs,
            } = *args;
            if let Some(provider) = provider {
                let credentials = match (credentials_file, credentials_env) {
                    (Some(f), _) => Credentials::File(f),
                    (None, Some(e)) => Credentials::Env(e),
                    (None, None) => {
                        return Err(IpamError::invalid(format!(
                            "pool {pool}: --provider needs --credentials-file PATH or --credentials-env NAME"
                        )));
                    }
                };
                let req = SetProviderPool {
                    pool_id: pool,
                    provider,
                    api_url,
                    credentials,
                    poll_interval_secs,
                };
                vmnet_ipam::set_provider_pool(&mut tx, &req).await?;
                let p = vmnet_ipam::get_pool(&mut tx, &req.pool_id).await?;
                return finish(db, tx, g, &p, |p| pools_table(std::slice::from_ref(p))).await;
            }
            let req = SetIpPool {
                pool_id: pool,
                cidr: cidr.unwrap_or_default(),
                gateway: gateway.unwrap_or_default(),
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
        PoolCmd::Range(RangeCmd::Add {
            pool,
            cidr,
            gateway,
            first_host,
            last_host,
        }) => {
            let req = AddRange {
                pool_id: pool,
                cidr,
                gateway,
                first_host,
                last_host,
            };
            let r = vmnet_ipam::add_range(&mut tx, &req).await?;
            finish(db, tx, g, &r, |r| ranges_table(std::slice::from_ref(r))).await
        }
        PoolCmd::Range(RangeCmd::Remove { pool, cidr }) => {
            let r = vmnet_ipam::remove_range(&mut tx, &pool, &cidr).await?;
            finish(db, tx, g, &r, |r| {
                format!("removed range {} of pool {}\n", r.cidr, r.pool_id)
            })
            .await
        }
        PoolCmd::Range(RangeCmd::List { pool }) => {
            let list = vmnet_ipam::list_ranges(&mut tx, &pool).await?;
            finish(db, tx, g, &list, |l| ranges_table(l)).await
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
pub async fn host(g: &Global, c: HostCmd) -> Result<(), IpamError> {
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
        HostCmd::Report {
            host,
            instance,
            addresses,
            file,
        } => {
            let report = match (instance, file) {
                (Some(instance_id), _) => StatusReport {
                    instances: vec![ReportedInstance {
                        instance_id,
                        addresses,
                    }],
                },
                (None, Some(path)) => read_report(&path)?,
                (None, None) => {
                    return Err(IpamError::invalid(
                        "status report: give --instance with --address, or --file",
                    ));
                }
            };
            let out = vmnet_ipam::report_host_status(&mut tx, &host, &report).await?;
            finish(db, tx, g, &out, report_table).await
        }
    }
}

/// Reads a JSON [`StatusReport`] from `path` (`-`: stdin).
///
/// # Errors
/// `INVALID_INPUT` naming the file when it cannot be read or is not a status report.
fn read_report(path: &std::path::Path) -> Result<StatusReport, IpamError> {
    let text = if path.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin())
    } else {
        std::fs::read_to_string(path)
    }
    .map_err(|e| IpamError::invalid(format!("status report {}: {e}", path.display())))?;
    parse_report(&text).map_err(|e| {
        IpamError::invalid(format!(
            "status report {}: {}",
            path.display(),
            e.message().trim_start_matches("status report: ")
        ))
    })
}

/// Parses a JSON [`StatusReport`] strictly (unknown fields refused).
///
/// # Errors
/// `INVALID_INPUT` `status report: <serde error>`.
fn parse_report(text: &str) -> Result<StatusReport, ValidationError> {
    serde_json::from_str(text).map_err(|source| ValidationError::Json {
        what: "status report".into(),
        source,
    })
}

/// Runs `vmnet instance …`.
///
/// # Errors
/// The store's errors (`INVALID_INPUT`, `NOT_FOUND`, `CONFLICT`, `CAPACITY_UNAVAILABLE`,
/// `UNAVAILABLE`).
pub async fn instance(g: &Global, c: InstanceCmd) -> Result<(), IpamError> {
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
            server_id,
            node,
            vmid,
        } => {
            let machine = (server_id.is_some() || node.is_some()).then_some(Machine {
                server_id,
                node,
                vmid,
            });
            let req = NewInstance {
                instance_id: id,
                pool_id: pool,
                host_id: host,
                vcpus,
                memory_mib,
                recreate_on_host_loss,
                network_policy: network_policy.parse()?,
                sandbox,
                machine,
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
/// "released_ipv6": {…} | null, "instance": {… as it was}}`, or one line in table mode.
#[derive(Debug, Serialize)]
struct Deleted {
    deleted: bool,
    instance_id: String,
    /// The IPv4 lease returned.
    released: Option<Lease>,
    /// The IPv6 lease returned.
    released_ipv6: Option<Lease>,
    instance: Instance,
}

impl Deleted {
    fn of(i: Instance) -> Self {
        Self {
            deleted: true,
            instance_id: i.instance_id.clone(),
            released: i.address.map(|address| Lease {
                pool_id: i.pool_id.clone(),
                address: std::net::IpAddr::V4(address),
                instance_id: i.instance_id.clone(),
            }),
            released_ipv6: i.address6.map(|address| Lease {
                pool_id: i.pool_id.clone(),
                address: std::net::IpAddr::V6(address),
                instance_id: i.instance_id.clone(),
            }),
            instance: i,
        }
    }

    /// `deleted instance vm3 (released 10.0.0.4)`, `… (released 10.0.0.4 and 2001:db8::4)` or
    /// `deleted instance vm3 (it held no lease)`.
    fn line(&self) -> String {
        let released: Vec<String> = [&self.released, &self.released_ipv6]
            .into_iter()
            .flatten()
            .map(|l| l.address.to_string())
            .collect();
        if released.is_empty() {
            format!("deleted instance {} (it held no lease)\n", self.instance_id)
        } else {
            format!(
                "deleted instance {} (released {})\n",
                self.instance_id,
                released.join(" and ")
            )
        }
    }
}

/// Runs `vmnet lease …`.
///
/// # Errors
/// The store's errors (`INVALID_INPUT`, `NOT_FOUND`, `UNAVAILABLE`).
pub async fn lease(g: &Global, c: LeaseCmd) -> Result<(), IpamError> {
    let (db, mut tx) = open(g).await?;
    match c {
        LeaseCmd::List { pool } => {
            let leases = vmnet_ipam::list_leases(&mut tx, &pool).await?;
            finish(db, tx, g, &leases, |l| leases_table(l)).await
        }
    }
}
