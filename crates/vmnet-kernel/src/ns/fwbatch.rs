//! A firewall change of the same shape as one nf_tables batch over netlink: the VM table's
//! `fw_in` and `fw_out` flushed and their rules written anew, in one transaction, on the
//! netns's kept netfilter socket (no libnftables context, no listing).
//!
//! # Design
//! - Each rule is encoded as nft 1.0.6 encodes the same rule from the plan's JSON (checked
//!   with `nft --debug=netlink`), so the table lists back exactly as the plan says:
//!   - the family: `meta load nfproto => reg 1`, `cmp eq reg 1 <2 | 10>`;
//!   - the peer prefix: a payload load of the network header at the address's offset (12 or
//!     16 for IPv4 source or destination, 8 or 24 for IPv6). A prefix of whole bytes loads only
//!     those bytes and compares them; any other length (and `/0`) loads the whole address,
//!     masks it (`bitwise`) and compares the network address;
//!   - the protocol: `meta load l4proto => reg 1`, `cmp eq reg 1 <proto>`;
//!   - the port: a payload load of 2 bytes at transport header + 2, then `cmp eq` (one port)
//!     or `cmp gte` and `cmp lte` (a range), in network byte order;
//!   - the verdict: `immediate reg 0 accept` (or `drop`, the chains' last rule).
//! - `NFT_MSG_DELRULE` with a chain and no handle flushes that chain; each `NFT_MSG_NEWRULE`
//!   appends (`NLM_F_APPEND`), so the chains end as the plan orders them.

use std::net::IpAddr;

use netlink_packet_core::{NLM_F_APPEND, NLM_F_CREATE, NLM_F_REQUEST};
use netlink_packet_netfilter::nftables::{
    Bitwise, Cmp, DataAttribute, ExpressionAttribute, Expressions, Immediate, ListAttribute, Meta,
    MetaKey, NfTablesMessage, Operator, Payload, Register, RuleAttribute, RuleMessage, Verdict,
    VerdictAttribute,
};
use netlink_packet_netfilter::{NetfilterMessageInner, NetfilterProtoFamily};
use vmnet_plan::ns::firewall::rules::{CHAIN_IN, CHAIN_OUT, FwRule};

/// `NFT_PAYLOAD_NETWORK_HEADER`.
pub(super) const NETWORK_HEADER: u32 = 1;
/// `NFT_PAYLOAD_TRANSPORT_HEADER`.
const TRANSPORT_HEADER: u32 = 2;
/// `NFPROTO_IPV4`, `NFPROTO_IPV6`.
pub(super) const NFPROTO_IPV4: u8 = 2;
const NFPROTO_IPV6: u8 = 10;
/// `NF_DROP`, `NF_ACCEPT`.
const NF_DROP: u32 = 0;
const NF_ACCEPT: u32 = 1;

pub(super) type Expr = ListAttribute<ExpressionAttribute>;

pub(super) fn meta(key: MetaKey) -> Expr {
    Expressions::Meta(vec![
        Meta::DestinationRegister(Register::Reg1),
        Meta::Key(key),
    ])
    .into()
}

pub(super) fn cmp(op: Operator, data: Vec<u8>) -> Expr {
    Expressions::Cmp(vec![
        Cmp::SourceRegister(Register::Reg1),
        Cmp::Op(op),
        Cmp::Data(DataAttribute::Value(data)),
    ])
    .into()
}

pub(super) fn payload(base: u32, offset: u32, len: u32) -> Expr {
    Expressions::Payload(vec![
        Payload::DestinationRegister(Register::Reg1),
        Payload::Base(base),
        Payload::Offset(offset),
        Payload::Len(len),
    ])
    .into()
}

fn verdict(code: u32) -> Expr {
    Expressions::Immediate(vec![
        Immediate::DestinationRegister(Register::Verdict),
        Immediate::Data(DataAttribute::Verdict(vec![VerdictAttribute::Code(
            Verdict::Other(code),
        )])),
    ])
    .into()
}

/// The expressions of one accept rule (see the module docs).
fn expressions(rule: &FwRule) -> Vec<Expr> {
    let p = rule.prefix;
    let (nfproto, bytes, offset, width) = match (p.network(), rule.peer_is_source()) {
        (IpAddr::V4(a), true) => (NFPROTO_IPV4, a.octets().to_vec(), 12, 4),
        (IpAddr::V4(a), false) => (NFPROTO_IPV4, a.octets().to_vec(), 16, 4),
        (IpAddr::V6(a), true) => (NFPROTO_IPV6, a.octets().to_vec(), 8, 16),
        (IpAddr::V6(a), false) => (NFPROTO_IPV6, a.octets().to_vec(), 24, 16),
    };
    let len = p.prefix_len();
    let mut out = vec![meta(MetaKey::Nfproto), cmp(Operator::Equal, vec![nfproto])];
    if len > 0 && len.is_multiple_of(8) {
        out.push(payload(NETWORK_HEADER, offset, u32::from(len / 8)));
        out.push(cmp(Operator::Equal, bytes[..usize::from(len / 8)].to_vec()));
    } else {
        let mask: Vec<u8> = match p.netmask() {
            IpAddr::V4(m) => m.octets().to_vec(),
            IpAddr::V6(m) => m.octets().to_vec(),
        };
        out.push(payload(NETWORK_HEADER, offset, width));
        out.push(
            Expressions::Bitwise(vec![
                Bitwise::SourceRegister(Register::Reg1),
                Bitwise::DestinationRegister(Register::Reg1),
                Bitwise::Length(width),
                Bitwise::Mask(DataAttribute::Value(mask)),
                Bitwise::Xor(DataAttribute::Value(vec![0; bytes.len()])),
            ])
            .into(),
        );
        out.push(cmp(Operator::Equal, bytes));
    }
    if let Some(proto) = rule.l4proto {
        out.push(meta(MetaKey::L4Proto));
        out.push(cmp(Operator::Equal, vec![proto]));
        if let Some(r) = rule.ports {
            out.push(payload(TRANSPORT_HEADER, 2, 2));
            if r.first == r.last {
                out.push(cmp(Operator::Equal, r.first.to_be_bytes().to_vec()));
            } else {
                out.push(cmp(
                    Operator::GreatherThanEqual,
                    r.first.to_be_bytes().to_vec(),
                ));
                out.push(cmp(Operator::LessThanEqual, r.last.to_be_bytes().to_vec()));
            }
        }
    }
    out.push(verdict(NF_ACCEPT));
    out
}

pub(super) fn rule_message(table: &str, chain: &str, expr: Option<Vec<Expr>>) -> RuleMessage {
    let mut attributes = vec![
        RuleAttribute::Table(table.to_owned()),
        RuleAttribute::Chain(chain.to_owned()),
    ];
    if let Some(expr) = expr {
        attributes.push(RuleAttribute::Expressions(expr));
    }
    RuleMessage { attributes }
}

/// The messages that make `fw_in` and `fw_out` of table `inet <table>` hold `rules` (each
/// chain flushed, its rules appended in order, then its `drop`).
pub(super) fn messages(
    table: &str,
    rules: &[FwRule],
) -> Vec<(NetfilterProtoFamily, NetfilterMessageInner, u16)> {
    let mut msgs = Vec::new();
    for chain in [CHAIN_IN, CHAIN_OUT] {
        msgs.push((
            NetfilterProtoFamily::Inet,
            NfTablesMessage::DeleteRule(rule_message(table, chain, None)).into(),
            NLM_F_REQUEST,
        ));
        let exprs = rules
            .iter()
            .filter(|r| r.chain() == chain)
            .map(expressions)
            .chain(std::iter::once(vec![verdict(NF_DROP)]));
        for expr in exprs {
            msgs.push((
                NetfilterProtoFamily::Inet,
                NfTablesMessage::NewRule(rule_message(table, chain, Some(expr))).into(),
                NLM_F_REQUEST | NLM_F_CREATE | NLM_F_APPEND,
            ));
        }
    }
    msgs
}

#[cfg(test)]
mod tests {
    use vmnet_model::vm::firewall::PortRange;
    use vmnet_plan::ns::firewall::FlowDirection;

    use super::*;

    fn rule(dir: FlowDirection, p: &str, l4: Option<u8>, ports: Option<(u16, u16)>) -> FwRule {
        FwRule {
            direction: dir,
            prefix: p.parse().unwrap(),
            l4proto: l4,
            ports: ports.map(|(first, last)| PortRange { first, last }),
        }
    }

    /// The expressions' names and, for payloads and comparisons, what they load or compare.
    fn shape(expr: &[Expr]) -> Vec<String> {
        expr.iter()
            .map(|e| {
                let ListAttribute::Element(attrs) = e else {
                    return "?".into();
                };
                attrs
                    .iter()
                    .find_map(|a| match a {
                        ExpressionAttribute::Data(Expressions::Payload(p)) => {
                            let n = |f: fn(&Payload) -> Option<u32>| {
                                p.iter().find_map(f).unwrap_or(u32::MAX)
                            };
                            Some(format!(
                                "payload {}@{}+{}",
                                n(|x| match x {
                                    Payload::Len(v) => Some(*v),
                                    _ => None,
                                }),
                                n(|x| match x {
                                    Payload::Base(v) => Some(*v),
                                    _ => None,
                                }),
                                n(|x| match x {
                                    Payload::Offset(v) => Some(*v),
                                    _ => None,
                                })
                            ))
                        }
                        ExpressionAttribute::Data(Expressions::Cmp(c)) => {
                            c.iter().find_map(|x| match x {
                                Cmp::Data(DataAttribute::Value(v)) => Some(format!("cmp {v:?}")),
                                _ => None,
                            })
                        }
                        ExpressionAttribute::Name(n) if n != "payload" && n != "cmp" => {
                            Some(n.clone())
                        }
                        _ => None,
                    })
                    .unwrap_or_default()
            })
            .collect()
    }

    #[test]
    fn a_whole_byte_prefix_loads_only_its_bytes() {
        let r = rule(
            FlowDirection::Inbound,
            "10.0.0.0/8",
            Some(6),
            Some((8000, 8100)),
        );
        assert_eq!(
            shape(&expressions(&r)),
            [
                "meta",
                "cmp [2]",
                "payload 1@1+12",
                "cmp [10]",
                "meta",
                "cmp [6]",
                "payload 2@2+2",
                "cmp [31, 64]",
                "cmp [31, 164]",
                "immediate"
            ]
        );
        let one = rule(
            FlowDirection::Outbound,
            "2001:db8::1/128",
            Some(17),
            Some((53, 53)),
        );
        let s = shape(&expressions(&one));
        assert_eq!(s[2], "payload 16@1+24");
        assert_eq!(s[6], "payload 2@2+2");
        assert_eq!(s[7], "cmp [0, 53]");
        assert_eq!(s.len(), 9);
    }

    #[test]
    fn another_prefix_is_masked_and_zero_is_a_prefix_too() {
        for (p, load) in [
            ("192.0.2.128/25", "payload 4@1+12"),
            ("0.0.0.0/0", "payload 4@1+12"),
        ] {
            let r = rule(FlowDirection::Inbound, p, Some(1), None);
            assert_eq!(
                shape(&expressions(&r)),
                [
                    "meta",
                    "cmp [2]",
                    load,
                    "bitwise",
                    &format!(
                        "cmp {:?}",
                        match p {
                            "0.0.0.0/0" => vec![0u8, 0, 0, 0],
                            _ => vec![192, 0, 2, 128],
                        }
                    ),
                    "meta",
                    "cmp [1]",
                    "immediate"
                ],
                "{p}"
            );
        }
        let any6 = rule(FlowDirection::Outbound, "::/0", None, None);
        assert_eq!(
            shape(&expressions(&any6))[..4],
            ["meta", "cmp [10]", "payload 16@1+24", "bitwise"]
        );
    }

    #[test]
    fn each_chain_is_flushed_then_filled_in_order_and_ends_in_drop() {
        let rules = [
            rule(FlowDirection::Inbound, "10.0.0.0/8", None, None),
            rule(FlowDirection::Outbound, "::/0", None, None),
            rule(FlowDirection::Inbound, "192.0.2.0/24", Some(6), None),
        ];
        let kinds: Vec<String> = messages("vmn", &rules)
            .iter()
            .map(|(_, m, flags)| match m {
                NetfilterMessageInner::NfTables(NfTablesMessage::DeleteRule(r)) => {
                    format!("flush {}", chain_of(r))
                }
                NetfilterMessageInner::NfTables(NfTablesMessage::NewRule(r)) => {
                    assert_ne!(flags & NLM_F_APPEND, 0);
                    format!("add {}", chain_of(r))
                }
                _ => "other".into(),
            })
            .collect();
        assert_eq!(
            kinds,
            [
                "flush fw_in",
                "add fw_in",
                "add fw_in",
                "add fw_in",
                "flush fw_out",
                "add fw_out",
                "add fw_out"
            ]
        );
    }

    fn chain_of(r: &RuleMessage) -> String {
        r.attributes
            .iter()
            .find_map(|a| match a {
                RuleAttribute::Chain(c) => Some(c.clone()),
                _ => None,
            })
            .unwrap_or_default()
    }
}
