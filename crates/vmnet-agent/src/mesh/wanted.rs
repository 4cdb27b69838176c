//! The data plane's maps as the winning registrations want them: the location of every mesh
//! address and the owner of every public IPv6 block (spec "Atlas WG Mesh": a VM that owns a
//! block is reached through the mesh by VMs on other hosts), and the diffed write of the
//! location map.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv6Addr;

use ipnet::Ipv6Net;
use vmnet_ipam::mesh_vms::MeshVmRow;
use vmnet_kernel::mesh::{Location, MeshError, MeshPlane};
use vmnet_model::Error;

fn parse_addr(s: &str) -> Result<Ipv6Addr, Error> {
    s.parse::<Ipv6Addr>()
        .map_err(|_| Error::internal(format!("mesh registration: stored address {s:?}")))
}

fn location(r: &MeshVmRow) -> Result<Location, Error> {
    Ok(Location {
        host: parse_addr(&r.host)?,
        user_id: r.user_id,
        tenant: r.tenant,
    })
}

/// The location map of `winners` (mesh address → row); `INTERNAL` for a stored address that
/// does not parse.
pub(super) fn locations_of(
    winners: &BTreeMap<String, MeshVmRow>,
) -> Result<BTreeMap<Ipv6Addr, Location>, Error> {
    winners
        .values()
        .map(|r| Ok((parse_addr(&r.mesh_address)?, location(r)?)))
        .collect()
}

/// The gateway map of `winners`: (host, tenant) of every registered gateway VM.
pub(super) fn gateways_of(
    winners: &BTreeMap<String, MeshVmRow>,
) -> Result<BTreeSet<(Ipv6Addr, u32)>, Error> {
    winners
        .values()
        .filter(|r| r.gateway)
        .map(|r| Ok((parse_addr(&r.host)?, r.tenant)))
        .collect()
}

/// The block map of `winners`: each public IPv6 block to the VM that registered it. Two VMs
/// claiming the same block: the oldest claim wins, then the smallest host (as for mesh
/// addresses). A stored block that does not parse is `INTERNAL`.
pub(super) fn blocks_of(
    winners: &BTreeMap<String, MeshVmRow>,
) -> Result<BTreeMap<Ipv6Net, Location>, Error> {
    let mut claims: Vec<&MeshVmRow> = winners
        .values()
        .filter(|r| r.public_block.is_some())
        .collect();
    claims.sort_by(|a, b| (a.registered_at, &a.host).cmp(&(b.registered_at, &b.host)));
    let mut out = BTreeMap::new();
    for r in claims {
        let text = r.public_block.as_deref().unwrap_or_default();
        let block: Ipv6Net = text
            .parse()
            .map_err(|_| Error::internal(format!("mesh registration: stored block {text:?}")))?;
        if let std::collections::btree_map::Entry::Vacant(e) = out.entry(block) {
            e.insert(location(r)?);
        }
    }
    Ok(out)
}

/// Makes the location map `desired`: new and changed entries written first, then the others
/// removed. Returns nothing to report (locations follow the store; they are not repairs).
pub(super) fn set_locations(
    plane: &MeshPlane,
    desired: &BTreeMap<Ipv6Addr, Location>,
) -> Result<Vec<String>, MeshError> {
    let have = plane.locations()?;
    for (m, l) in desired {
        if have.get(m) != Some(l) {
            plane.put_location(*m, l)?;
        }
    }
    for m in have.keys().filter(|m| !desired.contains_key(m)) {
        plane.remove_location(*m)?;
    }
    Ok(Vec::new())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(host: &str, mesh: &str, uid: u32, block: Option<&str>, at: i64) -> MeshVmRow {
        MeshVmRow {
            host: host.into(),
            mesh_address: mesh.into(),
            user_id: uid,
            tenant: 1,
            public_block: block.map(str::to_owned),
            gateway: block.is_some(),
            registered_at: at,
        }
    }

    fn winners(rows: Vec<MeshVmRow>) -> BTreeMap<String, MeshVmRow> {
        rows.into_iter()
            .map(|r| (r.mesh_address.clone(), r))
            .collect()
    }

    #[test]
    fn each_block_points_at_its_owner_and_the_oldest_claim_wins() {
        let w = winners(vec![
            row("fdaa::1", "fdaa:1::1", 1, Some("2001:db8:a::/64"), 5),
            row("fdaa::2", "fdaa:2::1", 7, Some("2001:db8:b::/56"), 3),
            row("fdaa::3", "fdaa:3::1", 9, Some("2001:db8:a::/64"), 4),
            row("fdaa::3", "fdaa:3::2", 10, None, 1),
        ]);
        let b = blocks_of(&w).expect("blocks");
        assert_eq!(b.len(), 2, "{b:?}");
        let a: Ipv6Net = "2001:db8:a::/64".parse().unwrap();
        assert_eq!(
            b[&a],
            Location {
                host: "fdaa::3".parse().unwrap(),
                user_id: 9,
                tenant: 1
            },
            "the older claim (at 4) wins over the one at 5"
        );
        assert_eq!(b[&"2001:db8:b::/56".parse::<Ipv6Net>().unwrap()].user_id, 7);
    }

    #[test]
    fn gateways_are_keyed_by_host_and_tenant() {
        let mut g = row("fdaa::2", "fdaa:2::1", 7, Some("2001:db8:b::/56"), 3);
        g.tenant = 4;
        let w = winners(vec![g, row("fdaa::1", "fdaa:1::1", 1, None, 5)]);
        let want: BTreeSet<(Ipv6Addr, u32)> = [("fdaa::2".parse().unwrap(), 4)].into();
        assert_eq!(gateways_of(&w).expect("gateways"), want);
    }

    #[test]
    fn a_stored_block_that_does_not_parse_is_an_internal_error() {
        let w = winners(vec![row("fdaa::1", "fdaa:1::1", 1, Some("nonsense"), 1)]);
        let e = blocks_of(&w).expect_err("refused");
        assert!(
            e.message.contains("stored block \"nonsense\""),
            "{}",
            e.message
        );
    }
}
