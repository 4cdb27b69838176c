//! A public IPv4 added to or removed from a VM as one nf_tables batch over netlink: the VM
//! table's DNAT chain ([`vmnet_plan::ns::public::NS_DNAT_CHAIN`]) flushed and, when the VM has
//! a public IPv4, its one rule written anew, on the netns's kept netfilter socket (no
//! libnftables context, no listing).
//!
//! # Design
//! The rule `iifname <peer> ip daddr <transit> dnat ip to 172.16.0.2` is encoded as nft 1.0.6
//! encodes it from the plan's JSON (checked with `nft --debug=netlink`), so the table lists
//! back exactly as the plan says:
//! - `meta load iifname => reg 1`, `cmp eq reg 1 <name, zero-padded to 16 bytes>`;
//! - `meta load nfproto => reg 1`, `cmp eq reg 1 2` (the `ip` of `ip daddr` in an inet table);
//! - `payload load 4b @ network header + 16 => reg 1`, `cmp eq reg 1 <transit>`;
//! - `immediate reg 1 <guest>`, `nat dnat ip addr_min reg 1`.

use std::net::Ipv4Addr;

use netlink_packet_core::{DefaultNla, NLM_F_APPEND, NLM_F_CREATE, NLM_F_REQUEST};
use netlink_packet_netfilter::nftables::{
    DataAttribute, Expressions, Immediate, MetaKey, NfTablesMessage, Operator, Register,
};
use netlink_packet_netfilter::{NetfilterMessageInner, NetfilterProtoFamily};
use vmnet_plan::ns::public::NS_DNAT_CHAIN;

use super::fwbatch::{Expr, NETWORK_HEADER, NFPROTO_IPV4, cmp, meta, payload, rule_message};
use crate::nfnl::{NetfilterError, NfnlSocket};

/// `IFNAMSIZ`: nft compares an interface name as this many bytes.
const IFNAMSIZ: usize = 16;
/// `NFTA_NAT_TYPE`, `NFTA_NAT_FAMILY`, `NFTA_NAT_REG_ADDR_MIN`.
const NFTA_NAT_TYPE: u16 = 1;
const NFTA_NAT_FAMILY: u16 = 2;
const NFTA_NAT_REG_ADDR_MIN: u16 = 3;
/// `NFT_NAT_DNAT`.
const NFT_NAT_DNAT: u32 = 1;
/// `NFT_REG_1`.
const NFT_REG_1: u32 = 1;

/// The DNAT rule's expressions (see the module docs).
fn expressions(peer: &str, transit: Ipv4Addr, guest: Ipv4Addr) -> Vec<Expr> {
    let mut name = peer.as_bytes().to_vec();
    name.resize(IFNAMSIZ, 0);
    let be = |v: u32| v.to_be_bytes().to_vec();
    vec![
        meta(MetaKey::Iifname),
        cmp(Operator::Equal, name),
        meta(MetaKey::Nfproto),
        cmp(Operator::Equal, vec![NFPROTO_IPV4]),
        payload(NETWORK_HEADER, 16, 4),
        cmp(Operator::Equal, transit.octets().to_vec()),
        Expressions::Immediate(vec![
            Immediate::DestinationRegister(Register::Reg1),
            Immediate::Data(DataAttribute::Value(guest.octets().to_vec())),
        ])
        .into(),
        Expressions::Other {
            expression_type: "nat".into(),
            attributes: vec![
                DefaultNla::new(NFTA_NAT_TYPE, be(NFT_NAT_DNAT)),
                DefaultNla::new(NFTA_NAT_FAMILY, be(u32::from(NFPROTO_IPV4))),
                DefaultNla::new(NFTA_NAT_REG_ADDR_MIN, be(NFT_REG_1)),
            ],
        }
        .into(),
    ]
}

/// The plan's DNAT chain: `None` without one (a VM without a veth or without NAT), else its
/// rule, `Some((peer veth, transit address))` for a VM with a public IPv4.
pub(super) fn planned(plan: &vmnet_plan::ns::VmPlan) -> Option<Option<(&str, Ipv4Addr)>> {
    let v = plan.veth.as_ref().filter(|_| plan.nat)?;
    Some(
        plan.public
            .as_ref()
            .is_some_and(|p| p.ipv4.is_some())
            .then(|| (v.peer_name.as_str(), v.peer_ipv4.addr())),
    )
}

/// The messages that make the DNAT chain of table `inet <table>` hold the rule for
/// `dnat = Some((peer veth, transit address))`, or nothing.
pub(super) fn messages(
    table: &str,
    dnat: Option<(&str, Ipv4Addr)>,
) -> Vec<(NetfilterProtoFamily, NetfilterMessageInner, u16)> {
    let mut msgs = vec![(
        NetfilterProtoFamily::Inet,
        NfTablesMessage::DeleteRule(rule_message(table, NS_DNAT_CHAIN, None)).into(),
        NLM_F_REQUEST,
    )];
    if let Some((peer, transit)) = dnat {
        let expr = expressions(peer, transit, vmnet_plan::ns::GUEST_IPV4);
        msgs.push((
            NetfilterProtoFamily::Inet,
            NfTablesMessage::NewRule(rule_message(table, NS_DNAT_CHAIN, Some(expr))).into(),
            NLM_F_REQUEST | NLM_F_CREATE | NLM_F_APPEND,
        ));
    }
    msgs
}

/// Makes the DNAT chain of table `inet <table>` of the socket's namespace hold the rule of
/// `dnat` (or none), in one transaction ([`messages`]).
///
/// # Errors
/// The kernel refusing the batch (nothing committed), or the socket failing.
pub(super) fn replace(
    sock: &mut NfnlSocket,
    table: &str,
    dnat: Option<(&str, Ipv4Addr)>,
) -> Result<(), NetfilterError> {
    sock.transaction(
        messages(table, dnat),
        &format!("replace the public DNAT rule of {table}"),
    )
}

#[cfg(test)]
mod tests {
    use netlink_packet_netfilter::nftables::{ExpressionAttribute, ListAttribute};

    use super::*;

    fn names(expr: &[Expr]) -> Vec<String> {
        expr.iter()
            .filter_map(|e| match e {
                ListAttribute::Element(a) => a.iter().find_map(|x| match x {
                    ExpressionAttribute::Name(n) => Some(n.clone()),
                    _ => None,
                }),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn the_rule_is_encoded_as_nft_encodes_it() {
        let e = expressions(
            "vmnp12",
            "10.200.0.6".parse().unwrap(),
            "172.16.0.2".parse().unwrap(),
        );
        assert_eq!(
            names(&e),
            [
                "meta",
                "cmp",
                "meta",
                "cmp",
                "payload",
                "cmp",
                "immediate",
                "nat"
            ]
        );
        let ListAttribute::Element(a) = &e[1] else {
            panic!("an element")
        };
        let data = a.iter().find_map(|x| match x {
            ExpressionAttribute::Data(Expressions::Cmp(c)) => c.iter().find_map(|y| match y {
                netlink_packet_netfilter::nftables::Cmp::Data(DataAttribute::Value(v)) => {
                    Some(v.clone())
                }
                _ => None,
            }),
            _ => None,
        });
        let mut want = b"vmnp12".to_vec();
        want.resize(16, 0);
        assert_eq!(data, Some(want), "the name is compared as 16 bytes");
    }

    #[test]
    fn the_chain_is_flushed_and_holds_the_rule_or_nothing() {
        assert_eq!(messages("vmn", None).len(), 1);
        let with = messages("vmn", Some(("vmnp12", "10.200.0.6".parse().unwrap())));
        assert_eq!(with.len(), 2);
        assert!(matches!(
            &with[0].1,
            NetfilterMessageInner::NfTables(NfTablesMessage::DeleteRule(_))
        ));
        assert_ne!(with[1].2 & NLM_F_APPEND, 0);
    }
}
