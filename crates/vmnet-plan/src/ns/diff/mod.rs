//! The comparison of a VM's desired kernel state with what the kernel holds, as plain data in
//! and an ordered list of operations out. The kernel layer observes, calls these functions and
//! executes the operations they return; a drift report is the same list, described and not
//! executed. So a reconcile pass, a repair on a notification, a drift report and the fast paths
//! of a change all decide what to do in one place.
//!
//! # Design
//! - [`route_ops`]: routes and policy rules of both sides of a VM (the host and its netns) in
//!   the kernel's form ([`kform`]), compared by content. The operations come in steps; the
//!   operations of one step are independent of each other (the kernel layer sends them
//!   concurrently), and the steps are ordered so that no rule ever selects a half-filled table
//!   and a changed destination never has two routes: stale rules, stale routes, missing routes,
//!   missing on-link routes, missing rules.

pub mod kform;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;

pub use kform::{GUARD_METRIC, KKind, KRoute, KRule};

/// Where an operation happens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Side {
    /// The host netns.
    Host,
    /// The VM netns.
    Vm,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Host => "host",
            Self::Vm => "vm",
        })
    }
}

/// The routes (each with its on-link flag) and rules a plan resolves to, per side.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct WantRoutes {
    /// Routes in the VM netns.
    pub ns_routes: BTreeMap<KRoute, bool>,
    /// Rules in the VM netns.
    pub ns_rules: BTreeSet<KRule>,
    /// The VM's routes in the host netns.
    pub host_routes: BTreeMap<KRoute, bool>,
    /// The VM's rules in the host netns.
    pub host_rules: BTreeSet<KRule>,
}

/// The routes and rules observed, per side (only objects of the kinds vmnet makes).
#[derive(Debug, Clone, Copy)]
pub struct HaveRoutes<'a> {
    /// Routes in the VM netns.
    pub ns_routes: &'a BTreeSet<KRoute>,
    /// Rules in the VM netns.
    pub ns_rules: &'a BTreeSet<KRule>,
    /// The VM's routes in the host netns.
    pub host_routes: &'a BTreeSet<KRoute>,
    /// The VM's rules in the host netns.
    pub host_rules: &'a BTreeSet<KRule>,
}

/// One operation on routes or rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteOp {
    /// Delete a rule.
    DelRule(Side, KRule),
    /// Delete a route.
    DelRoute(Side, KRoute),
    /// Add a route; `onlink` marks its next hop on-link.
    AddRoute {
        /// Where.
        side: Side,
        /// The route.
        route: KRoute,
        /// The next hop is on-link.
        onlink: bool,
    },
    /// Add a rule.
    AddRule(Side, KRule),
}

impl RouteOp {
    /// Where the operation happens.
    #[must_use]
    pub fn side(&self) -> Side {
        match self {
            Self::DelRule(s, _)
            | Self::DelRoute(s, _)
            | Self::AddRoute { side: s, .. }
            | Self::AddRule(s, _) => *s,
        }
    }

    /// The object, in `ip route` / `ip rule` words with link names where `names` knows them.
    #[must_use]
    pub fn describe(&self, names: &HashMap<u32, String>) -> String {
        match self {
            Self::DelRule(_, r) | Self::AddRule(_, r) => r.to_string(),
            Self::DelRoute(_, r) | Self::AddRoute { route: r, .. } => r.describe(names),
        }
    }
}

/// The operations that make the routes and rules of `have` those of `want`, in steps (see the
/// module docs). Empty when they are equal; steps without operations are left out.
#[must_use]
pub fn route_ops(want: &WantRoutes, have: HaveRoutes<'_>) -> Vec<Vec<RouteOp>> {
    let route_sides = [
        (Side::Host, &want.host_routes, have.host_routes),
        (Side::Vm, &want.ns_routes, have.ns_routes),
    ];
    let rule_sides = [
        (Side::Vm, &want.ns_rules, have.ns_rules),
        (Side::Host, &want.host_rules, have.host_rules),
    ];
    let stale_rules = rule_sides
        .iter()
        .flat_map(|(s, w, h)| h.difference(w).map(|r| RouteOp::DelRule(*s, r.clone())))
        .collect();
    let stale_routes = route_sides
        .iter()
        .flat_map(|(s, w, h)| {
            h.iter()
                .filter(|r| !w.contains_key(*r))
                .map(|r| RouteOp::DelRoute(*s, r.clone()))
        })
        .collect();
    // On-link next hops last: the kernel checks an on-link gateway against the main table, so
    // `::/0 table 100 via <mesh> dev <tap> onlink` is refused (EINVAL, "device mismatch") while
    // the main table routes the mesh address elsewhere, i.e. until `<mesh>/128 dev <tap>`
    // exists. A changed mesh address adds both.
    let missing = |onlink_step: bool| -> Vec<RouteOp> {
        route_sides
            .iter()
            .flat_map(|(s, w, h)| {
                w.iter()
                    .filter(move |(r, o)| **o == onlink_step && !h.contains(*r))
                    .map(|(r, o)| RouteOp::AddRoute {
                        side: *s,
                        route: r.clone(),
                        onlink: *o,
                    })
            })
            .collect()
    };
    let missing_rules = rule_sides
        .iter()
        .flat_map(|(s, w, h)| w.difference(h).map(|r| RouteOp::AddRule(*s, r.clone())))
        .collect();
    [
        stale_rules,
        stale_routes,
        missing(false),
        missing(true),
        missing_rules,
    ]
    .into_iter()
    .filter(|step: &Vec<RouteOp>| !step.is_empty())
    .collect()
}

#[cfg(test)]
mod tests;
