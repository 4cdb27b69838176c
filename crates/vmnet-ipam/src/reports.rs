//! Host status reports and `Instance.addresses` (spec: hosted-pool-networking.md, "Addresses on
//! an instance", hosted pools).
//!
//! * `Instance.addresses` is the IPv4 lease, then the IPv6 lease (CIDR form: the address with
//!   the prefix length of the pool's range that contains it, or `/32`, `/128` when none does;
//!   [`crate::lease_net`]), then the addresses host status reports added, in
//!   arrival order, each once.
//! * [`report_host_status`] appends, for each reported instance placed on the reporting host, the
//!   reported addresses not yet in its list. Reports only add: nothing is removed or reordered,
//!   and an address equal to the lease (same address and prefix length) is not stored again.
//!   Entries for unknown instances or instances not placed on the reporting host are skipped and
//!   listed in the outcome; the rest of the report is applied.
//! * The whole report is validated before anything is written: a malformed report changes
//!   nothing.
//! * Reported addresses are stored in `instance_addresses` (migration 0103). They go with the
//!   instance when it is deleted (`ON DELETE CASCADE`) and are cleared when a host loss takes the
//!   instance off its host ([`crate::lose_host`]): they came from the old machine, and the
//!   instance's next host reports its own. Whether the instance is re-placed or not, it starts
//!   again from its (new) lease. Returning a lease by itself ([`crate::release`]) keeps them.
//!
//! # Limitations
//! * Reports only add: an address the guest dropped stays listed until the instance is deleted or
//!   its host is lost. Each report carries at most 64 addresses per instance, but the stored list
//!   has no bound.
//! * Address equality is exact: `10.0.0.2/24` is a different entry from a `10.0.0.2/29` lease.

use crate::error::IpamError;
use ipnet::IpNet;
use vmnet_model::ids::validate_id;
use vmnet_model::pool::{
    SkipReason, SkippedInstance, StatusReport, StatusReportOutcome, UpdatedInstance,
};

use crate::addresses::insert_reported;
use crate::db::{Tx, atomically, db_err, on_tx};
use crate::locks::share_instances;
use crate::placement::{get_host, get_instance};
use crate::stored::parse_stored;

/// Applies a host status report (spec: "Addresses on an instance", hosted pools): for each
/// reported instance placed on `host_id`, appends the reported addresses it does not list yet,
/// in report order. Entries for unknown instances and for instances not placed on `host_id` are
/// skipped and listed in the outcome. On PostgreSQL every reported instance's row is
/// share-locked (in id order, see [`crate::locks`]) for the rest of the transaction, so a
/// concurrent host loss cannot move it between the check and the append.
///
/// # Errors
/// `INVALID_INPUT` for a bad host id or a malformed report (see [`StatusReport::validate`]; then
/// nothing is written); `NOT_FOUND` for an unknown host; `UNAVAILABLE` on a database failure
/// (then nothing was changed).
pub async fn report_host_status(
    tx: &mut Tx,
    host_id: &str,
    report: &StatusReport,
) -> Result<StatusReportOutcome, IpamError> {
    validate_id("host_id", host_id)?;
    let parsed = report.validate()?;
    atomically!(tx, "vmnet_report", report_inner(tx, host_id, parsed).await)
}

async fn report_inner(
    tx: &mut Tx,
    host_id: &str,
    parsed: Vec<(String, Vec<IpNet>)>,
) -> Result<StatusReportOutcome, IpamError> {
    get_host(tx, host_id).await?;
    // Lock order (crate::locks): every reported instance in id order, before looking at any.
    let ids: Vec<&str> = parsed.iter().map(|(id, _)| id.as_str()).collect();
    share_instances(tx, &ids).await?;
    let mut out = StatusReportOutcome {
        host_id: host_id.to_owned(),
        updated: Vec::new(),
        skipped: Vec::new(),
    };
    for (instance_id, nets) in parsed {
        let placed_on = match placement_of(tx, &instance_id).await? {
            None => {
                out.skipped.push(SkippedInstance {
                    message: format!("instance {instance_id} not found"),
                    instance_id,
                    reason: SkipReason::UnknownInstance,
                });
                continue;
            }
            Some(h) => h,
        };
        if placed_on.as_deref() != Some(host_id) {
            let message = match placed_on {
                Some(other) => {
                    format!("instance {instance_id} is placed on host {other}, not {host_id}")
                }
                None => format!("instance {instance_id} is not placed on any host"),
            };
            out.skipped.push(SkippedInstance {
                instance_id,
                reason: SkipReason::NotOnHost,
                message,
            });
            continue;
        }
        let inst = get_instance(tx, &instance_id).await?;
        let mut current: Vec<IpNet> = inst
            .addresses
            .iter()
            .map(|a| parse_stored("address", a))
            .collect::<Result<_, _>>()?;
        let mut added = Vec::new();
        for net in nets {
            if current.contains(&net) {
                continue;
            }
            if insert_reported(tx, &instance_id, net).await? {
                added.push(net.to_string());
            }
            current.push(net);
        }
        out.updated.push(UpdatedInstance {
            instance_id,
            added,
            addresses: current.iter().map(ToString::to_string).collect(),
        });
    }
    Ok(out)
}

/// `None` for an unknown instance, else the host it is placed on (`Some(None)`: none). On
/// PostgreSQL the row stays share-locked until the transaction ends.
async fn placement_of(tx: &mut Tx, instance_id: &str) -> Result<Option<Option<String>>, IpamError> {
    let sql = match tx {
        Tx::Sqlite(_) => "SELECT host_id FROM instances WHERE instance_id = $1",
        Tx::Postgres(_) => "SELECT host_id FROM instances WHERE instance_id = $1 FOR SHARE",
    };
    let row: Option<(Option<String>,)> = on_tx!(tx, t => sqlx::query_as(sql)
        .bind(instance_id)
        .fetch_optional(&mut **t)
        .await
        .map_err(db_err)?);
    Ok(row.map(|(h,)| h))
}
