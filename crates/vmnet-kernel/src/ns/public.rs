//! Public addresses on the host ([`vmnet_plan::ns::public`]): each VM's elements in the host
//! table `inet <prefix>_pub`, read back by key and changed in one small transaction.
//!
//! # Design
//! A VM's elements are found by what derives from its user id alone (its netns transit
//! address keys `snat4` and `own6`), so reading, changing and removing them costs a few
//! lookups (`get element`) and one transaction whatever the number of VMs, and never touches
//! another VM's elements: an element keyed by a public address is deleted only while it still
//! points at this VM.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use vmnet_plan::ns::VmPlan;
use vmnet_plan::ns::public::{PublicPlan, element_cmd, maps};

use super::driver::NetlinkNsDriver;
use super::{Change, NsError};
use crate::nftelem::ElementReader;
use netlink_packet_netfilter::NetfilterProtoFamily;

/// The elements of one VM found in the host table.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Have {
    /// `snat4[transit]`: the public IPv4.
    pub ipv4: Option<Ipv4Addr>,
    /// Whether `dnat4[ipv4]` points back at this VM's transit address.
    pub dnat4_ours: bool,
    /// `own6[transit]`: the mesh address the VM's IPv6 mapping uses.
    pub mesh: Option<Ipv6Addr>,
    /// `snat6[mesh]`: the mapped public IPv6.
    pub ipv6: Option<Ipv6Addr>,
    /// Whether `dnat6[ipv6]` points back at that mesh address.
    pub dnat6_ours: bool,
}

impl Have {
    /// The public addresses this VM holds on the host now.
    pub(super) fn addresses(&self) -> Vec<IpAddr> {
        let mut v: Vec<IpAddr> = self.ipv4.map(IpAddr::V4).into_iter().collect();
        v.extend(self.ipv6.map(IpAddr::V6));
        v
    }
}

/// What `plan` wants, in the shape of [`Have`].
fn want(p: Option<&PublicPlan>) -> Have {
    let Some(p) = p else {
        return Have::default();
    };
    Have {
        ipv4: p.ipv4,
        dnat4_ours: p.ipv4.is_some(),
        mesh: p.ipv6.map(|_| p.mesh),
        ipv6: p.ipv6,
        dnat6_ours: p.ipv6.is_some(),
    }
}

/// Looks one element up in the calling thread's namespace (a keyed netlink lookup, flat in the
/// number of elements: [`crate::nftelem`]): its value, `None` when the map has no such key (or
/// the table does not exist).
fn get(
    rd: &mut ElementReader,
    label: &str,
    table: &str,
    map: &str,
    key: IpAddr,
) -> Result<Option<IpAddr>, NsError> {
    let key = match key {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    };
    let data = rd
        .get(NetfilterProtoFamily::Inet, table, map, &key)
        .map_err(|e| NsError::Nft {
            netns: label.to_owned(),
            message: format!("get element inet {table} {map}: {e}"),
        })?;
    Ok(data.and_then(|d| address(&d)))
}

/// An address from the raw data of an element (4 or 16 octets).
fn address(data: &[u8]) -> Option<IpAddr> {
    if let Ok(a) = <[u8; 4]>::try_from(data) {
        return Some(IpAddr::V4(Ipv4Addr::from(a)));
    }
    <[u8; 16]>::try_from(data)
        .ok()
        .map(|a| IpAddr::V6(Ipv6Addr::from(a)))
}

fn v4(a: Option<IpAddr>) -> Option<Ipv4Addr> {
    match a {
        Some(IpAddr::V4(a)) => Some(a),
        _ => None,
    }
}

fn v6(a: Option<IpAddr>) -> Option<Ipv6Addr> {
    match a {
        Some(IpAddr::V6(a)) => Some(a),
        _ => None,
    }
}

/// Reads this VM's elements (calling thread in the host namespace): at most five keyed
/// lookups, whatever the number of VMs.
pub(super) fn read(
    rd: &mut ElementReader,
    label: &str,
    table: &str,
    transit: Ipv4Addr,
) -> Result<Have, NsError> {
    let t = IpAddr::V4(transit);
    let mut h = Have {
        ipv4: v4(get(rd, label, table, maps::SNAT4, t)?),
        mesh: v6(get(rd, label, table, maps::OWN6, t)?),
        ..Have::default()
    };
    if let Some(a) = h.ipv4 {
        h.dnat4_ours = get(rd, label, table, maps::DNAT4, IpAddr::V4(a))? == Some(t);
    }
    if let Some(m) = h.mesh {
        h.ipv6 = v6(get(rd, label, table, maps::SNAT6, IpAddr::V6(m))?);
        if let Some(a) = h.ipv6 {
            h.dnat6_ours =
                get(rd, label, table, maps::DNAT6, IpAddr::V6(a))? == Some(IpAddr::V6(m));
        }
    }
    Ok(h)
}

/// The differences between `have` and what `plan` wants, one line each (empty: in sync).
pub(super) fn differences(have: &Have, plan: Option<&PublicPlan>) -> Vec<String> {
    let w = want(plan);
    let mut d = Vec::new();
    if (have.ipv4, have.dnat4_ours) != (w.ipv4, w.dnat4_ours) {
        d.push(format!(
            "public IPv4 elements: have {:?} (dnat4 ours: {}), want {:?}",
            have.ipv4, have.dnat4_ours, w.ipv4
        ));
    }
    if (have.mesh, have.ipv6, have.dnat6_ours) != (w.mesh, w.ipv6, w.dnat6_ours) {
        d.push(format!(
            "public IPv6 elements: have {:?} → {:?} (dnat6 ours: {}), want {:?} → {:?}",
            have.ipv6, have.mesh, have.dnat6_ours, w.ipv6, w.mesh
        ));
    }
    d
}

/// The elements keyed by one of `plan`'s public addresses that point elsewhere than `plan`
/// wants (`(map, key)`): left by the VM under its previous user id (the change of a user id
/// applies the new one first and removes the old one's elements after), or by a VM deleted
/// while the agent was down. The store gives a public address to one VM only, so such an
/// element is never another live VM's; the plan's own element replaces it.
pub(super) fn taken_keys(
    rd: &mut ElementReader,
    label: &str,
    table: &str,
    plan: Option<&PublicPlan>,
) -> Result<Vec<(&'static str, String)>, NsError> {
    let mut out = Vec::new();
    let Some(p) = plan else { return Ok(out) };
    if let Some(a) = p.ipv4
        && let Some(v) = get(rd, label, table, maps::DNAT4, IpAddr::V4(a))?
        && v != IpAddr::V4(p.transit)
    {
        out.push((maps::DNAT4, a.to_string()));
    }
    if let Some(a) = p.ipv6 {
        if let Some(v) = get(rd, label, table, maps::DNAT6, IpAddr::V6(a))?
            && v != IpAddr::V6(p.mesh)
        {
            out.push((maps::DNAT6, a.to_string()));
        }
        if let Some(v) = get(rd, label, table, maps::SNAT6, IpAddr::V6(p.mesh))?
            && v != IpAddr::V6(a)
        {
            out.push((maps::SNAT6, p.mesh.to_string()));
        }
    }
    Ok(out)
}

/// The transaction taking the VM from `have` to `plan` (`None` when in sync): its stale
/// elements deleted (one keyed by a public address only while it points at this VM), the
/// `taken` keys ([`taken_keys`]) deleted, then the planned ones added.
pub(super) fn transaction(
    table: &str,
    transit: Ipv4Addr,
    have: &Have,
    taken: &[(&str, String)],
    plan: Option<&PublicPlan>,
) -> Option<serde_json::Value> {
    if differences(have, plan).is_empty() {
        return None;
    }
    let t = transit.to_string();
    let mut dels: Vec<(&str, String)> = Vec::new();
    if let Some(a) = have.ipv4 {
        if have.dnat4_ours {
            dels.push((maps::DNAT4, a.to_string()));
        }
        dels.push((maps::SNAT4, t.clone()));
    }
    if let Some(m) = have.mesh {
        if let Some(a) = have.ipv6 {
            if have.dnat6_ours {
                dels.push((maps::DNAT6, a.to_string()));
            }
            dels.push((maps::SNAT6, m.to_string()));
        }
        dels.push((maps::OWN6, t.clone()));
    }
    for k in taken {
        if !dels.contains(k) {
            dels.push(k.clone());
        }
    }
    let mut cmds: Vec<serde_json::Value> = dels
        .iter()
        .map(|(map, key)| element_cmd("delete", table, map, key, None))
        .collect();
    if let Some(p) = plan {
        for (map, k, v) in p.elements() {
            cmds.push(element_cmd("add", table, map, &k, Some(&v)));
        }
    }
    Some(serde_json::json!({ "nftables": cmds }))
}

/// The netns transit address of `uid` (the key of its elements).
fn transit_of(d: &NetlinkNsDriver, uid: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(d.settings.transit_of(uid).network()) + 2)
}

/// Whether the driver manages the host table of public addresses.
fn table(d: &NetlinkNsDriver) -> Option<String> {
    d.settings
        .manage_host
        .then(|| vmnet_plan::ns::names::pub_nft_table(&d.settings.name_prefix))
}

/// Makes the VM's elements in the host table what `plan` wants (none for a VM without public
/// addresses). Returns the change made, if any, and the public addresses whose mapping changed
/// (the old and the new ones), for the conntrack flush.
pub(super) fn sync(
    d: &NetlinkNsDriver,
    plan: &VmPlan,
) -> Result<(Option<Change>, Vec<IpAddr>), NsError> {
    let Some(table) = table(d) else {
        return Ok((None, Vec::new()));
    };
    let transit = transit_of(d, plan.user_id);
    let label = d.host_ns.label().to_owned();
    let want = plan.public.as_ref();
    d.host_nft.with(|nft, rd| {
        let have = read(rd, &label, &table, transit)?;
        if differences(&have, want).is_empty() {
            return Ok((None, Vec::new()));
        }
        let taken = taken_keys(rd, &label, &table, want)?;
        let Some(tx) = transaction(&table, transit, &have, &taken, want) else {
            return Ok((None, Vec::new()));
        };
        let what = differences(&have, want).join("; ");
        nft.json(&tx)?;
        let mut touched = have.addresses();
        touched.extend(want.map(PublicPlan::addresses).unwrap_or_default());
        touched.sort();
        touched.dedup();
        Ok((
            Some(Change::Repair {
                what: format!("host: {what}"),
            }),
            touched,
        ))
    })
}

/// The differences between the VM's elements and `plan` (drift), one line each.
pub(super) fn drift(d: &NetlinkNsDriver, plan: &VmPlan) -> Result<Vec<String>, NsError> {
    let Some(table) = table(d) else {
        return Ok(Vec::new());
    };
    let transit = transit_of(d, plan.user_id);
    let label = d.host_ns.label().to_owned();
    let have = d.host_nft.with(|_, rd| read(rd, &label, &table, transit))?;
    Ok(differences(&have, plan.public.as_ref()))
}

/// Deletes every element of user id `uid`; returns the public addresses it held.
pub(super) fn remove(d: &NetlinkNsDriver, uid: u32) -> Result<Vec<IpAddr>, NsError> {
    let Some(table) = table(d) else {
        return Ok(Vec::new());
    };
    let transit = transit_of(d, uid);
    let label = d.host_ns.label().to_owned();
    d.host_nft.with(|nft, rd| {
        let have = read(rd, &label, &table, transit)?;
        if let Some(tx) = transaction(&table, transit, &have, &[], None) {
            nft.json(&tx)?;
        }
        Ok(have.addresses())
    })
}

/// Deletes user id `uid`'s entries keyed by its transit address (`snat4`, `own6`) and keeps
/// those keyed by public or mesh addresses ([`super::NsDriver::release_public`]).
pub(super) fn release(d: &NetlinkNsDriver, uid: u32) -> Result<(), NsError> {
    let Some(table) = table(d) else {
        return Ok(());
    };
    let transit = transit_of(d, uid);
    let t = transit.to_string();
    let label = d.host_ns.label().to_owned();
    d.host_nft.with(|nft, rd| {
        let have = read(rd, &label, &table, transit)?;
        let mut cmds = Vec::new();
        if have.ipv4.is_some() {
            cmds.push(element_cmd("delete", &table, maps::SNAT4, &t, None));
        }
        if have.mesh.is_some() {
            cmds.push(element_cmd("delete", &table, maps::OWN6, &t, None));
        }
        if !cmds.is_empty() {
            nft.json(&serde_json::json!({ "nftables": cmds }))?;
        }
        Ok(())
    })
}

/// The user ids that own elements in the host table (the transit addresses keying `snat4` and
/// `own6`), from one listing of it: what garbage collection needs to find a VM whose netns and
/// veth pair are gone while its public mapping stayed. One listing per call (it grows with the
/// number of mappings; called once per reconcile pass, never per VM).
pub(super) fn element_owners(d: &NetlinkNsDriver) -> Result<Vec<u32>, NsError> {
    let Some(table) = table(d) else {
        return Ok(Vec::new());
    };
    let label = d.host_ns.label().to_owned();
    let listing = d
        .host_ns
        .run(|| super::inns::list_table(&label, "inet", &table))??;
    Ok(listing.map_or_else(Vec::new, |l| owners(&l, |t| d.settings.uid_of_transit(t))))
}

/// The owners (by `uid_of`, from a netns transit address) of the keys of `snat4` and `own6`
/// in an nft JSON listing.
fn owners(listing: &serde_json::Value, uid_of: impl Fn(Ipv4Addr) -> Option<u32>) -> Vec<u32> {
    let mut uids: Vec<u32> = listing["nftables"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|item| item.get("map"))
        .filter(|m| matches!(m["name"].as_str(), Some(maps::SNAT4 | maps::OWN6)))
        .filter_map(|m| m["elem"].as_array())
        .flatten()
        .filter_map(|e| e.get(0).and_then(serde_json::Value::as_str))
        .filter_map(|k| k.parse::<Ipv4Addr>().ok())
        .filter_map(uid_of)
        .collect();
    uids.sort_unstable();
    uids.dedup();
    uids
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_owners_of_elements_are_the_transit_keys_of_snat4_and_own6() {
        let listing = serde_json::json!({"nftables": [
            {"metainfo": {"version": "1.0.6"}},
            {"map": {"family": "inet", "name": "dnat4", "table": "t",
                "elem": [["203.0.113.5", "10.200.0.6"]]}},
            {"map": {"family": "inet", "name": "snat4", "table": "t",
                "elem": [["10.200.0.6", "203.0.113.5"], ["10.200.0.10", "203.0.113.6"]]}},
            {"map": {"family": "inet", "name": "own6", "table": "t",
                "elem": [["10.200.0.6", "fdaa:1::1"], ["10.200.0.14", "fdaa:1::3"]]}},
            {"map": {"family": "inet", "name": "snat6", "table": "t",
                "elem": [["fdaa:1::1", "2001:db8::1"]]}}
        ]});
        let uid_of = |a: Ipv4Addr| {
            let off = u32::from(a).checked_sub(u32::from(Ipv4Addr::new(10, 200, 0, 2)))?;
            (off % 4 == 0).then_some(off / 4)
        };
        assert_eq!(owners(&listing, uid_of), vec![1, 2, 3]);
        assert!(owners(&serde_json::json!({"nftables": []}), uid_of).is_empty());
    }

    #[test]
    fn element_data_reads_as_an_address_of_either_family() {
        assert_eq!(
            address(&[203, 0, 113, 5]),
            Some("203.0.113.5".parse().unwrap())
        );
        let m: Ipv6Addr = "fdaa:1::7".parse().unwrap();
        assert_eq!(address(&m.octets()), Some(IpAddr::V6(m)));
        assert_eq!(address(&[1, 2, 3]), None);
        assert_eq!(address(&[]), None);
    }
}
