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

use netlink_packet_core::{NLM_F_ACK, NLM_F_REQUEST, NetlinkMessage, NetlinkPayload};
use netlink_packet_netfilter::nftables::{
    DataAttribute, ListAttribute, NfTablesMessage, SetElementAttribute, SetElementList,
    SetElementMessage,
};
use netlink_packet_netfilter::{
    NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily,
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};

/// Errors of an element lookup.
#[derive(Debug, thiserror::Error)]
pub enum NftElemError {
    /// The netlink socket failed (open, bind, send or receive).
    #[error("nf_tables netlink {op}")]
    Io {
        /// What was attempted.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The kernel refused the lookup with an error other than "no such element".
    #[error("nf_tables get element {set}: the kernel answered {code}")]
    Kernel {
        /// The set or map looked in.
        set: String,
        /// The error as the kernel gave it.
        #[source]
        code: std::io::Error,
    },
    /// A message could not be read.
    #[error("nf_tables netlink: unreadable message: {0}")]
    Decode(String),
}

fn io(op: &'static str) -> impl FnOnce(std::io::Error) -> NftElemError {
    move |source| NftElemError::Io { op, source }
}

/// A netlink socket for element lookups in the network namespace of the thread that opened it.
pub struct ElementReader {
    sock: Socket,
    seq: u32,
    buf: Vec<u8>,
}

impl ElementReader {
    /// Opens the socket (in the calling thread's network namespace).
    ///
    /// # Errors
    /// [`NftElemError::Io`] when the socket cannot be opened.
    pub fn open() -> Result<Self, NftElemError> {
        let mut sock = Socket::new(NETLINK_NETFILTER).map_err(io("open socket"))?;
        sock.bind_auto().map_err(io("bind"))?;
        sock.connect(&SocketAddr::new(0, 0))
            .map_err(io("connect"))?;
        Ok(Self {
            sock,
            seq: 0,
            buf: vec![0; 1 << 16],
        })
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
        self.seq = self.seq.wrapping_add(1);
        let request = SetElementMessage {
            attributes: vec![
                SetElementList::Table(table.to_owned()),
                SetElementList::Set(set.to_owned()),
                SetElementList::Elements(vec![ListAttribute::Element(vec![
                    SetElementAttribute::Key(DataAttribute::Value(key.to_vec())),
                ])]),
            ],
        };
        let mut nl = NetlinkMessage::from(NetfilterMessage::new(
            NetfilterHeader::new(family, 0, 0),
            NfTablesMessage::GetSetElement(request),
        ));
        nl.header.flags = NLM_F_REQUEST | NLM_F_ACK;
        nl.header.sequence_number = self.seq;
        nl.finalize();
        let mut out = vec![0; nl.header.length as usize];
        nl.serialize(&mut out);
        self.sock.send(&out, 0).map_err(io("send"))?;
        self.answer(set)
    }

    /// Reads the answer to the last request: the element's data, then the acknowledgement.
    fn answer(&mut self, set: &str) -> Result<Option<Vec<u8>>, NftElemError> {
        let mut found = None;
        loop {
            let n = self
                .sock
                .recv(&mut &mut self.buf[..], 0)
                .map_err(io("receive"))?;
            let mut off = 0;
            while off < n {
                let msg = NetlinkMessage::<NetfilterMessage>::deserialize(&self.buf[off..n])
                    .map_err(|e| NftElemError::Decode(e.to_string()))?;
                let len = msg.header.length as usize;
                if len == 0 {
                    return Err(NftElemError::Decode("zero-length message".into()));
                }
                off += len;
                if msg.header.sequence_number != self.seq {
                    continue;
                }
                match msg.payload {
                    NetlinkPayload::Error(e) => {
                        let code = e.raw_code();
                        if code == 0 {
                            return Ok(found);
                        }
                        if code == -libc::ENOENT {
                            return Ok(None);
                        }
                        return Err(NftElemError::Kernel {
                            set: set.to_owned(),
                            code: e.to_io(),
                        });
                    }
                    NetlinkPayload::Done(_) => return Ok(found),
                    NetlinkPayload::InnerMessage(NetfilterMessage {
                        inner: NetfilterMessageInner::NfTables(NfTablesMessage::NewSetElement(m)),
                        ..
                    }) => found = Some(element_data(&m)),
                    _ => {}
                }
            }
        }
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
