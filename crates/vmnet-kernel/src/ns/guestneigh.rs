//! The guest's permanent neighbour entries on its tap: its IPv4 address (`172.16.0.2`) and its
//! mesh address, both to the spec's fixed guest MAC.
//!
//! # Design
//! A packet for a guest whose entry is not resolved waits in the kernel's neighbour queue
//! while the namespace solicits it, and the kernel flushes learned entries when the tap's
//! carrier goes (a VMM stopped). With permanent entries a packet for a sleeping VM goes
//! straight to its tap, where wake on packet sees it ([`crate::activity`]), and no packet ever
//! waits for ARP or neighbour discovery. The mesh address is config: when it changes, the old
//! entry is deleted and the new one made, in place, as a route change is. Observed by one
//! dump of the tap's entries; compared by content (permanent, to the guest MAC); any other
//! permanent entry on the tap is deleted.

use std::net::IpAddr;

use futures::TryStreamExt;
use netlink_packet_route::neighbour::{NeighbourAddress, NeighbourAttribute, NeighbourState};
use rtnetlink::Handle;
use vmnet_plan::ns::{GUEST_IPV4, GUEST_MAC, VmPlan};

use super::links::neigh::{self, KNeigh};
use super::routes::nl;
use super::{Change, NsError, Side};

/// The addresses the plan gives permanent entries on the tap.
#[must_use]
pub(super) fn want(plan: &VmPlan) -> Vec<IpAddr> {
    let mut out = vec![IpAddr::V4(GUEST_IPV4)];
    out.extend(plan.guest.mesh_ipv6.map(IpAddr::V6));
    out
}

/// Every neighbour entry on link `index` (one dump per family).
///
/// # Errors
/// The dump fails.
pub(super) async fn observe(
    h: &Handle,
    index: u32,
    w: &str,
) -> Result<Vec<(IpAddr, KNeigh)>, NsError> {
    let mut out = Vec::new();
    let mut dump = h.neighbours().get().execute();
    while let Some(m) = dump
        .try_next()
        .await
        .map_err(nl(format!("{w}: dump neighbours")))?
    {
        if m.header.ifindex != index {
            continue;
        }
        let mut ip = None;
        let mut mac = None;
        for a in &m.attributes {
            match a {
                NeighbourAttribute::Destination(NeighbourAddress::Inet(a)) => {
                    ip = Some(IpAddr::V4(*a))
                }
                NeighbourAttribute::Destination(NeighbourAddress::Inet6(a)) => {
                    ip = Some(IpAddr::V6(*a))
                }
                NeighbourAttribute::LinkLayerAddress(l) => mac = <[u8; 6]>::try_from(&l[..]).ok(),
                _ => {}
            }
        }
        if let Some(ip) = ip {
            out.push((
                ip,
                KNeigh {
                    mac,
                    permanent: m.header.state == NeighbourState::Permanent,
                },
            ));
        }
    }
    Ok(out)
}

/// What differs: the planned addresses without their entry, and the permanent entries on the
/// tap the plan does not have.
#[must_use]
pub(super) fn diff(plan: &VmPlan, seen: &[(IpAddr, KNeigh)]) -> (Vec<IpAddr>, Vec<IpAddr>) {
    let want = want(plan);
    let set = want
        .iter()
        .filter(|ip| {
            !seen
                .iter()
                .any(|(a, n)| a == *ip && n.is_permanent_for(GUEST_MAC))
        })
        .copied()
        .collect();
    let del = seen
        .iter()
        .filter(|(a, n)| n.permanent && !want.contains(a))
        .map(|(a, _)| *a)
        .collect();
    (set, del)
}

fn describe(plan: &VmPlan, set: &[IpAddr], del: &[IpAddr]) -> Vec<Change> {
    let tap = &plan.tap.name;
    set.iter()
        .map(|ip| Change::Neighbour(Side::Vm, format!("{ip} dev {tap} permanent")))
        .chain(
            del.iter()
                .map(|ip| Change::Neighbour(Side::Vm, format!("del {ip} dev {tap}"))),
        )
        .collect()
}

/// The changes [`sync`] would make.
#[must_use]
pub(super) fn drift(plan: &VmPlan, seen: &[(IpAddr, KNeigh)]) -> Vec<Change> {
    let (set, del) = diff(plan, seen);
    describe(plan, &set, &del)
}

/// Makes the planned entries on the tap (ifindex `index`) and deletes other permanent ones,
/// `seen` being what is there.
///
/// # Errors
/// A netlink request fails.
pub(super) async fn sync(
    h: &Handle,
    plan: &VmPlan,
    index: u32,
    seen: &[(IpAddr, KNeigh)],
) -> Result<Vec<Change>, NsError> {
    let (set, del) = diff(plan, seen);
    let w = plan.netns.as_str();
    for ip in &del {
        match h
            .neighbours()
            .del(neigh::message(index, *ip))
            .execute()
            .await
        {
            Ok(()) => {}
            Err(e) if super::routes::errno(&e) == Some(libc::ENOENT) => {}
            Err(e) => {
                return Err(nl(format!(
                    "{w}: delete neighbour {ip} dev {}",
                    plan.tap.name
                ))(e));
            }
        }
    }
    futures::future::try_join_all(
        set.iter()
            .map(|ip| neigh::set(h, index, &plan.tap.name, *ip, GUEST_MAC, w)),
    )
    .await?;
    Ok(describe(plan, &set, &del))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(mesh: Option<&str>) -> VmPlan {
        let mut v = serde_json::json!({"id": "g", "user_id": 7, "tenant": 1});
        if let Some(m) = mesh {
            v["mesh_ipv6"] = m.into();
        }
        let cfg: vmnet_model::vm::VmConfig = serde_json::from_value(v).expect("config");
        vmnet_plan::ns::plan_vm(&cfg, &vmnet_plan::ns::NsSettings::default()).expect("plan")
    }

    fn entry(mac: [u8; 6], permanent: bool) -> KNeigh {
        KNeigh {
            mac: Some(mac),
            permanent,
        }
    }

    #[test]
    fn the_guest_ipv4_and_mesh_address_are_wanted_and_nothing_else_is_kept() {
        let p = plan(Some("fdaa:4::2"));
        let v4: IpAddr = "172.16.0.2".parse().unwrap();
        let mesh: IpAddr = "fdaa:4::2".parse().unwrap();
        let old: IpAddr = "fdaa:4::1".parse().unwrap();
        assert_eq!(diff(&p, &[]), (vec![v4, mesh], vec![]));
        let good = [(v4, entry(GUEST_MAC, true)), (mesh, entry(GUEST_MAC, true))];
        assert_eq!(diff(&p, &good), (vec![], vec![]));
        // Learned (not permanent), another MAC, and the old mesh address's entry.
        let seen = [
            (v4, entry(GUEST_MAC, false)),
            (mesh, entry([6, 0, 0, 0, 0, 9], true)),
            (old, entry(GUEST_MAC, true)),
        ];
        assert_eq!(diff(&p, &seen), (vec![v4, mesh], vec![old]));
        let d = drift(&p, &seen);
        assert_eq!(d.len(), 3);
        assert!(d[2].to_string().contains("del fdaa:4::1"), "{}", d[2]);
        // A learned entry for another address stays (the kernel manages it).
        let p4 = plan(None);
        assert_eq!(
            diff(&p4, &[(old, entry(GUEST_MAC, false))]),
            (vec![v4], vec![])
        );
    }
}
