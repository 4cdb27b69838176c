//! What kind of kernel object a [`Change`] touched, for the agent's repair counters: links,
//! addresses, routes, rules, neighbour entries, sysctls, nf_tables tables, chains, rules and
//! set elements, tc qdiscs, classes and filters (BPF attachments are filters), and BPF map
//! entries.
//!
//! # Design
//! A change names its object in its variant (routes, rules, veths, tc) or in its line (a
//! [`Change::Repair`] of the fixed per-VM state, the host-wide state or the public address
//! table; a [`Change::ReplaceNft`]'s differences, each a [`vmnet_plan::nftdiff::Difference`]
//! line). One change may touch several kinds (a fixed-state repair of a VM's addresses and its
//! MTU is an address and a link repair); each kind counts once per change. Lines are read by
//! the words their producers write (tested below against each producer's form); a line no
//! rule knows counts as [`ObjectKind::Other`], never as nothing.

use super::Change;

/// A kind of kernel object vmnet owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ObjectKind {
    /// A whole VM netns (made again).
    Netns,
    /// A link: a tap, a veth end, lo (existence, MTU, up, MAC, address generation mode).
    Link,
    /// An IP address on a link.
    Address,
    /// A route.
    Route,
    /// A routing rule.
    Rule,
    /// A neighbour entry: a veth end's or the guest's permanent entry, or a proxy ARP/NDP entry
    /// on the uplink.
    Neighbour,
    /// A sysctl.
    Sysctl,
    /// An nf_tables table (missing, unexpected, flags).
    NftTable,
    /// An nf_tables chain (missing, or its declaration: hook, priority, policy).
    NftChain,
    /// An nf_tables chain's rules.
    NftRule,
    /// An nf_tables set or map, or its elements (the public address table's included).
    NftSet,
    /// A tc qdisc.
    TcQdisc,
    /// A tc class (a throughput limit).
    TcClass,
    /// A tc filter (the limits' u32 filters, the guard's and activity program's BPF filters).
    TcFilter,
    /// An entry of a BPF map (the guest guard's or the activity program's).
    BpfMap,
    /// Anything else.
    Other,
}

impl ObjectKind {
    /// Every kind, in the order of the counters.
    pub const ALL: [Self; 16] = [
        Self::Netns,
        Self::Link,
        Self::Address,
        Self::Route,
        Self::Rule,
        Self::Neighbour,
        Self::Sysctl,
        Self::NftTable,
        Self::NftChain,
        Self::NftRule,
        Self::NftSet,
        Self::TcQdisc,
        Self::TcClass,
        Self::TcFilter,
        Self::BpfMap,
        Self::Other,
    ];

    /// The name in counters (`snake_case`).
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Netns => "netns",
            Self::Link => "link",
            Self::Address => "address",
            Self::Route => "route",
            Self::Rule => "rule",
            Self::Neighbour => "neighbour",
            Self::Sysctl => "sysctl",
            Self::NftTable => "nft_table",
            Self::NftChain => "nft_chain",
            Self::NftRule => "nft_rule",
            Self::NftSet => "nft_set",
            Self::TcQdisc => "tc_qdisc",
            Self::TcClass => "tc_class",
            Self::TcFilter => "tc_filter",
            Self::BpfMap => "bpf_map",
            Self::Other => "other",
        }
    }
}

impl Change {
    /// The kinds of object this change touched (each once, sorted; never empty).
    #[must_use]
    pub fn kinds(&self) -> Vec<ObjectKind> {
        let mut out = match self {
            Self::CreateVm { .. } | Self::RemoveVm { .. } => vec![ObjectKind::Netns],
            Self::AddVeth { .. } | Self::DelVeth { .. } => vec![ObjectKind::Link],
            Self::AddRoute(..) | Self::DelRoute(..) => vec![ObjectKind::Route],
            Self::AddRule(..) | Self::DelRule(..) => vec![ObjectKind::Rule],
            Self::Neighbour(..) => vec![ObjectKind::Neighbour],
            Self::ReplaceNft { differences, .. } => differences
                .iter()
                .map(|d| ObjectKind::of_nft_difference(d))
                .collect(),
            Self::Tc { what, .. } => vec![tc_line(what)],
            Self::Guard { what, .. } | Self::Activity { what, .. } | Self::Upgrade { what, .. } => {
                vec![if what.contains("filter") {
                    ObjectKind::TcFilter
                } else {
                    ObjectKind::BpfMap
                }]
            }
            Self::Repair { what } => repair_line(what),
        };
        out.sort_unstable();
        out.dedup();
        if out.is_empty() {
            out.push(ObjectKind::Other);
        }
        out
    }
}

/// A tc change's line ([`super::tc`]): `add htb root`, `replace root qdisc`, `remove limits`
/// are the qdisc; `… class …` a class; `… filter …` a filter.
fn tc_line(what: &str) -> ObjectKind {
    if what.contains("filter") {
        ObjectKind::TcFilter
    } else if what.contains("class") {
        ObjectKind::TcClass
    } else {
        ObjectKind::TcQdisc
    }
}

impl ObjectKind {
    /// The kind one nft difference line names ([`vmnet_plan::nftdiff::Difference`]'s form,
    /// also pool mode's audit's): `table T is missing`, `table T: chain C is …`, `table T:
    /// chain C has N rules …`, `table T: set S …`, `table T: flags is …`.
    #[must_use]
    pub fn of_nft_difference(line: &str) -> Self {
        let Some((_, rest)) = line.split_once(": ") else {
            return Self::NftTable;
        };
        if rest.starts_with("chain ") && rest.contains(" rules, ") {
            Self::NftRule
        } else if rest.starts_with("chain ") {
            Self::NftChain
        } else if rest.starts_with("set ") || rest.starts_with("map ") {
            Self::NftSet
        } else if rest.starts_with("flags") {
            Self::NftTable
        } else {
            Self::Other
        }
    }
}

/// A [`Change::Repair`] line: `<where>: <part>; <part>…`, the parts written by the fixed-state
/// check ([`super::links::fixed_drift`]), the host check ([`super::host`]), the public address
/// table ([`super::public::differences`]), the proxy entries and the link repairs.
fn repair_line(what: &str) -> Vec<ObjectKind> {
    if what.contains("proxy neighbour") {
        return vec![ObjectKind::Neighbour];
    }
    if what.contains("unusable netns") {
        return vec![ObjectKind::Netns];
    }
    let body = what.split_once(": ").map_or(what, |(_, b)| b);
    let mut out = Vec::new();
    for part in body.split("; ") {
        if part.starts_with("table ") {
            out.push(ObjectKind::of_nft_difference(part));
            continue;
        }
        let kind = if part.contains("elements") {
            ObjectKind::NftSet
        } else if part.contains("stale addresses") || part.ends_with(" addresses") {
            ObjectKind::Address
        } else if part.contains("neighbour") {
            ObjectKind::Neighbour
        } else if part.starts_with("sysctls")
            || part.contains("disable_ipv6")
            || part.contains("router advertisements")
        {
            ObjectKind::Sysctl
        } else if part.contains("mtu/up")
            || part.ends_with(" mac")
            || part.contains("addrgenmode")
            || part.starts_with("lo up")
            || part.contains("tap ")
            || part.contains("veth ")
        {
            ObjectKind::Link
        } else {
            ObjectKind::Other
        };
        out.push(kind);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::Side;
    use super::*;
    use ObjectKind as K;

    fn repair(what: &str) -> Vec<ObjectKind> {
        Change::Repair { what: what.into() }.kinds()
    }

    #[test]
    fn each_producers_line_names_its_kinds() {
        assert_eq!(
            repair("host: add proxy neighbour 203.0.113.50 dev uplink"),
            [K::Neighbour]
        );
        assert_eq!(repair("vmn0005: unusable netns (EINVAL)"), [K::Netns]);
        assert_eq!(
            repair("vmn0005: tap vmt0005 missing, made again"),
            [K::Link]
        );
        assert_eq!(
            repair("vmn0005: veth vmh0005/vmp0005 lost its host end, made again"),
            [K::Link]
        );
        assert_eq!(
            repair("vmn0005: vmp0005 mtu/up; vmh0005 addresses; vmh0005 neighbour fe80::2"),
            [K::Link, K::Address, K::Neighbour]
        );
        assert_eq!(
            repair("vmn0005: vmp0005 stale addresses fe80::402:ff:fe00:7/64; vmp0005 addrgenmode"),
            [K::Link, K::Address]
        );
        assert_eq!(
            repair("vmn0005: sysctls net/ipv4/ip_forward; lo up"),
            [K::Link, K::Sysctl]
        );
        assert_eq!(
            repair(
                "host: public IPv4 elements: have None (dnat4 ours: false), want Some(198.51.100.81)"
            ),
            [K::NftSet]
        );
        assert_eq!(
            repair(
                "sbhost: table ip vm_host: chain postrouting has 0 rules, 1 planned, the first difference at rule 0"
            ),
            [K::NftRule]
        );
        assert_eq!(
            repair(
                "sbhost: uplinks uplink ignore router advertisements (accept_ra 1 with forwarding on)"
            ),
            [K::Sysctl]
        );
        assert_eq!(repair("something new"), [K::Other]);
    }

    #[test]
    fn variants_and_nft_differences_name_their_kinds() {
        let nft = Change::ReplaceNft {
            fingerprint: "f".into(),
            differences: vec![
                "table inet vm is missing".into(),
                "table inet vm: chain postrouting has 1 rules, 2 planned, the first difference at rule 0".into(),
                "table inet vm: chain input is `policy drop`, planned `policy accept`".into(),
                "table inet vm: set allowed has 1 elements, 2 planned".into(),
            ],
        };
        assert_eq!(
            nft.kinds(),
            [K::NftTable, K::NftChain, K::NftRule, K::NftSet]
        );
        assert_eq!(Change::AddRoute(Side::Host, "x".into()).kinds(), [K::Route]);
        assert_eq!(Change::DelRule(Side::Vm, "x".into()).kinds(), [K::Rule]);
        let tc = |w: &str| {
            Change::Tc {
                dev: "d".into(),
                what: w.into(),
            }
            .kinds()
        };
        assert_eq!(tc("add htb root 1: (default: unshaped)"), [K::TcQdisc]);
        assert_eq!(tc("add class Private at 100 MiB/s"), [K::TcClass]);
        assert_eq!(tc("add filter 10.0.0.0/8 -> 10"), [K::TcFilter]);
        let guard = |w: &str| {
            Change::Guard {
                dev: "t".into(),
                what: w.into(),
            }
            .kinds()
        };
        assert_eq!(
            guard("vmt0005 has no guard filter: attached program 7"),
            [K::TcFilter]
        );
        assert_eq!(guard("entry of vmt0005: written"), [K::BpfMap]);
    }
}
