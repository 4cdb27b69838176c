//! What the store wants on this host in pool mode, as pure data: the [`InstanceSpec`] of every
//! `running` instance placed here ([`spec_of`]), the gateways of their ranges, the tap entries
//! of the first table load, whether a new spec can replace a realised one in place, and which
//! links are instance taps and whose (see [`super::node`] for how a pass uses them).

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;
use vmnet_ipam::{Db, Store};
use vmnet_model::Error;
use vmnet_model::nic::{IfName, InstanceSpec};
use vmnet_model::pool::{Instance, InstanceState, IpRange, PoolRange};
use vmnet_plan::pool::nft::{TapEntry, tap_entries};
use vmnet_plan::pool::nic::instance_spec;

use crate::api::error::from_ipam;

/// The desired instances of `host_id` from the store: id → spec, the gateways of their
/// ranges, the ids that could not be planned (with the reason).
pub(super) async fn desired(
    db: &Db,
    host_id: &str,
    bridge: &IfName,
) -> Result<
    (
        BTreeMap<String, InstanceSpec>,
        Vec<IpAddr>,
        Vec<(String, Error)>,
    ),
    Error,
> {
    let mut tx = db.begin().await.map_err(from_ipam)?;
    let all = vmnet_ipam::list_instances(&mut tx)
        .await
        .map_err(from_ipam)?;
    // Per pool: its first IPv4 range and its IPv4 ranges in order (the first among them).
    let mut ranges: BTreeMap<String, (Option<IpRange>, Vec<PoolRange>)> = BTreeMap::new();
    let mut out = BTreeMap::new();
    let mut gateways = Vec::new();
    let mut failed = Vec::new();
    for inst in all
        .iter()
        .filter(|i| i.host_id.as_deref() == Some(host_id) && i.state == InstanceState::Running)
    {
        if !ranges.contains_key(&inst.pool_id) {
            let first = vmnet_ipam::get_ip_pool(&mut tx, &inst.pool_id)
                .await
                .map_err(from_ipam)?;
            let all = match first {
                Some(_) => vmnet_ipam::list_ranges(&mut tx, &inst.pool_id)
                    .await
                    .map_err(from_ipam)?,
                None => Vec::new(),
            };
            ranges.insert(inst.pool_id.clone(), (first, all));
        }
        let range = ranges
            .get(&inst.pool_id)
            .and_then(|(first, all)| lease_range(first.as_ref(), all, inst));
        match spec_of(inst, range.as_ref(), bridge) {
            Ok(spec) => {
                if let (Some(r), Some(_)) = (range, inst.address) {
                    let gw = IpAddr::V4(r.gateway);
                    if !gateways.contains(&gw) {
                        gateways.push(gw);
                    }
                }
                out.insert(inst.instance_id.clone(), spec);
            }
            Err(e) => failed.push((inst.instance_id.clone(), e)),
        }
    }
    let _ = tx.rollback().await;
    gateways.sort();
    Ok((out, gateways, failed))
}

/// The range the instance's IPv4 lease is in, as the NIC takes it (its prefix and gateway;
/// the nameservers are the first range's): the first range, or an IPv4 range added after it.
fn lease_range(first: Option<&IpRange>, all: &[PoolRange], inst: &Instance) -> Option<IpRange> {
    let first = first?;
    let Some(addr) = inst.address else {
        return Some(first.clone());
    };
    if first.cidr.contains(&addr) {
        return Some(first.clone());
    }
    all.iter()
        .find_map(|r| match (r.cidr, r.gateway, r.first_host, r.last_host) {
            (
                IpNet::V4(cidr),
                IpAddr::V4(gateway),
                IpAddr::V4(first_host),
                IpAddr::V4(last_host),
            ) if cidr.contains(&addr) => Some(IpRange {
                pool_id: first.pool_id.clone(),
                cidr,
                gateway,
                first_host,
                last_host,
                dns: first.dns.clone(),
            }),
            _ => None,
        })
}

/// The tap entries of every instance in `want`, sorted by tap name: the first load of the
/// tables. An instance that does not plan, or whose tap names another one already has, is left
/// out (the first pass reports it).
pub(super) fn first_taps(want: &BTreeMap<String, InstanceSpec>) -> Vec<TapEntry> {
    let mut taps: Vec<TapEntry> = Vec::new();
    for spec in want.values() {
        let Ok(entries) = tap_entries(spec) else {
            continue;
        };
        if entries.iter().any(|e| taps.iter().any(|t| t.tap == e.tap)) {
            continue;
        }
        taps.extend(entries);
    }
    taps.sort_by(|a, b| a.tap.cmp(&b.tap));
    taps
}

/// Whether `new` can replace `old` in place: the same tap names (the same NIC count) and each
/// NIC on the same bridge.
pub(super) fn same_taps(old: &InstanceSpec, new: &InstanceSpec) -> bool {
    matches!((old.tap_names(), new.tap_names()), (Ok(a), Ok(b)) if a == b)
        && old
            .nics
            .iter()
            .zip(&new.nics)
            .all(|(a, b)| a.network == b.network)
}

/// Length of [`tap_prefix`]: `bc`, 10 hex digits, `n`.
pub(super) const TAP_PREFIX_LEN: usize = 13;

/// The name every tap of instance `id` starts with, `bc<10 hex digits>n`.
pub(super) fn tap_prefix(id: &str) -> String {
    format!(
        "{}{}n",
        vmnet_model::nic::TAP_PREFIX,
        vmnet_model::nic::instance_hash10(id)
    )
}

/// Whether `name` has the exact shape of an instance tap, `bc<10 lower-case hex digits>n<1-2
/// digits>` ([`vmnet_model::nic::tap_name`]); only such links are ever collected as orphans, so
/// another link whose name merely starts with `bc` is left alone.
#[must_use]
pub fn is_instance_tap(name: &str) -> bool {
    let Some(rest) = name.strip_prefix(vmnet_model::nic::TAP_PREFIX) else {
        return false;
    };
    let (hash, nic) = rest.split_at(rest.len().min(10));
    hash.len() == 10
        && hash.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        && nic
            .strip_prefix('n')
            .is_some_and(|i| (1..=2).contains(&i.len()) && i.bytes().all(|b| b.is_ascii_digit()))
}

/// The [`InstanceSpec`] of a stored instance on bridge `bridge` (see the module docs).
///
/// # Errors
/// `INVALID_INPUT` naming the instance when its lease lies outside its range.
pub fn spec_of(
    inst: &Instance,
    range: Option<&IpRange>,
    bridge: &IfName,
) -> Result<InstanceSpec, Error> {
    let lease = inst.address.zip(range);
    instance_spec(
        &inst.instance_id,
        &inst.allocation_id,
        bridge,
        lease,
        inst.network_policy,
        inst.sandbox,
    )
    .map_err(Error::from)
}

#[cfg(test)]
mod tests;
