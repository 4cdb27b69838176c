//! What the store wants on this host in pool mode, as pure data: the [`InstanceSpec`] of every
//! `running` instance placed here ([`spec_of`]: its IPv4 and IPv6 leases with the ranges they
//! are in, [`NicRanges`]), the gateways of their ranges, the tap entries
//! of the first table load, whether a new spec can replace a realised one in place, and which
//! links are instance taps and whose (see [`super::node`] for how a pass uses them).

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;
use vmnet_ipam::{Db, Store, Tx};
use vmnet_model::Error;
use vmnet_model::nic::{IfName, InstanceSpec};
use vmnet_model::pool::{Family, Instance, InstanceState, IpRange, PoolRange};
use vmnet_plan::pool::nft::{TapEntry, tap_entries};
use vmnet_plan::pool::nic::{Leases, instance_spec};

use crate::api::error::from_ipam;

/// The desired instances of `host_id` from the store: id → spec, the gateways of their
/// ranges (IPv4 and IPv6), the ids that could not be planned (with the reason).
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
    let mut ranges: BTreeMap<String, NicRanges> = BTreeMap::new();
    let mut out = BTreeMap::new();
    let mut gateways = Vec::new();
    let mut failed = Vec::new();
    for inst in all
        .iter()
        .filter(|i| i.host_id.as_deref() == Some(host_id) && i.state == InstanceState::Running)
    {
        if !ranges.contains_key(&inst.pool_id) {
            let r = NicRanges::read(&mut tx, &inst.pool_id)
                .await
                .map_err(from_ipam)?;
            ranges.insert(inst.pool_id.clone(), r);
        }
        let pool_ranges = ranges.get(&inst.pool_id).cloned().unwrap_or_default();
        match spec_of(inst, &pool_ranges, bridge) {
            Ok(spec) => {
                for gw in spec.nics.iter().flat_map(|n| n.gateways()) {
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

/// A pool's ranges as its instances' NICs take them: the first IPv4 range (which carries the
/// pool's DNS servers) and every range in the pool's order, IPv4 and IPv6.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NicRanges {
    /// The first IPv4 range, if the pool has one.
    pub first: Option<IpRange>,
    /// Every range in order (the first IPv4 range among them).
    pub all: Vec<PoolRange>,
}

impl NicRanges {
    /// The ranges of `pool_id` from the store.
    ///
    /// # Errors
    /// As [`vmnet_ipam::list_ranges`] (`NOT_FOUND` for an unknown pool).
    pub async fn read(tx: &mut Tx, pool_id: &str) -> Result<Self, vmnet_ipam::IpamError> {
        let first = vmnet_ipam::get_ip_pool(tx, pool_id).await?;
        let all = vmnet_ipam::list_ranges(tx, pool_id).await?;
        Ok(Self { first, all })
    }

    /// The range the instance's IPv4 lease is in, as the NIC takes it (its prefix and gateway;
    /// the nameservers are the first range's): the first range, or an IPv4 range added after
    /// it. A lease in no range (the first range was replaced since) takes the first range: the
    /// NIC shows it as `/32` with the first range's gateway. `None` without a first range.
    fn lease_range(&self, inst: &Instance) -> Option<IpRange> {
        let first = self.first.as_ref()?;
        let Some(addr) = inst.address else {
            return Some(first.clone());
        };
        if first.cidr.contains(&addr) {
            return Some(first.clone());
        }
        let added =
            self.all
                .iter()
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
                });
        Some(added.unwrap_or_else(|| first.clone()))
    }

    /// The IPv6 range the instance's IPv6 lease is in (its prefix and gateway), or the pool's
    /// first IPv6 range when none contains it (the NIC then shows the lease as `/128`). `None`
    /// without an IPv6 lease or without IPv6 ranges.
    fn lease6_range(&self, inst: &Instance) -> Option<&PoolRange> {
        let addr = IpAddr::V6(inst.address6?);
        let mut v6 = self.all.iter().filter(|r| r.family == Family::Ipv6);
        v6.clone()
            .find(|r| r.cidr.contains(&addr))
            .or_else(|| v6.next())
    }
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

/// The [`InstanceSpec`] of a stored instance on bridge `bridge`, its pool's ranges `ranges`
/// (see the module docs): the IPv4 lease with the range it is in, the IPv6 lease with the IPv6
/// range it is in.
///
/// # Errors
/// `INVALID_INPUT` naming the instance when its NIC does not validate.
pub fn spec_of(
    inst: &Instance,
    ranges: &NicRanges,
    bridge: &IfName,
) -> Result<InstanceSpec, Error> {
    let v4 = ranges.lease_range(inst);
    let leases = Leases {
        v4: inst.address.zip(v4.as_ref()),
        v6: inst.address6.zip(ranges.lease6_range(inst)),
    };
    instance_spec(
        &inst.instance_id,
        &inst.allocation_id,
        bridge,
        leases,
        inst.network_policy,
        inst.sandbox,
    )
    .map_err(Error::from)
}

#[cfg(test)]
mod tests;
