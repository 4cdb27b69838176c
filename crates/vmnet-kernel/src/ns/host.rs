//! The host side of the driver: which namespace is "the host", running synchronous work there,
//! and the host-wide state ([`vmnet_plan::ns::HostPlan`]).
//!
//! # Router advertisements on the uplink
//! Turning IPv6 forwarding on makes the kernel ignore router advertisements on every link with
//! `accept_ra=1` (the default), and each write of `forwarding=1` purges the default routes it
//! learned from them: a host whose uplink gets its default IPv6 route by SLAAC loses it at once
//! and for good. Before forwarding is written, every uplink still at `accept_ra=1` gets
//! `accept_ra=2` (process advertisements even when forwarding), which the purge also spares. An
//! uplink is a link of the host namespace, other than loopback and our own links, that carries
//! a route learned from an advertisement (`proto ra`) or a global IPv6 address with a finite
//! lifetime (formed by SLAAC or leased by DHCPv6), or that was found so before. Links with
//! `accept_ra=0` are left alone (the administrator turned advertisements off), and so is every
//! other link: a bridge or veth towards guests must not start trusting their advertisements. An
//! uplink back at `accept_ra=1` is host-wide drift, repaired like the rest.

use std::collections::BTreeSet;

use rtnetlink::Handle;
use vmnet_plan::ns::{HostPlan, NameKind, parse_uid};

use super::nftcheck::{self, ListingMemo};
use super::{NsError, inns, routes};
use crate::netns;

/// The namespace the driver treats as the host: the calling process's own, or a named one (a
/// sandbox).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum HostNs {
    /// The process's network namespace.
    Current,
    /// A named namespace under /run/netns.
    Named(String),
}

impl HostNs {
    /// A label for errors.
    pub(super) fn label(&self) -> &str {
        match self {
            Self::Current => "host",
            Self::Named(n) => n,
        }
    }

    /// Runs `f` on a thread inside the host namespace (or on the calling thread for the process's
    /// own namespace).
    pub(super) fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T, NsError> {
        match self {
            Self::Current => Ok(f()),
            Self::Named(n) => Ok(netns::run_in(n, f)?),
        }
    }

    /// A strict rtnetlink handle in the host namespace (kernel-filtered dumps).
    pub(super) fn netlink(&self) -> Result<rtnetlink::Handle, NsError> {
        match self {
            Self::Current => {
                let (conn, h, _) =
                    rtnetlink::new_connection_with_strict_check().map_err(|source| {
                        NsError::Netns(netns::NetnsError::Io {
                            name: "host".into(),
                            op: "open rtnetlink socket",
                            source,
                        })
                    })?;
                tokio::spawn(conn);
                Ok(h)
            }
            Self::Named(n) => Ok(netns::netlink_in_strict(n)?),
        }
    }
}

/// The uplinks whose router advertisements the host uses (see the module docs), by name: links
/// carrying a route learned from an advertisement or a global IPv6 address with a finite
/// lifetime (SLAAC, DHCPv6: the default route of such a link comes from advertisements too),
/// and the ones found before (`seen`, updated), so an uplink whose learned route already
/// expired is still found.
pub(super) async fn ra_uplinks(
    h: &Handle,
    prefix: &str,
    seen: &std::sync::Mutex<BTreeSet<String>>,
) -> Result<Vec<String>, NsError> {
    let ours = |name: &str| {
        [NameKind::HostVeth, NameKind::PeerVeth, NameKind::Tap]
            .into_iter()
            .any(|k| parse_uid(prefix, k, name).is_some())
    };
    let mut indexes = routes::ra_route_links(h).await?;
    indexes.extend(routes::dynamic_v6_links(h).await?);
    indexes.sort_unstable();
    indexes.dedup();
    let mut found = BTreeSet::new();
    for index in indexes {
        if let Some(l) = routes::link_by_index(h, index).await?
            && l.name != "lo"
            && !ours(&l.name)
        {
            found.insert(l.name);
        }
    }
    let mut seen = seen
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    seen.extend(found);
    Ok(seen.iter().cloned().collect())
}

fn accept_ra(link: &str) -> String {
    format!("net/ipv6/conf/{link}/accept_ra")
}

/// The uplinks still at `accept_ra=1` while the plan turns IPv6 forwarding on (read in the
/// calling thread's namespace).
fn uplinks_ignoring_ra(plan: &HostPlan, uplinks: &[String]) -> Vec<String> {
    let forwarding = plan
        .sysctls
        .iter()
        .any(|(p, v)| p == "net/ipv6/conf/all/forwarding" && v == "1");
    if !forwarding {
        return Vec::new();
    }
    let paths: Vec<String> = uplinks.iter().map(|u| accept_ra(u)).collect();
    inns::read_sysctls(&paths)
        .into_iter()
        .zip(uplinks)
        .filter(|(v, _)| v.as_deref() == Some("1"))
        .map(|(_, u)| u.clone())
        .collect()
}

/// The memo key of the host table.
fn host_key(plan: &HostPlan) -> String {
    nftcheck::key("host", "ip", &plan.nft_table)
}

/// Applies the host-wide plan: `accept_ra=2` on the `uplinks` that need it (before forwarding,
/// see the module docs), sysctls, then the masquerade table (one nft transaction), read back
/// once for the listing memo.
pub(super) fn apply_host(
    host: &HostNs,
    plan: &HostPlan,
    memo: &ListingMemo,
    uplinks: &[String],
) -> Result<(), NsError> {
    let label = host.label().to_owned();
    host.run(|| {
        let keep: Vec<(String, String)> = uplinks_ignoring_ra(plan, uplinks)
            .iter()
            .map(|u| (accept_ra(u), "2".to_owned()))
            .collect();
        if !keep.is_empty() {
            tracing::info!(netns = %label, uplinks = ?keep, "keeping router advertisements on the uplinks with forwarding on");
            inns::write_sysctls(&label, &keep)?;
        }
        inns::write_sysctls(&label, &plan.sysctls)?;
        inns::run_nft(&label, &plan.nft)?;
        let listing = nftcheck::or_empty(inns::list_table(&label, "ip", &plan.nft_table)?);
        memo.after_apply(
            &label,
            &host_key(plan),
            &plan.nft_fingerprint,
            &plan.nft,
            &listing,
        )?;
        // Replacing the public table drops every VM's elements: only when its own rules or maps
        // differ. Each VM's elements are then missing (drift) until its next apply re-adds them.
        let (drift, present) = pub_drift(&label, plan, memo)?;
        if !drift.is_empty() {
            if present {
                tracing::warn!(netns = %label, table = %plan.pub_table, differences = ?drift, "replacing the public address table; every VM's elements are added again on its next apply");
            } else {
                tracing::info!(netns = %label, table = %plan.pub_table, "creating the public address table");
            }
            inns::run_nft(&label, &plan.pub_nft)?;
            let listing = pub_listing(&label, plan)?;
            memo.after_apply(&label, &pub_key(plan), PUB_FP, &plan.pub_nft, &listing)?;
        }
        Ok(())
    })?
}

/// The fingerprint the memo keeps the public table's listing under (its plan changes only with
/// the transit range, which a driver never changes).
const PUB_FP: &str = "pub";

fn pub_key(plan: &HostPlan) -> String {
    nftcheck::key("host", "inet", &plan.pub_table)
}

/// The listing of the public table without the maps' elements (they belong to the VMs, each
/// compared by its own apply and drift report).
fn pub_listing(label: &str, plan: &HostPlan) -> Result<serde_json::Value, NsError> {
    Ok(pub_listing_of(label, plan)?.0)
}

/// [`pub_listing`], and whether the table exists at all.
fn pub_listing_of(label: &str, plan: &HostPlan) -> Result<(serde_json::Value, bool), NsError> {
    let table = inns::list_table(label, "inet", &plan.pub_table)?;
    let present = table.is_some();
    let mut listing = nftcheck::or_empty(table);
    if let Some(items) = listing["nftables"].as_array_mut() {
        for i in items {
            if let Some(m) = i.get_mut("map").and_then(serde_json::Value::as_object_mut) {
                m.remove("elem");
            }
        }
    }
    Ok((listing, present))
}

/// How the public table's rules and maps differ from the plan (read in the calling thread's
/// namespace), and whether the table exists at all (a table missing is a first start, not
/// drift to warn about).
fn pub_drift(
    label: &str,
    plan: &HostPlan,
    memo: &ListingMemo,
) -> Result<(Vec<String>, bool), NsError> {
    if plan.pub_table.is_empty() {
        return Ok((Vec::new(), true));
    }
    let (listing, present) = pub_listing_of(label, plan)?;
    let drift = memo.drift(label, &pub_key(plan), PUB_FP, &plan.pub_nft, &listing)?;
    Ok((drift, present))
}

/// What [`host_drift`] found: the differences, one sentence, and whether the host nft table
/// existed at all (a host where it is missing was never set up, or was cleared).
pub(super) struct HostDrift {
    pub(super) what: String,
    pub(super) table_present: bool,
}

/// What of the host-wide state is not as planned (`None` when all is): sysctls, uplinks that
/// ignore router advertisements, and the masquerade table compared with the plan by content
/// (chains, hooks, priorities, policies, rules), so a deleted rule or chain or a flipped policy
/// counts, not only a missing table.
pub(super) fn host_drift(
    host: &HostNs,
    plan: &HostPlan,
    memo: &ListingMemo,
    uplinks: &[String],
) -> Result<Option<HostDrift>, NsError> {
    let label = host.label().to_owned();
    host.run(|| {
        let mut bad = Vec::new();
        let sysctls = inns::sysctls_differ(&plan.sysctls);
        if !sysctls.is_empty() {
            bad.push(format!("sysctls {}", sysctls.join(", ")));
        }
        let ignoring = uplinks_ignoring_ra(plan, uplinks);
        if !ignoring.is_empty() {
            bad.push(format!(
                "uplinks {} ignore router advertisements (accept_ra 1 with forwarding on)",
                ignoring.join(", ")
            ));
        }
        let listing = inns::list_table(&label, "ip", &plan.nft_table)?;
        let table_present = listing.is_some();
        let listing = nftcheck::or_empty(listing);
        bad.extend(memo.drift(
            &label,
            &host_key(plan),
            &plan.nft_fingerprint,
            &plan.nft,
            &listing,
        )?);
        bad.extend(pub_drift(&label, plan, memo)?.0);
        Ok((!bad.is_empty()).then(|| HostDrift {
            what: format!("{label}: {}", bad.join("; ")),
            table_present,
        }))
    })?
}

/// Removes the host masquerade table and the public address table (sysctls are left as they are: other software may rely on
/// forwarding).
pub(super) fn remove_host(host: &HostNs, plan: &HostPlan) -> Result<(), NsError> {
    let label = host.label().to_owned();
    host.run(|| {
        inns::nft_delete_table(&label, "ip", &plan.nft_table)?;
        inns::nft_delete_table(&label, "inet", &plan.pub_table)
    })?
}
