//! Reading one VM's real state over netlink (and nft), and resolving its plan into the same
//! kernel form so the two can be diffed.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::net::IpAddr;

use futures::TryStreamExt;
use netlink_packet_route::address::{AddressAttribute, AddressMessage};
use rtnetlink::{Handle, IpVersion};
use vmnet_model::vm::MESH_RANGE;
use vmnet_plan::ns::diff::{HaveRoutes, WantRoutes};
use vmnet_plan::ns::{MAIN_TABLE, PlannedRoute, RouteKind, VmPlan, names};

use super::driver::NetlinkNsDriver;
use super::links::neigh::{self, KNeigh};
use super::nftcheck;
use super::routes::{self, KKind, KLink, KRoute, nl};
use super::rules::{self, KRule};
use super::{NsError, inns};
use crate::netns;

/// An address on a link: (ifindex, address, prefix length).
pub(super) type KAddr = (u32, IpAddr, u8);

/// One VM's observed state. Only objects of our kinds are read (static routes in our tables,
/// rules with our interfaces).
#[derive(Debug, Default)]
pub(super) struct VmState {
    pub ns_links: HashMap<String, KLink>,
    pub ns_addrs: HashSet<KAddr>,
    pub ns_routes: BTreeSet<KRoute>,
    pub ns_rules: BTreeSet<KRule>,
    pub sysctls_bad: Vec<String>,
    /// How the netns nft table differs from the plan (one line each; empty when in sync).
    pub nft_drift: Vec<String>,
    /// The shape fingerprint of the plan the netns nft table was made from (the
    /// `vmnet:<shape>` comment of its first rule), when it carries one.
    pub nft_applied: Option<String>,
    /// The netns's entry for the host end's link-local on the netns veth end.
    pub ns_neigh: Option<KNeigh>,
    /// The neighbour entries on the tap (the guest's permanent ones, [`super::guestneigh`]).
    pub tap_neigh: Vec<(IpAddr, KNeigh)>,
    pub host_link: Option<KLink>,
    pub host_addrs: HashSet<KAddr>,
    /// The host's entry for the netns end's link-local on the host end.
    pub host_neigh: Option<KNeigh>,
    pub host_routes: BTreeSet<KRoute>,
    pub host_rules: BTreeSet<KRule>,
}

impl VmState {
    /// The routes and rules observed, for [`vmnet_plan::ns::diff::route_ops`].
    pub(super) fn routes(&self) -> HaveRoutes<'_> {
        HaveRoutes {
            ns_routes: &self.ns_routes,
            ns_rules: &self.ns_rules,
            host_routes: &self.host_routes,
            host_rules: &self.host_rules,
        }
    }
}

/// Addresses on link `index`.
pub(super) async fn link_addrs(h: &Handle, index: u32) -> Result<HashSet<KAddr>, NsError> {
    let msgs: Vec<AddressMessage> = routes::addr_dump(h, index)
        .execute()
        .try_collect()
        .await
        .map_err(nl(format!("dump addresses of #{index}")))?;
    Ok(addrs_of(&msgs, |i| i == index))
}

/// The addresses of `msgs` on the links `on` takes.
fn addrs_of(msgs: &[AddressMessage], on: impl Fn(u32) -> bool) -> HashSet<KAddr> {
    msgs.iter()
        .filter(|m| on(m.header.index))
        .filter_map(|m| {
            m.attributes.iter().find_map(|a| match a {
                AddressAttribute::Address(ip) => Some((m.header.index, *ip, m.header.prefix_len)),
                _ => None,
            })
        })
        .collect()
}

/// Reads the VM's state: netns links, addresses, routes, rules, sysctls and nft table (compared
/// with the plan by content, see [`super::nftcheck`]; not listed while the netns's nf_tables
/// generation stays where the table was last found as planned, by this agent or by the one
/// before it, see `gens`) through `ns`; its
/// host veth, host routes and rules through the driver's host handle.
pub(super) async fn observe_vm(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
    ns: &Handle,
) -> Result<VmState, NsError> {
    // The netns's objects and the host's go over two sockets: their requests run at once (one
    // socket holds one dump at a time, so each side asks in turn).
    let (mut st, host) = futures::try_join!(observe_ns(plan, ns), observe_host(d, plan))?;
    (
        st.host_link,
        st.host_addrs,
        st.host_neigh,
        st.host_routes,
        st.host_rules,
    ) = host;
    let table = names::vm_nft_table(&plan.name_prefix);
    let key = nftcheck::key(&plan.netns, "inet", &table);
    let netns_name = plan.netns.clone();
    let sysctls = [plan.ns_sysctls.as_slice(), plan.tap_sysctls.as_slice()].concat();
    let fp = plan.nft_fingerprint.as_str();
    let gens = &d.nft_gens;
    let (bad, read) = netns::run_in(&plan.netns, || {
        let bad = inns::sysctls_differ(&sysctls);
        if gens.unchanged(&netns_name, fp) || gens.resume_here(&netns_name, fp) {
            return (bad, None);
        }
        // Read before the listing: a change after it moves the generation past this one.
        let generation = gens.read_here(&netns_name);
        (
            bad,
            Some((generation, inns::list_table(&netns_name, "inet", &table))),
        )
    })?;
    st.sysctls_bad = bad;
    match read {
        // Nothing in the netns changed since its table was found as planned.
        None => st.nft_applied = Some(plan.nft_shape.clone()),
        Some((generation, listing)) => {
            let listing = listing?;
            st.nft_applied = listing.as_ref().and_then(applied_fingerprint);
            st.nft_drift = d.nft_memo.drift(
                &plan.netns,
                &key,
                fp,
                &plan.nft,
                &nftcheck::or_empty(listing),
            )?;
            if st.nft_drift.is_empty()
                && let Some(g) = generation
            {
                gens.found_in_sync(&plan.netns, plan, g);
            }
        }
    }
    Ok(st)
}

/// The netns's links, addresses (one dump for all links), routes, rules and neighbour entries.
async fn observe_ns(plan: &VmPlan, ns: &Handle) -> Result<VmState, NsError> {
    let mut st = VmState::default();
    for l in routes::dump_links(ns).await? {
        st.ns_links.insert(l.name.clone(), l);
    }
    let msgs: Vec<AddressMessage> = ns
        .address()
        .get()
        .execute()
        .try_collect()
        .await
        .map_err(nl(format!("dump addresses in {}", plan.netns)))?;
    let indexes: HashSet<u32> = st.ns_links.values().map(|l| l.index).collect();
    st.ns_addrs = addrs_of(&msgs, |i| indexes.contains(&i));
    for v in [IpVersion::V4, IpVersion::V6] {
        st.ns_routes.extend(
            routes::dump_routes(ns, v, None, None)
                .await?
                .into_iter()
                .filter(|r| r.table == MAIN_TABLE || r.table == names::NS_INBOUND_TABLE),
        );
    }
    st.ns_rules.extend(rules::dump_rules(ns).await?);
    if let Some(v) = &plan.veth
        && let Some(l) = st.ns_links.get(&v.peer_name)
    {
        let ip = IpAddr::V6(v.host_ipv6_link_local.addr());
        st.ns_neigh = neigh::get(ns, l.index, ip, &plan.netns).await?;
    }
    if let Some(l) = st.ns_links.get(&plan.tap.name) {
        st.tap_neigh = super::guestneigh::observe(ns, l.index, &plan.netns).await?;
    }
    Ok(st)
}

/// What [`observe_host`] reads: the host veth, its addresses and neighbour entry, the host
/// routes through it and in the VM's host table, and the host rules of the veth.
type HostSide = (
    Option<KLink>,
    HashSet<KAddr>,
    Option<KNeigh>,
    BTreeSet<KRoute>,
    BTreeSet<KRule>,
);

/// The VM's objects on the host, through the driver's host handle.
async fn observe_host(d: &NetlinkNsDriver, plan: &VmPlan) -> Result<HostSide, NsError> {
    let host = &d.host;
    let host_name =
        vmnet_plan::ns::name(&plan.name_prefix, names::NameKind::HostVeth, plan.user_id);
    let link = routes::link_by_name(host, &host_name).await?;
    let (mut addrs, mut neigh, mut routes) = (HashSet::new(), None, BTreeSet::new());
    let dumps = d.host_dumps.lock().await;
    if let Some(l) = &link {
        addrs = link_addrs(host, l.index).await?;
        if let Some(v) = &plan.veth {
            let ip = IpAddr::V6(v.peer_ipv6_link_local.addr());
            neigh = neigh::get(host, l.index, ip, "host").await?;
        }
        routes.extend(d.route_cache.through(l.index).await?);
    }
    for v in [IpVersion::V4, IpVersion::V6] {
        routes.extend(routes::dump_routes(host, v, Some(plan.host_table), None).await?);
    }
    drop(dumps);
    let rules = d.host_rules.of(&host_name).await?.into_iter().collect();
    Ok((link, addrs, neigh, routes, rules))
}

/// The fingerprint in the `vmnet:<fingerprint>` comment of a rule of an nft JSON listing.
fn applied_fingerprint(listing: &serde_json::Value) -> Option<String> {
    listing["nftables"]
        .as_array()?
        .iter()
        .filter_map(|i| i["rule"]["comment"].as_str())
        .find_map(|c| c.strip_prefix(vmnet_plan::ns::FINGERPRINT_PREFIX))
        .map(str::to_owned)
}

fn index_of(links: &HashMap<String, KLink>, name: &str, whereis: &str) -> Result<u32, NsError> {
    links
        .get(name)
        .map(|l| l.index)
        .ok_or_else(|| NsError::Missing(format!("{whereis}: link {name} is missing")))
}

/// Resolves the plan's routes and rules into kernel form, given the VM's links (`ns_links`), its
/// host veth and the host handle (for mesh gateways).
pub(super) async fn resolve(
    plan: &VmPlan,
    ns_links: &HashMap<String, KLink>,
    host_link: Option<&KLink>,
    host: &Handle,
) -> Result<WantRoutes, NsError> {
    let mut d = WantRoutes::default();
    for r in &plan.ns_routes {
        let (kind, onlink) = match &r.kind {
            RouteKind::Dev { dev } => (
                KKind::Dev {
                    oif: index_of(ns_links, dev, &plan.netns)?,
                },
                false,
            ),
            RouteKind::Via {
                gateway,
                dev,
                onlink,
            } => (
                KKind::Via {
                    gw: *gateway,
                    oif: index_of(ns_links, dev, &plan.netns)?,
                },
                *onlink,
            ),
            RouteKind::Throw => (KKind::Throw, false),
            RouteKind::ViaMesh { .. } => {
                return Err(NsError::Missing(format!(
                    "{}: a mesh via is not valid inside the netns",
                    plan.netns
                )));
            }
        };
        d.ns_routes
            .insert(KRoute::new(r.table, r.destination, kind), onlink);
    }
    for r in &plan.ns_rules {
        d.ns_rules.insert(KRule {
            iif: r.iif.clone(),
            table: r.table,
            priority: r.priority,
        });
    }
    for r in &plan.host_routes {
        let (kind, onlink) = host_kind(plan, r, host_link, host).await?;
        if matches!(r.kind, RouteKind::ViaMesh { .. }) && kind != KKind::Unreachable {
            let mut guard = KRoute::new(r.table, r.destination, KKind::Unreachable);
            guard.metric = routes::GUARD_METRIC;
            d.host_routes.insert(guard, false);
        }
        d.host_routes
            .insert(KRoute::new(r.table, r.destination, kind), onlink);
    }
    for r in &plan.host_rules {
        d.host_rules.insert(KRule {
            iif: r.iif.clone(),
            table: r.table,
            priority: r.priority,
        });
    }
    Ok(d)
}

async fn host_kind(
    plan: &VmPlan,
    r: &PlannedRoute,
    host_link: Option<&KLink>,
    host: &Handle,
) -> Result<(KKind, bool), NsError> {
    let own = |dev: &str| match host_link {
        Some(l) if l.name == dev => Ok(l.index),
        _ => Err(NsError::Missing(format!("host: link {dev} is missing"))),
    };
    Ok(match &r.kind {
        RouteKind::Dev { dev } => (KKind::Dev { oif: own(dev)? }, false),
        RouteKind::Via {
            gateway,
            dev,
            onlink,
        } => (
            KKind::Via {
                gw: *gateway,
                oif: own(dev)?,
            },
            *onlink,
        ),
        RouteKind::Throw => (KKind::Throw, false),
        RouteKind::ViaMesh { mesh } => {
            // The gateway VM is reached through whatever route the host has for its mesh address,
            // provided that route is a mesh route (inside fdaa::/16) and not this VM itself.
            let own_oif = host_link.map(|l| l.index);
            match super::lookup::fib_match(host, *mesh).await? {
                Some((IpNet::V6(net), gw, oif))
                    if MESH_RANGE.contains(&net) && Some(oif) != own_oif =>
                {
                    (
                        KKind::Via {
                            gw: gw.unwrap_or(IpAddr::V6(*mesh)),
                            oif,
                        },
                        false,
                    )
                }
                _ => {
                    tracing::warn!(vm = %plan.vm_id, gateway = %mesh, "gateway not reachable on this host; route is unreachable until it is");
                    (KKind::Unreachable, false)
                }
            }
        }
    })
}

use ipnet::IpNet;

#[cfg(test)]
mod fingerprint_tests {
    use super::applied_fingerprint;

    #[test]
    fn the_applied_fingerprint_is_read_from_the_rule_comment() {
        let listing = serde_json::json!({"nftables": [
            {"metainfo": {"version": "1.0.6"}},
            {"table": {"family": "inet", "name": "t", "handle": 1}},
            {"rule": {"family": "inet", "table": "t", "chain": "mss", "handle": 3, "expr": []}},
            {"rule": {"family": "inet", "table": "t", "chain": "mss", "handle": 4,
                "comment": "vmnet:0123abcd", "expr": []}}
        ]});
        assert_eq!(applied_fingerprint(&listing).as_deref(), Some("0123abcd"));
        assert_eq!(
            applied_fingerprint(&serde_json::json!({"nftables": []})),
            None
        );
    }
}
