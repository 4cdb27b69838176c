//! Looking single elements of nf_tables sets and maps up over netlink, in process: one
//! `NFT_MSG_GETSETELEM` request per key (not a dump), with the message types of
//! `netlink-packet-netfilter`.
//!
//! # Why not `nft get element`
//! libnftables 1.0.6 answers `get element` from its cache, and fills that cache with the
//! elements of *every* set of the ruleset first: with 1,000 VMs' public mappings in the host
//! table one lookup cost ~15 ms and grew with every VM. The kernel answers a keyed
//! `GETSETELEM` from the set's own lookup, so a read here costs the same at 10 or 10,000
//! elements.

use netlink_packet_core::{NLM_F_ACK, NLM_F_REQUEST};
use netlink_packet_netfilter::nftables::{
    DataAttribute, ListAttribute, NfTablesMessage, SetElementAttribute, SetElementList,
    SetElementMessage,
};
use netlink_packet_netfilter::{NetfilterMessageInner, NetfilterProtoFamily};

use crate::nfnl::NfnlSocket;

/// Errors of an element lookup.
pub type NftElemError = crate::nfnl::NetfilterError;

/// A netlink socket for element lookups in the network namespace of the thread that opened it.
pub struct ElementReader(NfnlSocket);

impl ElementReader {
    /// Opens the socket (in the calling thread's network namespace).
    ///
    /// # Errors
    /// [`NftElemError::Io`] when the socket cannot be opened.
    pub fn open() -> Result<Self, NftElemError> {
        NfnlSocket::open().map(Self)
    }

    /// The data of the element `key` (raw bytes in network order, e.g. the 4 octets of an
    /// `ipv4_addr`) of map `set` in `table` of `family`: `Some(data)` (empty for a set, which
    /// has no data), `None` when the table, the set or the element does not exist.
    ///
    /// # Errors
    /// When the socket fails, the kernel refuses the request otherwise, or the answer is
    /// unreadable.
    pub fn get(
        &mut self,
        family: NetfilterProtoFamily,
        table: &str,
        set: &str,
        key: &[u8],
    ) -> Result<Option<Vec<u8>>, NftElemError> {
        let request = SetElementMessage {
            attributes: vec![
                SetElementList::Table(table.to_owned()),
                SetElementList::Set(set.to_owned()),
                SetElementList::Elements(vec![ListAttribute::Element(vec![
                    SetElementAttribute::Key(DataAttribute::Value(key.to_vec())),
                ])]),
            ],
        };
        let seq = self.0.send(
            family,
            NfTablesMessage::GetSetElement(request),
            NLM_F_REQUEST | NLM_F_ACK,
        )?;
        let mut found = None;
        let ok = self
            .0
            .receive(seq, &format!("get element {table} {set}"), |m| {
                if let NetfilterMessageInner::NfTables(NfTablesMessage::NewSetElement(m)) = m {
                    found = Some(element_data(&m));
                }
            })?;
        Ok(found.filter(|_| ok))
    }
}

/// The data of the (single) element of an answer; empty when it carries none (a set).
fn element_data(m: &SetElementMessage) -> Vec<u8> {
    m.attributes
        .iter()
        .filter_map(|a| match a {
            SetElementList::Elements(list) => Some(list),
            _ => None,
        })
        .flatten()
        .filter_map(|e| match e {
            ListAttribute::Element(attrs) => Some(attrs),
            _ => None,
        })
        .flatten()
        .find_map(|a| match a {
            SetElementAttribute::Data(DataAttribute::Value(v)) => Some(v.clone()),
            _ => None,
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_data_of_an_answer_is_its_value() {
        let m = SetElementMessage {
            attributes: vec![
                SetElementList::Table("t".into()),
                SetElementList::Elements(vec![ListAttribute::Element(vec![
                    SetElementAttribute::Key(DataAttribute::Value(vec![10, 0, 0, 1])),
                    SetElementAttribute::Data(DataAttribute::Value(vec![203, 0, 113, 5])),
                ])]),
            ],
        };
        assert_eq!(element_data(&m), vec![203, 0, 113, 5]);
        let set = SetElementMessage {
            attributes: vec![SetElementList::Elements(vec![ListAttribute::Element(
                vec![SetElementAttribute::Key(DataAttribute::Value(vec![1; 4]))],
            )])],
        };
        assert!(element_data(&set).is_empty());
    }
}
