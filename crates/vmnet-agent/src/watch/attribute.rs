//! Which check a notification asks for: everything in a VM's netns is that VM's; in the host,
//! what names one of vmnet's objects is attributed by that name (a host veth end, its derived
//! ifindex, a VM's routing table, vmnet's nft tables, the uplink carrying its proxy entries),
//! and what names none is another program's business and asks for nothing.

use vmnet_kernel::watch::{Event, Kind, Note, What};
use vmnet_model::vm::MAX_USER_ID;
use vmnet_plan::ns::names::{host_nft_table, pub_nft_table};
use vmnet_plan::ns::{NameKind, parse_uid};

use super::schedule::Target;

/// The derived ifindex bases of a host veth end (`vmnet_kernel::ns` creates it with
/// `base + uid`; the second base when the host has the first index in use).
const HOST_INDEX_BASES: [u32; 2] = [0x3000_0000, 0x3400_0000];

/// What the attribution needs to know of the agent.
#[derive(Debug, Clone)]
pub struct Names {
    /// `--name-prefix`.
    pub prefix: String,
    /// The first per-VM routing table (`host_table_base + uid`).
    pub table_base: u32,
    /// Whether pool mode runs (its tables and taps are in the host namespace).
    pub pool: bool,
    /// The uplink, when vmnet keeps proxy entries on it (`--public-neighbors proxy`).
    pub uplink: Option<String>,
}

fn uid_of_index(index: u32) -> Option<u32> {
    HOST_INDEX_BASES
        .iter()
        .find_map(|b| index.checked_sub(*b).filter(|u| *u <= MAX_USER_ID))
}

impl Names {
    fn uid_of_table(&self, table: u32) -> Option<u32> {
        table
            .checked_sub(self.table_base)
            .filter(|u| *u <= MAX_USER_ID)
    }

    fn host_veth(&self, name: &str) -> Option<u32> {
        parse_uid(&self.prefix, NameKind::HostVeth, name)
    }

    /// The check `ev` asks for, if any.
    #[must_use]
    pub fn target(&self, ev: &Event) -> Option<Target> {
        // Neighbour entries learned from traffic come and go all the time: only permanent
        // entries (the veth ends') and proxy entries are vmnet's.
        if let What::Changed(n) = &ev.what
            && n.kind == Some(Kind::Neigh)
            && !(n.proxy || n.permanent)
        {
            return None;
        }
        if let Some(ns) = &ev.netns {
            return parse_uid(&self.prefix, NameKind::Netns, ns).map(Target::Vm);
        }
        match &ev.what {
            What::Lost => Some(Target::Pass),
            What::Changed(n) => self.host_note(n),
        }
    }

    fn host_note(&self, n: &Note) -> Option<Target> {
        let by_index = n.ifindex.and_then(uid_of_index).map(Target::Vm);
        let by_name = n.ifname.as_deref().and_then(|s| self.host_veth(s));
        let by_table = n.table.and_then(|t| self.uid_of_table(t));
        match n.kind? {
            Kind::Link => {
                if let Some(u) = by_name {
                    return Some(Target::Vm(u));
                }
                // Down, up, carrier: a link set down loses its proxy entries silently.
                if n.ifname.is_some() && n.ifname == self.uplink {
                    return Some(Target::Proxies);
                }
                if self.pool
                    && n.ifname
                        .as_deref()
                        .is_some_and(|s| s.starts_with(vmnet_model::nic::TAP_PREFIX))
                {
                    return Some(Target::PoolTaps);
                }
                None
            }
            Kind::Addr | Kind::Tc => by_index,
            Kind::Route => by_index.or(by_table.map(Target::Vm)),
            Kind::Rule => by_name.or(by_table).map(Target::Vm),
            // A VM's proxy entry sits on the uplink: which VM it was for is not in the message.
            Kind::Neigh if n.proxy => Some(Target::Proxies),
            Kind::Neigh => by_index,
            Kind::Nft => {
                let (_, table) = n.nft_table.as_ref()?;
                if *table == host_nft_table(&self.prefix) {
                    Some(Target::Host)
                } else if *table == pub_nft_table(&self.prefix) {
                    Some(Target::Pass)
                } else if self.pool && table.starts_with("bcd_") {
                    Some(Target::PoolTables)
                } else {
                    None
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Names {
        Names {
            prefix: "vm".into(),
            table_base: 10_000,
            pool: true,
            uplink: Some("uplink".into()),
        }
    }

    fn host(note: Note) -> Event {
        Event {
            netns: None,
            what: What::Changed(note),
            at: std::time::Instant::now(),
        }
    }

    fn note(kind: Kind) -> Note {
        Note {
            kind: Some(kind),
            ..Note::default()
        }
    }

    #[test]
    fn host_changes_to_vmnet_objects_name_their_vm_and_others_ask_for_nothing() {
        let n = names();
        let veth = Note {
            ifname: Some("vmh0035".into()),
            ..note(Kind::Link)
        };
        assert_eq!(n.target(&host(veth)), Some(Target::Vm(0x35)));
        let route = Note {
            ifindex: Some(0x3000_0036),
            table: Some(254),
            ..note(Kind::Route)
        };
        assert_eq!(n.target(&host(route)), Some(Target::Vm(0x36)));
        let table = Note {
            ifindex: Some(2),
            table: Some(10_037),
            ..note(Kind::Route)
        };
        assert_eq!(n.target(&host(table)), Some(Target::Vm(0x25)));
        let foreign_route = Note {
            ifindex: Some(2),
            table: Some(254),
            ..note(Kind::Route)
        };
        assert_eq!(n.target(&host(foreign_route)), None);
        let uplink = Note {
            ifname: Some("eth0".into()),
            ..note(Kind::Link)
        };
        assert_eq!(n.target(&host(uplink)), None, "not the uplink named");
        let uplink = Note {
            ifname: Some("uplink".into()),
            ..note(Kind::Link)
        };
        assert_eq!(n.target(&host(uplink)), Some(Target::Proxies));
        let proxy = Note {
            proxy: true,
            ..note(Kind::Neigh)
        };
        assert_eq!(n.target(&host(proxy)), Some(Target::Proxies));
        let learned = Note {
            ifindex: Some(0x3000_0036),
            ..note(Kind::Neigh)
        };
        assert_eq!(
            n.target(&host(learned.clone())),
            None,
            "learned from traffic"
        );
        let permanent = Note {
            permanent: true,
            ..learned
        };
        assert_eq!(n.target(&host(permanent)), Some(Target::Vm(0x36)));
        let tc = Note {
            ifindex: Some(0x3400_0001),
            ..note(Kind::Tc)
        };
        assert_eq!(n.target(&host(tc)), Some(Target::Vm(1)));
    }

    #[test]
    fn nft_tables_are_told_apart_by_name() {
        let n = names();
        let t = |name: &str| Note {
            nft_table: Some((1, name.into())),
            ..note(Kind::Nft)
        };
        assert_eq!(n.target(&host(t("vm_host"))), Some(Target::Host));
        assert_eq!(n.target(&host(t("vm_pub"))), Some(Target::Pass));
        assert_eq!(n.target(&host(t("bcd_taps"))), Some(Target::PoolTables));
        assert_eq!(n.target(&host(t("firewalld"))), None);
        let no_pool = Names {
            pool: false,
            ..names()
        };
        assert_eq!(no_pool.target(&host(t("bcd_taps"))), None);
    }

    #[test]
    fn everything_in_a_vm_netns_and_lost_notifications_are_checked() {
        let n = names();
        let ev = Event {
            netns: Some("vmn0042".into()),
            what: What::Lost,
            at: std::time::Instant::now(),
        };
        assert_eq!(n.target(&ev), Some(Target::Vm(0x42)));
        let lost = Event { netns: None, ..ev };
        assert_eq!(n.target(&lost), Some(Target::Pass));
    }
}
