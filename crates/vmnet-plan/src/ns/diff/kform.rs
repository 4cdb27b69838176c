//! Routes and policy rules in the kernel's form: interfaces by index, tables and metrics as
//! numbers. Both what the kernel layer observes and what it resolves a plan to are in this form,
//! so the two compare by content ([`super::route_ops`]).

use std::collections::HashMap;
use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;

/// A route with interfaces resolved to indexes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KRoute {
    /// The routing table.
    pub table: u32,
    /// The destination.
    pub dst: IpNet,
    /// What the route does.
    pub kind: KKind,
    /// The route metric (`RTA_PRIORITY`): the kernel's default 1024 for IPv6, 0 for IPv4.
    pub metric: u32,
}

/// The metric of the `unreachable` guard installed next to each mesh-via route, so that when
/// the gateway's route goes away (its veth deleted) the destination stays unreachable instead of
/// falling through to the host's main table and the uplink.
pub const GUARD_METRIC: u32 = 0xffff_0000;

/// What a [`KRoute`] does.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KKind {
    /// Directly out of a link.
    Dev {
        /// The output interface's index.
        oif: u32,
    },
    /// Through a gateway on a link.
    Via {
        /// The gateway.
        gw: IpAddr,
        /// The output interface's index.
        oif: u32,
    },
    /// Continue the lookup with the next rule's table.
    Throw,
    /// Refuse the destination.
    Unreachable,
}

impl KRoute {
    /// A route with the kernel's default metric for its family.
    #[must_use]
    pub fn new(table: u32, dst: IpNet, kind: KKind) -> Self {
        let metric = if dst.addr().is_ipv6() { 1024 } else { 0 };
        Self {
            table,
            dst,
            kind,
            metric,
        }
    }

    /// The route in `ip route` words with link names where `names` knows them (`#<ifindex>`
    /// otherwise), as drift reports and events show it:
    /// `10.200.0.28/30 table 254 metric 0 dev vmh0007`.
    #[must_use]
    pub fn describe(&self, names: &HashMap<u32, String>) -> String {
        format!(
            "{} table {} metric {} {}",
            self.dst,
            self.table,
            self.metric,
            describe_kind(&self.kind, false, names)
        )
    }
}

/// What a route does, in `ip route` words with link names (`#<ifindex>` for a link not in
/// `names`): `dev tap0`, `via fdaa:2::2 dev tap0 onlink`, `throw`, `unreachable`.
#[must_use]
pub fn describe_kind(kind: &KKind, onlink: bool, names: &HashMap<u32, String>) -> String {
    let dev = |oif: &u32| names.get(oif).cloned().unwrap_or_else(|| format!("#{oif}"));
    match kind {
        KKind::Dev { oif } => format!("dev {}", dev(oif)),
        KKind::Via { gw, oif } => {
            format!(
                "via {gw} dev {}{}",
                dev(oif),
                if onlink { " onlink" } else { "" }
            )
        }
        KKind::Throw => "throw".to_owned(),
        KKind::Unreachable => "unreachable".to_owned(),
    }
}

/// A route with its links as `#<ifindex>` ([`KRoute::describe`] names them).
impl fmt::Display for KRoute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe(&HashMap::new()))
    }
}

/// A rule `iif <iif> lookup <table> pref <priority>` (IPv6).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KRule {
    /// The input interface's name.
    pub iif: String,
    /// The table looked up.
    pub table: u32,
    /// The rule's priority.
    pub priority: u32,
}

impl fmt::Display for KRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "iif {} lookup {} pref {}",
            self.iif, self.table, self.priority
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_get_their_familys_default_metric() {
        let v6 = KRoute::new(254, "fdaa::7/128".parse().unwrap(), KKind::Dev { oif: 3 });
        let v4 = KRoute::new(254, "0.0.0.0/0".parse().unwrap(), KKind::Throw);
        assert_eq!((v6.metric, v4.metric), (1024, 0));
    }

    #[test]
    fn route_kinds_are_described_with_link_names() {
        let names = HashMap::from([(2, "fu1t00c8".to_owned())]);
        let via = KKind::Via {
            gw: "fdaa:2::2".parse().unwrap(),
            oif: 2,
        };
        assert_eq!(
            describe_kind(&via, true, &names),
            "via fdaa:2::2 dev fu1t00c8 onlink"
        );
        assert_eq!(
            describe_kind(&KKind::Dev { oif: 9 }, false, &names),
            "dev #9"
        );
        assert_eq!(describe_kind(&KKind::Throw, false, &names), "throw");
        let r = KRoute {
            table: 254,
            dst: "10.200.0.28/30".parse().unwrap(),
            kind: KKind::Dev { oif: 2 },
            metric: 0,
        };
        assert_eq!(
            r.describe(&names),
            "10.200.0.28/30 table 254 metric 0 dev fu1t00c8"
        );
        assert_eq!(
            r.to_string(),
            "10.200.0.28/30 table 254 metric 0 dev #2",
            "a link the caller does not know keeps its index"
        );
        let rule = KRule {
            iif: "fu1p00c8".into(),
            table: 100,
            priority: 100,
        };
        assert_eq!(rule.to_string(), "iif fu1p00c8 lookup 100 pref 100");
    }
}
