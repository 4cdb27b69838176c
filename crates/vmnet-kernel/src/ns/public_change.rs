//! A VM's public IPv4 or mapped IPv6 changed alone ([`super::NsDriver::apply_public`]): only the
//! objects that derive from those addresses are written, each read from where it is cheapest.
//!
//! # Design
//! - The netns table keeps its shape whether or not the VM has a public IPv4 (every VM with NAT
//!   has its DNAT chain, see [`vmnet_plan::ns::nft::vm_ruleset`]), so the DNAT rule goes in as one
//!   rule batch ([`super::dnatbatch`]) when the table is known to be the plan's shape at the
//!   netns's current nf_tables generation (`gens`); otherwise the table is replaced whole.
//! - The host routes through the VM's host veth (the public IPv4's `/32` among them) are read
//!   from the driver's route cache and made as planned: a route's cost does not depend on the
//!   number of VMs.
//! - The VM's public elements in the host table are read by key and changed in one
//!   transaction ([`super::public::sync`]); then its proxy entries, then the conntrack entries
//!   of the addresses gained or lost are handed to the background task.
//! - Nothing else of the VM is read: the next reconcile pass observes everything.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use futures::future::try_join_all;
use vmnet_plan::ns::diff::{HaveRoutes, WantRoutes, route_ops};
use vmnet_plan::ns::{MAIN_TABLE, RouteKind, VmPlan, names};

use super::driver::NetlinkNsDriver;
use super::gens::RuleChange;
use super::routes::{self, KKind, KLink, KRoute};
use super::{Change, NsError, apply, public};
use crate::netns;

/// See [`super::NsDriver::apply_public`].
pub(super) async fn apply_public(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
) -> Result<Vec<Change>, NsError> {
    apply::check_prefix(d, plan)?;
    let Some(veth) = plan.veth.as_ref().filter(|_| netns::exists(&plan.netns)) else {
        return apply::apply(d, plan).await;
    };
    let Some(link) = routes::link_by_name(&d.host, &veth.host_name).await? else {
        return apply::apply(d, plan).await;
    };
    d.ensure_host().await?;
    let mut changes: Vec<Change> = dnat_rule(d, plan)?.into_iter().collect();
    sync_host_routes(d, plan, &link, &mut changes).await?;
    let (elements, touched) = public::sync(d, plan)?;
    changes.extend(elements);
    changes.extend(d.sync_proxies(plan, &touched, None).await?);
    d.flush_conntrack(&touched).await;
    Ok(changes)
}

/// Writes the netns table's DNAT rule as planned: one rule batch when the table is known to be
/// of the plan's shape, else the whole table replaced. Nothing for a VM without the DNAT chain
/// (without NAT it has no public IPv4, and its table does not depend on a public IPv6).
fn dnat_rule(d: &NetlinkNsDriver, plan: &VmPlan) -> Result<Option<Change>, NsError> {
    let table = names::vm_nft_table(&plan.name_prefix);
    let Some(dnat) = super::dnatbatch::planned(plan) else {
        return Ok(None);
    };
    let done = d.nft_gens.change_rules(&plan.netns, plan, |sock| {
        super::dnatbatch::replace(sock, &table, dnat)
    });
    let what = match done {
        Ok(RuleChange::Done) => "the public DNAT rule changed (one rule batch)",
        other => {
            if let Err(e) = other {
                tracing::warn!(vm = %plan.vm_id, error = %e, "the public DNAT rule batch was refused; replacing the table");
            }
            super::firewall::replace_table(d, plan)?;
            "the public DNAT rule changed (the table replaced)"
        }
    };
    Ok(Some(Change::ReplaceNft {
        fingerprint: plan.nft_fingerprint.clone(),
        differences: vec![what.into()],
    }))
}

/// The plan's main-table host routes through `link`, in kernel form (with their on-link flag).
fn planned_through(plan: &VmPlan, link: &KLink) -> BTreeMap<KRoute, bool> {
    plan.host_routes
        .iter()
        .filter(|r| r.table == MAIN_TABLE)
        .filter_map(|r| {
            let (kind, onlink) = match &r.kind {
                RouteKind::Dev { dev } if *dev == link.name => {
                    (KKind::Dev { oif: link.index }, false)
                }
                RouteKind::Via {
                    gateway,
                    dev,
                    onlink,
                } if *dev == link.name => (
                    KKind::Via {
                        gw: *gateway,
                        oif: link.index,
                    },
                    *onlink,
                ),
                _ => return None,
            };
            Some((KRoute::new(r.table, r.destination, kind), onlink))
        })
        .collect()
}

/// Makes the host's main-table routes through the VM's host veth what the plan says, with the
/// operations of the same comparison as a full apply ([`route_ops`]) given only the host's
/// routes through the link.
async fn sync_host_routes(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
    link: &KLink,
    changes: &mut Vec<Change>,
) -> Result<(), NsError> {
    let want = WantRoutes {
        host_routes: planned_through(plan, link),
        ..WantRoutes::default()
    };
    let host_routes: BTreeSet<KRoute> = d
        .route_cache
        .through(link.index)
        .await?
        .into_iter()
        .filter(|r| r.table == MAIN_TABLE)
        .collect();
    let (no_routes, no_rules) = (BTreeSet::new(), BTreeSet::new());
    let have = HaveRoutes {
        ns_routes: &no_routes,
        ns_rules: &no_rules,
        host_routes: &host_routes,
        host_rules: &no_rules,
    };
    let names = [
        HashMap::from([(link.index, link.name.clone())]),
        HashMap::new(),
    ];
    for step in route_ops(&want, have) {
        try_join_all(
            step.iter()
                .map(|op| apply::run_route_op(&d.host, op, "host", &names[0])),
        )
        .await?;
        changes.extend(apply::route_changes(&step, &names));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use vmnet_model::vm::VmConfig;
    use vmnet_plan::ns::{NsSettings, plan_vm};

    use super::*;

    #[test]
    fn the_planned_routes_through_the_veth_include_the_public_slash_32_only_with_it() {
        let settings = NsSettings::default();
        let cfg = |extra: &str| -> VmConfig {
            serde_json::from_str(&format!(
                r#"{{"id":"a","user_id":5,"tenant":1,"mesh_ipv6":"fdaa:1::5"{extra},
                "network":{{"routes":[{{"destination":"0.0.0.0/0","via":"host"}}]}}}}"#
            ))
            .unwrap()
        };
        let with = plan_vm(&cfg(r#","public_ipv4":"192.0.2.9""#), &settings).unwrap();
        let without = plan_vm(&cfg(""), &settings).unwrap();
        let v = with.veth.as_ref().unwrap();
        let link = KLink {
            index: 42,
            name: v.host_name.clone(),
            mtu: 1500,
            up: true,
            mac: None,
            no_auto_link_local: false,
            ipv6_off: false,
        };
        let a = planned_through(&with, &link);
        let b = planned_through(&without, &link);
        let extra: Vec<_> = a.keys().filter(|r| !b.contains_key(*r)).collect();
        assert_eq!(extra.len(), 1, "{a:?} vs {b:?}");
        assert_eq!(extra[0].dst, "192.0.2.9/32".parse().unwrap());
        assert_eq!(
            extra[0].kind,
            KKind::Via {
                gw: std::net::IpAddr::V4(v.peer_ipv4.addr()),
                oif: 42
            }
        );
        assert!(b.keys().all(|r| r.table == MAIN_TABLE));
        assert_eq!(
            with.nft_shape, without.nft_shape,
            "the table keeps its shape"
        );
        assert_ne!(with.nft_fingerprint, without.nft_fingerprint);
    }
}
