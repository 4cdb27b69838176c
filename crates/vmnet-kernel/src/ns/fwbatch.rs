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
//! - Per set, when what the set holds now is known (recorded with the table's generation, see
//!   `gens`): `NFT_MSG_DELSETELEM` with the elements that go, then `NFT_MSG_NEWSETELEM` with
//!   those that come; the elements both hold are not touched. Removing an element of a
//!   concatenated interval set (the kernel's pipapo type) rebuilds that set's lookup tables in
//!   the commit, about 0.1 ms each for a 50-prefix firewall, so a change costs what it changes.
//!   When it is not known: `NFT_MSG_DELSETELEM` without elements (the kernel flushes the set),
//!   then every element.

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
    encode_elements(set.kind, set.elements.iter())
}

/// `elements` of a set of `kind` as the kernel takes them.
fn encode_elements<'a>(
    kind: FwSetKind,
    elements: impl Iterator<Item = &'a FwElement>,
) -> Vec<Encoded> {
    let mut out = Vec::new();
    for e in elements {
        match kind {
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

/// The messages that make the firewall sets of table `inet <table>` hold `sets`. With `old`,
/// what the sets hold now (the same sets, the same shape), only the difference is written: an
/// element of a concatenated interval set costs the kernel a rebuild of the set's lookup table
/// to remove, so the elements both hold stay. Without it, each set is flushed and written whole.
pub(super) fn messages(
    table: &str,
    old: Option<&[FwSet]>,
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
        let with = |elements: Vec<Encoded>| {
            let mut attributes = head();
            attributes.push(SetElementList::Elements(
                elements.into_iter().map(element).collect(),
            ));
            SetElementMessage { attributes }
        };
        let before = old.and_then(|o| o.iter().find(|s| s.name == set.name && s.kind == set.kind));
        let added = match before {
            Some(before) => {
                let gone: Vec<_> = before
                    .elements
                    .iter()
                    .filter(|e| !set.elements.contains(e))
                    .collect();
                if !gone.is_empty() {
                    let m = with(encode_elements(set.kind, gone.into_iter()));
                    msgs.push((
                        NetfilterProtoFamily::Inet,
                        NfTablesMessage::DeleteSetElement(m).into(),
                        NLM_F_REQUEST,
                    ));
                }
                encode_elements(
                    set.kind,
                    set.elements.iter().filter(|e| !before.elements.contains(e)),
                )
            }
            None => {
                // No elements: the kernel flushes the set.
                msgs.push((
                    NetfilterProtoFamily::Inet,
                    NfTablesMessage::DeleteSetElement(SetElementMessage { attributes: head() })
                        .into(),
                    NLM_F_REQUEST,
                ));
                encode(set)
            }
        };
        if !added.is_empty() {
            msgs.push((
                NetfilterProtoFamily::Inet,
                NfTablesMessage::NewSetElement(with(added)).into(),
                NLM_F_REQUEST | NLM_F_CREATE,
            ));
        }
    }
    msgs
}

/// Makes the firewall sets of table `inet <table>` of the socket's namespace hold `sets`, in
/// one transaction ([`messages`]; `old`: what they hold now, when known).
///
/// # Errors
/// The kernel refusing the batch (nothing committed), or the socket failing.
pub(super) fn replace(
    sock: &mut NfnlSocket,
    table: &str,
    old: Option<&[FwSet]>,
    sets: &[FwSet],
) -> Result<(), NetfilterError> {
    sock.transaction(
        messages(table, old, sets),
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
        assert_eq!(
            kinds(&messages("vmn", None, &sets)),
            ["flush", "flush", "add 1"]
        );
    }

    /// Each message's kind, and how many elements it carries.
    fn kinds(msgs: &[(NetfilterProtoFamily, NetfilterMessageInner, u16)]) -> Vec<String> {
        msgs.iter()
            .map(|(_, m, _)| {
                let (what, m) = match m {
                    NetfilterMessageInner::NfTables(NfTablesMessage::DeleteSetElement(m)) => {
                        ("del", m)
                    }
                    NetfilterMessageInner::NfTables(NfTablesMessage::NewSetElement(m)) => {
                        ("add", m)
                    }
                    _ => return "other".to_owned(),
                };
                let n = m.attributes.iter().find_map(|a| match a {
                    SetElementList::Elements(e) => Some(e.len()),
                    _ => None,
                });
                match (what, n) {
                    ("del", None) => "flush".to_owned(),
                    (w, Some(n)) => format!("{w} {n}"),
                    (w, None) => w.to_owned(),
                }
            })
            .collect()
    }

    #[test]
    fn with_the_sets_as_they_are_only_the_difference_is_written() {
        let a = el("10.0.0.0/8", None, None);
        let b = el("192.0.2.0/24", None, None);
        let c = el("198.51.100.0/24", None, None);
        let old = [set(FwSetKind::Any, vec![a, b])];
        // b stays; a goes (its start and end elements), c comes.
        let new = [set(FwSetKind::Any, vec![b, c])];
        assert_eq!(
            kinds(&messages("vmn", Some(&old), &new)),
            ["del 2", "add 2"]
        );
        // Unchanged: nothing to send for the set.
        assert!(messages("vmn", Some(&old), &old).is_empty());
        // Emptied: only the removal.
        let empty = [set(FwSetKind::Any, vec![])];
        assert_eq!(kinds(&messages("vmn", Some(&old), &empty)), ["del 4"]);
    }
}
