//! The little of a notification the watcher reads: the netlink header (type) and the one or two
//! attributes that say what the change touched (an interface's index or name, a routing table,
//! a proxy flag, an nf_tables table's family and name). Plain bytes in, plain data out.

/// What kind of object a notification is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// A link (`RTM_NEWLINK`/`RTM_DELLINK`).
    Link,
    /// An IPv4 or IPv6 address.
    Addr,
    /// An IPv4 or IPv6 route.
    Route,
    /// An IPv4 or IPv6 routing rule.
    Rule,
    /// A neighbour entry (a proxy entry has [`Note::proxy`]).
    Neigh,
    /// A tc qdisc, class or filter (BPF attachments included).
    Tc,
    /// An nf_tables table, chain, rule, set, element or object.
    Nft,
}

impl Kind {
    /// The name in logs and counters.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Link => "link",
            Self::Addr => "addr",
            Self::Route => "route",
            Self::Rule => "rule",
            Self::Neigh => "neigh",
            Self::Tc => "tc",
            Self::Nft => "nft",
        }
    }
}

/// One notification, as far as the watcher reads it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Note {
    /// The object kind (`None`: a message the watcher does not attribute, e.g. a new
    /// nf_tables generation).
    pub kind: Option<Kind>,
    /// The interface the object belongs to (link, address, route's output, neighbour, tc).
    pub ifindex: Option<u32>,
    /// The interface name (a link's own, a rule's input interface).
    pub ifname: Option<String>,
    /// The routing table of a route or rule.
    pub table: Option<u32>,
    /// A neighbour entry with `NTF_PROXY`.
    pub proxy: bool,
    /// A neighbour entry in state `NUD_PERMANENT` (made by hand or by vmnet, never learned).
    pub permanent: bool,
    /// An nf_tables object's table: its family (`NFPROTO_*`) and name.
    pub nft_table: Option<(u8, String)>,
}

const NLMSG_HDRLEN: usize = 16;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_NEWGEN: u16 = 15;
const NTF_PROXY: u8 = 0x08;
const NUD_PERMANENT: u16 = 0x80;

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

const fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// The messages of one datagram: (type, payload after the header).
fn messages(buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    let mut at = 0;
    std::iter::from_fn(move || {
        let len = usize::try_from(u32_at(buf, at)?).ok()?;
        if len < NLMSG_HDRLEN || at + len > buf.len() {
            return None;
        }
        let ty = u16_at(buf, at + 4)?;
        let body = &buf[at + NLMSG_HDRLEN..at + len];
        at += align4(len);
        Some((ty, body))
    })
}

/// The attributes after a fixed header of `fixed` bytes: (type without flags, value).
fn attrs(body: &[u8], fixed: usize) -> impl Iterator<Item = (u16, &[u8])> {
    let mut at = fixed;
    std::iter::from_fn(move || {
        let len = usize::from(u16_at(body, at)?);
        if len < 4 || at + len > body.len() {
            return None;
        }
        let ty = u16_at(body, at + 2)? & 0x3fff;
        let val = &body[at + 4..at + len];
        at += align4(len);
        Some((ty, val))
    })
}

fn string(v: &[u8]) -> String {
    let end = v.iter().position(|b| *b == 0).unwrap_or(v.len());
    String::from_utf8_lossy(&v[..end]).into_owned()
}

fn attr_u32(v: &[u8]) -> Option<u32> {
    u32_at(v, 0)
}

/// The notifications of one datagram from a `NETLINK_ROUTE` socket.
#[must_use]
pub fn route_notes(buf: &[u8]) -> Vec<Note> {
    messages(buf)
        .filter(|(ty, _)| *ty != NLMSG_ERROR && *ty != NLMSG_DONE)
        .map(|(ty, body)| route_note(ty, body))
        .collect()
}

fn route_note(ty: u16, body: &[u8]) -> Note {
    let mut n = Note::default();
    match ty {
        // RTM_NEWLINK, RTM_DELLINK: ifinfomsg (16 bytes); IFLA_IFNAME = 3.
        16 | 17 => {
            n.kind = Some(Kind::Link);
            n.ifindex = u32_at(body, 4);
            n.ifname = attrs(body, 16)
                .find(|(t, _)| *t == 3)
                .map(|(_, v)| string(v));
        }
        // RTM_NEWADDR, RTM_DELADDR: ifaddrmsg (8 bytes), index at 4.
        20 | 21 => {
            n.kind = Some(Kind::Addr);
            n.ifindex = u32_at(body, 4);
        }
        // RTM_NEWROUTE, RTM_DELROUTE: rtmsg (12 bytes), table at 4; RTA_OIF = 4, RTA_TABLE = 15.
        24 | 25 => {
            n.kind = Some(Kind::Route);
            n.table = body.get(4).map(|t| u32::from(*t));
            for (t, v) in attrs(body, 12) {
                match t {
                    4 => n.ifindex = attr_u32(v),
                    15 => n.table = attr_u32(v),
                    _ => {}
                }
            }
        }
        // RTM_NEWNEIGH, RTM_DELNEIGH: ndmsg (12 bytes), ifindex at 4, flags at 10.
        28 | 29 => {
            n.kind = Some(Kind::Neigh);
            n.ifindex = u32_at(body, 4);
            n.proxy = body.get(10).is_some_and(|f| f & NTF_PROXY != 0);
            n.permanent = u16_at(body, 8).is_some_and(|st| st & NUD_PERMANENT != 0);
        }
        // RTM_NEWRULE, RTM_DELRULE: fib_rule_hdr (12 bytes), table at 4; FRA_IIFNAME = 3,
        // FRA_TABLE = 15.
        32 | 33 => {
            n.kind = Some(Kind::Rule);
            n.table = body.get(4).map(|t| u32::from(*t));
            for (t, v) in attrs(body, 12) {
                match t {
                    3 => n.ifname = Some(string(v)),
                    15 => n.table = attr_u32(v),
                    _ => {}
                }
            }
        }
        // Qdiscs, classes, filters and tc chains (RTM_NEWQDISC … RTM_GETCHAIN): tcmsg, ifindex
        // at 4.
        36..=47 | 100..=102 => {
            n.kind = Some(Kind::Tc);
            n.ifindex = u32_at(body, 4);
        }
        _ => {}
    }
    n
}

/// The notifications of one datagram from a `NETLINK_NETFILTER` socket in `NFNLGRP_NFTABLES`.
#[must_use]
pub fn nft_notes(buf: &[u8]) -> Vec<Note> {
    messages(buf)
        .filter(|(ty, _)| ty >> 8 == NFNL_SUBSYS_NFTABLES && ty & 0xff != NFT_MSG_NEWGEN)
        .map(|(_, body)| Note {
            kind: Some(Kind::Nft),
            // nfgenmsg (4 bytes): family first; NFTA_*_TABLE (NFTA_TABLE_NAME for a table) = 1
            // in every table, chain, rule, set, element, object and flowtable message.
            nft_table: attrs(body, 4)
                .find(|(t, _)| *t == 1)
                .map(|(_, v)| (body.first().copied().unwrap_or(0), string(v))),
            ..Note::default()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(ty: u16, fixed: &[u8], attrs: &[(u16, &[u8])]) -> Vec<u8> {
        let mut body = fixed.to_vec();
        for (t, v) in attrs {
            let len = u16::try_from(4 + v.len()).unwrap();
            body.extend(len.to_ne_bytes());
            body.extend(t.to_ne_bytes());
            body.extend(*v);
            while !body.len().is_multiple_of(4) {
                body.push(0);
            }
        }
        let len = u32::try_from(16 + body.len()).unwrap();
        let mut m = len.to_ne_bytes().to_vec();
        m.extend(ty.to_ne_bytes());
        m.extend([0u8; 10]);
        m.extend(body);
        m
    }

    #[test]
    fn links_routes_rules_and_proxy_entries_are_attributed() {
        let mut ifi = vec![0u8; 16];
        ifi[4..8].copy_from_slice(&0x3000_0035u32.to_ne_bytes());
        let mut buf = msg(17, &ifi, &[(3, b"vmh0035\0")]);
        let mut rt = vec![0u8; 12];
        rt[4] = 254;
        buf.extend(msg(
            25,
            &rt,
            &[(4, &7u32.to_ne_bytes()), (15, &5000u32.to_ne_bytes())],
        ));
        let rule = vec![0u8; 12];
        buf.extend(msg(33, &rule, &[(3, b"vmh0036\0")]));
        let mut nd = vec![0u8; 12];
        nd[4..8].copy_from_slice(&2u32.to_ne_bytes());
        nd[8..10].copy_from_slice(&NUD_PERMANENT.to_ne_bytes());
        nd[10] = NTF_PROXY;
        buf.extend(msg(29, &nd, &[]));
        let notes = route_notes(&buf);
        assert_eq!(notes.len(), 4);
        assert_eq!(notes[0].kind, Some(Kind::Link));
        assert_eq!(notes[0].ifindex, Some(0x3000_0035));
        assert_eq!(notes[0].ifname.as_deref(), Some("vmh0035"));
        assert_eq!(notes[1].kind, Some(Kind::Route));
        assert_eq!((notes[1].ifindex, notes[1].table), (Some(7), Some(5000)));
        assert_eq!(notes[2].kind, Some(Kind::Rule));
        assert_eq!(notes[2].ifname.as_deref(), Some("vmh0036"));
        assert!(notes[3].proxy && notes[3].permanent && notes[3].kind == Some(Kind::Neigh));
    }

    #[test]
    fn nft_messages_name_their_table_and_generations_are_skipped() {
        let del_rule = (10u16 << 8) | 8;
        let mut buf = msg(del_rule, &[1, 0, 0, 0], &[(1, b"vm_pub\0"), (2, b"c\0")]);
        buf.extend(msg((10 << 8) | NFT_MSG_NEWGEN, &[0; 4], &[(1, &[0; 4])]));
        buf.extend(msg(10 << 8 | 2, &[7, 0, 0, 0], &[(1, b"bcd_instances\0")]));
        let notes = nft_notes(&buf);
        assert_eq!(notes.len(), 2);
        assert_eq!(notes[0].nft_table, Some((1, "vm_pub".into())));
        assert_eq!(notes[1].nft_table, Some((7, "bcd_instances".into())));
    }

    #[test]
    fn truncated_input_yields_what_is_whole() {
        let ifi = vec![0u8; 16];
        let mut buf = msg(16, &ifi, &[(3, b"x\0")]);
        buf.extend([40, 0, 0, 0, 16, 0]);
        assert_eq!(route_notes(&buf).len(), 1);
        assert!(route_notes(&[1, 2, 3]).is_empty());
    }
}
