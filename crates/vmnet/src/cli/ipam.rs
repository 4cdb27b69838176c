//! `vmnet pool|host|instance|lease …`: IPAM commands against the store (spec:
//! hosted-pool-networking.md, "Give a hosted pool a range", "How leases work", "Addresses on an
//! instance": `host report` and the ADDRESSES column).
//!
//! Each command opens the database (`--database-url`, `VMNET_DATABASE_URL`, or the SQLite file
//! `<state-dir>/vmnet.db`, created with its directory if missing), runs in one transaction and
//! commits. Output is a human table, or JSON with `--output json`. Errors are returned to `main`,
//! which prints `error: CODE: message` and exits with the code's documented status.

use std::fmt::Write as _;

use clap::Subcommand;
use serde::Serialize;
use vmnet_ipam::{
    Db, Host, Instance, IpRange, Lease, NewInstance, Pool, ReportedInstance, SetIpPool,
    StatusReport, StatusReportOutcome, Store, Tx,
};
use vmnet_model::Error;

use crate::{Global, Output};

/// `vmnet pool …`
#[derive(Debug, Clone, Subcommand)]
pub enum PoolCmd {
    /// Set (or replace) a pool's IPv4 range; creates the pool if needed. Existing leases stay.
    /// A range overlapping another pool's is refused (CONFLICT).
    Set {
        /// The pool id.
        pool: String,
        /// The IPv4 network, e.g. 10.0.0.0/24; prefix /16 to /32, not in 0/8, 127/8,
        /// 169.254/16, 224/4 or 240/4.
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
        /// DNS servers for the guests, comma-separated IPv4/IPv6 unicast addresses (at most 8,
        /// each once).
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
#[derive(Debug, Clone, Subcommand)]
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
                if i.addresses.is_empty() {
                    "-".into()
                } else {
                    i.addresses.join(",")
                },
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
            "ADDRESSES",
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
                    return Err(Error::invalid(
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
fn read_report(path: &std::path::Path) -> Result<StatusReport, Error> {
    let text = if path.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin())
    } else {
        std::fs::read_to_string(path)
    }
    .map_err(|e| Error::invalid(format!("status report {}: {e}", path.display())))?;
    parse_report(&text).map_err(|e| {
        Error::invalid(format!(
            "status report {}: {}",
            path.display(),
            e.message.trim_start_matches("status report: ")
        ))
    })
}

/// Parses a JSON [`StatusReport`] strictly (unknown fields refused).
///
/// # Errors
/// `INVALID_INPUT` `status report: <serde error>`.
fn parse_report(text: &str) -> Result<StatusReport, Error> {
    serde_json::from_str(text).map_err(|e| Error::invalid(format!("status report: {e}")))
}

/// The outcome of `host report`: one row per entry, applied ones first.
fn report_table(out: &StatusReportOutcome) -> String {
    let list = |v: &[String]| {
        if v.is_empty() {
            "-".to_owned()
        } else {
            v.join(",")
        }
    };
    let mut rows: Vec<Vec<String>> = out
        .updated
        .iter()
        .map(|u| {
            vec![
                u.instance_id.clone(),
                "updated".into(),
                list(&u.added),
                list(&u.addresses),
            ]
        })
        .collect();
    rows.extend(out.skipped.iter().map(|s| {
        let reason = serde_json::to_value(s.reason)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        vec![
            s.instance_id.clone(),
            format!("skipped ({reason})"),
            "-".into(),
            s.message.clone(),
        ]
    }));
    render(&["INSTANCE", "RESULT", "ADDED", "ADDRESSES / WHY"], &rows)
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
    use super::{Deleted, HostCmd, instances_table, parse_report, render, report_table};
    use clap::Parser;
    use vmnet_ipam::{
        Instance, InstanceState, SkipReason, SkippedInstance, StatusReportOutcome, UpdatedInstance,
    };

    #[derive(Debug, Parser)]
    struct HostCli {
        #[command(subcommand)]
        cmd: HostCmd,
    }

    fn parse_host(args: &[&str]) -> Result<HostCmd, clap::Error> {
        HostCli::try_parse_from(std::iter::once("host").chain(args.iter().copied())).map(|c| c.cmd)
    }

    #[test]
    fn host_report_takes_an_instance_with_addresses_or_a_file() {
        let c = parse_host(&[
            "report",
            "h1",
            "--instance",
            "vm1",
            "--address",
            "10.0.0.2/29",
            "--address",
            "2001:db8::5/64",
        ])
        .unwrap();
        let HostCmd::Report {
            host,
            instance,
            addresses,
            file,
        } = c
        else {
            panic!("{c:?}")
        };
        assert_eq!(host, "h1");
        assert_eq!(instance.as_deref(), Some("vm1"));
        assert_eq!(addresses, ["10.0.0.2/29", "2001:db8::5/64"]);
        assert!(file.is_none());
        let c = parse_host(&["report", "h1", "--file", "-"]).unwrap();
        assert!(matches!(c, HostCmd::Report { file: Some(f), .. } if f.as_os_str() == "-"));
        // Neither, both, addresses without an instance or an instance without addresses are
        // usage errors.
        for bad in [
            &["report", "h1"][..],
            &["report", "h1", "--instance", "vm1"],
            &["report", "h1", "--instance", "vm1", "--file", "r.json"],
            &[
                "report",
                "h1",
                "--address",
                "10.0.0.2/29",
                "--file",
                "r.json",
            ],
        ] {
            assert!(parse_host(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn report_files_are_parsed_strictly() {
        let r = parse_report(
            r#"{"instances": [{"instance_id": "vm1", "addresses": ["10.0.0.2/29"]}]}"#,
        )
        .unwrap();
        assert_eq!(r.instances[0].addresses, ["10.0.0.2/29"]);
        let e = parse_report(r#"{"instances": [], "extra": true}"#).unwrap_err();
        assert_eq!(e.code, vmnet_model::ErrorCode::InvalidInput);
        assert!(
            e.message
                .starts_with("status report: unknown field `extra`"),
            "{e}"
        );
    }

    #[test]
    fn report_outcome_table() {
        let out = StatusReportOutcome {
            host_id: "h1".into(),
            updated: vec![UpdatedInstance {
                instance_id: "vm1".into(),
                added: vec!["2001:db8::5/64".into()],
                addresses: vec!["10.0.0.2/29".into(), "2001:db8::5/64".into()],
            }],
            skipped: vec![SkippedInstance {
                instance_id: "vm2".into(),
                reason: SkipReason::NotOnHost,
                message: "instance vm2 is placed on host h2, not h1".into(),
            }],
        };
        assert_eq!(
            report_table(&out),
            "INSTANCE  RESULT                 ADDED           ADDRESSES / WHY\n\
             vm1       updated                2001:db8::5/64  10.0.0.2/29,2001:db8::5/64\n\
             vm2       skipped (not_on_host)  -               instance vm2 is placed on host h2, not h1\n"
        );
    }

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
            addresses: vec!["10.0.0.4/29".into(), "2001:db8::5/64".into()],
        };
        let table = instances_table(std::slice::from_ref(&i));
        let mut lines = table.lines();
        let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
        let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
        let col = header.iter().position(|h| *h == "ADDRESSES").unwrap();
        assert_eq!(row[col], "10.0.0.4/29,2001:db8::5/64");
        let d = Deleted::of(i.clone());
        assert_eq!(d.line(), "deleted instance vm3 (released 10.0.0.4)\n");
        let v = serde_json::to_value(&d).unwrap();
        assert_eq!(v["deleted"], true);
        assert_eq!(v["instance"]["network_policy"], "private");
        assert_eq!(v["instance"]["sandbox"], true);
        assert_eq!(v["instance"]["allocation_id"], "alloc-1-vm3");
        assert_eq!(
            v["instance"]["addresses"],
            serde_json::json!(["10.0.0.4/29", "2001:db8::5/64"])
        );
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
