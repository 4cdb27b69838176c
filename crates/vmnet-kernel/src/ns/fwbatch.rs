//! A firewall change of the same shape as one nf_tables element batch over netlink: the
//! elements of the VM table's twelve firewall sets flushed and written anew, in one
//! transaction, on the netns's kept netfilter socket (no libnftables context, no listing).
//!
//! # Design
//! - Key encoding as the kernel stores it: each field of a concatenation takes a multiple of
//!   4 bytes (an address 4 or 16, the IP protocol 1 byte then 3 zero, a port 2 bytes in network
//!   order then 2 zero).
//! - `…_proto` and `…_port` are concatenations with intervals: each element carries its first
//!   key (`NFTA_SET_ELEM_KEY`) and its last (`NFTA_SET_ELEM_KEY_END`), as nft sends them.
//! - `…_any` is a single-field interval set: a prefix is a start element (its network address)
//!   and an end element one past its last address, flagged `NFT_SET_ELEM_INTERVAL_END` (none
//!   when the prefix reaches the top of the address space), as nft sends them.
//! - Per set: `NFT_MSG_DELSETELEM` without elements (the kernel flushes the set), then
//!   `NFT_MSG_NEWSETELEM` with the new elements (none for an empty set).

use std::net::IpAddr;

use ipnet::IpNet;
use netlink_packet_core::{DefaultNla, NLM_F_CREATE, NLM_F_REQUEST};
use netlink_packet_netfilter::nftables::{
    DataAttribute, ListAttribute, NfTablesMessage, SetElementAttribute, SetElementFlags,
    SetElementList, SetElementMessage,
};
use netlink_packet_netfilter::{NetfilterMessageInner, NetfilterProtoFamily};
use vmnet_plan::ns::firewall::sets::{FwElement, FwSet, FwSetKind};

use crate::nfnl::{NetfilterError, NfnlSocket};

/// `NFTA_DATA_VALUE`, the value inside `NFTA_SET_ELEM_KEY_END`.
const NFTA_DATA_VALUE: u16 = 1;

/// One element as sent: its key, its closing key (concatenations) and whether it ends an
/// interval (single-field interval sets).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Encoded {
    pub key: Vec<u8>,
    pub key_end: Option<Vec<u8>>,
    pub interval_end: bool,
}

fn addr_bytes(a: IpAddr) -> Vec<u8> {
    match a {
        IpAddr::V4(v) => v.octets().to_vec(),
        IpAddr::V6(v) => v.octets().to_vec(),
    }
}

/// The address one past `a`, or `None` at the top of its family.
fn next_addr(a: IpAddr) -> Option<IpAddr> {
    match a {
        IpAddr::V4(v) => u32::from(v).checked_add(1).map(|n| IpAddr::V4(n.into())),
        IpAddr::V6(v) => u128::from(v).checked_add(1).map(|n| IpAddr::V6(n.into())),
    }
}

/// The concatenated key of a `proto`/`port` element at its first (`last == false`) or last
/// values.
fn concat_key(e: &FwElement, last: bool) -> Vec<u8> {
    let p: IpNet = e.prefix;
    let mut key = addr_bytes(if last { p.broadcast() } else { p.network() });
    key.extend([e.l4proto.unwrap_or(0), 0, 0, 0]);
    if let Some(r) = e.ports {
        key.extend((if last { r.last } else { r.first }).to_be_bytes());
        key.extend([0, 0]);
    }
    key
}

/// The elements of one set as the kernel takes them.
pub(super) fn encode(set: &FwSet) -> Vec<Encoded> {
    let mut out = Vec::new();
    for e in &set.elements {
        match set.kind {
            FwSetKind::Any => {
                out.push(Encoded {
                    key: addr_bytes(e.prefix.network()),
                    key_end: None,
                    interval_end: false,
                });
                if let Some(end) = next_addr(e.prefix.broadcast()) {
                    out.push(Encoded {
                        key: addr_bytes(end),
                        key_end: None,
                        interval_end: true,
                    });
                }
            }
            FwSetKind::Proto | FwSetKind::Port => out.push(Encoded {
                key: concat_key(e, false),
                key_end: Some(concat_key(e, true)),
                interval_end: false,
            }),
        }
    }
    out
}

fn element(e: Encoded) -> ListAttribute<SetElementAttribute> {
    let mut attrs = vec![SetElementAttribute::Key(DataAttribute::Value(e.key))];
    if let Some(end) = e.key_end {
        attrs.push(SetElementAttribute::KeyEnd(vec![DefaultNla::new(
            NFTA_DATA_VALUE,
            end,
        )]));
    }
    if e.interval_end {
        attrs.push(SetElementAttribute::Flags(SetElementFlags::IntervalEnd));
    }
    ListAttribute::Element(attrs)
}

/// The messages that flush each of `sets` in table `inet <table>` and write its elements.
pub(super) fn messages(
    table: &str,
    sets: &[FwSet],
) -> Vec<(NetfilterProtoFamily, NetfilterMessageInner, u16)> {
    let mut msgs = Vec::new();
    for set in sets {
        let head = || {
            vec![
                SetElementList::Table(table.to_owned()),
                SetElementList::Set(set.name.clone()),
            ]
        };
        msgs.push((
            NetfilterProtoFamily::Inet,
            NfTablesMessage::DeleteSetElement(SetElementMessage { attributes: head() }).into(),
            NLM_F_REQUEST,
        ));
        let elements: Vec<_> = encode(set).into_iter().map(element).collect();
        if elements.is_empty() {
            continue;
        }
        let mut attributes = head();
        attributes.push(SetElementList::Elements(elements));
        msgs.push((
            NetfilterProtoFamily::Inet,
            NfTablesMessage::NewSetElement(SetElementMessage { attributes }).into(),
            NLM_F_REQUEST | NLM_F_CREATE,
        ));
    }
    msgs
}

/// Replaces the elements of `sets` in table `inet <table>` of the socket's namespace in one
/// transaction.
///
/// # Errors
/// The kernel refusing the batch (nothing committed), or the socket failing.
pub(super) fn replace(
    sock: &mut NfnlSocket,
    table: &str,
    sets: &[FwSet],
) -> Result<(), NetfilterError> {
    sock.transaction(
        messages(table, sets),
        &format!("replace the firewall elements of {table}"),
    )
}

#[cfg(test)]
mod tests {
    use vmnet_model::vm::firewall::PortRange;

    use super::*;

    fn set(kind: FwSetKind, elements: Vec<FwElement>) -> FwSet {
        FwSet {
            name: "fw_in4_x".into(),
            v4: true,
            kind,
            elements,
        }
    }

    fn el(p: &str, l4proto: Option<u8>, ports: Option<(u16, u16)>) -> FwElement {
        FwElement {
            prefix: p.parse().unwrap(),
            l4proto,
            ports: ports.map(|(first, last)| PortRange { first, last }),
        }
    }

    #[test]
    fn a_prefix_is_a_start_and_an_end_one_past_it() {
        let got = encode(&set(
            FwSetKind::Any,
            vec![
                el("10.1.0.0/16", None, None),
                el("255.255.255.0/24", None, None),
            ],
        ));
        assert_eq!(
            got,
            vec![
                Encoded {
                    key: vec![10, 1, 0, 0],
                    key_end: None,
                    interval_end: false
                },
                Encoded {
                    key: vec![10, 2, 0, 0],
                    key_end: None,
                    interval_end: true
                },
                // The top of the address space has no end element.
                Encoded {
                    key: vec![255, 255, 255, 0],
                    key_end: None,
                    interval_end: false
                },
            ]
        );
        let v6 = encode(&set(
            FwSetKind::Any,
            vec![el("2001:db8::1/128", None, None)],
        ));
        assert_eq!(v6.len(), 2);
        assert_eq!(v6[1].key[15], 2);
        assert!(v6[1].interval_end);
    }

    #[test]
    fn concatenations_pad_each_field_to_four_bytes_and_carry_their_last_key() {
        let got = encode(&set(
            FwSetKind::Port,
            vec![el("203.0.113.0/24", Some(6), Some((8000, 8100)))],
        ));
        assert_eq!(
            got,
            vec![Encoded {
                key: vec![203, 0, 113, 0, 6, 0, 0, 0, 0x1f, 0x40, 0, 0],
                key_end: Some(vec![203, 0, 113, 255, 6, 0, 0, 0, 0x1f, 0xa4, 0, 0]),
                interval_end: false,
            }]
        );
        let proto = encode(&set(FwSetKind::Proto, vec![el("::/0", Some(58), None)]));
        assert_eq!(proto[0].key.len(), 20);
        assert_eq!(proto[0].key[16], 58);
        assert_eq!(proto[0].key_end.as_ref().unwrap()[..16], [0xff; 16]);
    }

    #[test]
    fn each_set_is_flushed_then_written_and_an_empty_one_only_flushed() {
        let sets = [
            set(FwSetKind::Any, vec![]),
            set(FwSetKind::Proto, vec![el("10.0.0.0/8", Some(1), None)]),
        ];
        let kinds: Vec<&str> = messages("vmn", &sets)
            .iter()
            .map(|(_, m, _)| match m {
                NetfilterMessageInner::NfTables(NfTablesMessage::DeleteSetElement(_)) => "flush",
                NetfilterMessageInner::NfTables(NfTablesMessage::NewSetElement(_)) => "add",
                _ => "other",
            })
            .collect();
        assert_eq!(kinds, ["flush", "flush", "add"]);
    }
}
