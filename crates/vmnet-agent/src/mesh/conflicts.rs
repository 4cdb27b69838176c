//! One mesh address, one owner: a VM's `mesh_ipv6` may not be this host's mesh address or a
//! managed peer's, and a sync may not give a peer the mesh address of a VM on this host. Either
//! would put two /128 routes for one address on the host, each side re-installing its own on
//! every pass. Both are `CONFLICT` naming the holder; nothing is changed.

use std::collections::HashMap;
use std::net::Ipv6Addr;

use vmnet_ipam::IpamError;
use vmnet_ipam::db::Tx;
use vmnet_ipam::{mesh_store, vm_store};
use vmnet_model::vm::VmConfig;

use super::body::PeerSpec;

/// `CONFLICT` when `cfg`'s mesh address is `own` (this host's mesh address) or a recorded
/// peer's.
///
/// # Errors
/// `CONFLICT` naming the host or the peer's key; `UNAVAILABLE` on a store failure.
pub async fn vm_mesh(tx: &mut Tx, cfg: &VmConfig, own: Option<Ipv6Addr>) -> Result<(), IpamError> {
    let Some(mesh) = cfg.mesh_ipv6 else {
        return Ok(());
    };
    if Some(mesh) == own {
        return Err(IpamError::Conflict(format!(
            "vm {}: mesh_ipv6 {mesh} is this host's mesh address (--mesh-address)",
            cfg.id
        )));
    }
    if let Some(key) = mesh_store::peer_with_address(tx, &mesh.to_string()).await? {
        return Err(IpamError::Conflict(format!(
            "vm {}: mesh_ipv6 {mesh} is the mesh address of mesh peer {key}",
            cfg.id
        )));
    }
    Ok(())
}

/// `CONFLICT` when a peer of the sync claims the mesh address of a VM stored on this host.
///
/// # Errors
/// `CONFLICT` naming the peer and the VM; `UNAVAILABLE` on a store failure.
pub async fn sync_peers(tx: &mut Tx, peers: &[PeerSpec]) -> Result<(), IpamError> {
    let vms = vm_store::meshes(tx).await?;
    if vms.is_empty() {
        return Ok(());
    }
    check_peers(peers, &vms)
}

/// The pure part of [`sync_peers`]: `vms` are `(vm id, mesh address text)`.
fn check_peers(peers: &[PeerSpec], vms: &[(String, String)]) -> Result<(), IpamError> {
    let by_mesh: HashMap<Ipv6Addr, &str> = vms
        .iter()
        .filter_map(|(id, m)| m.parse().ok().map(|a| (a, id.as_str())))
        .collect();
    for (i, p) in peers.iter().enumerate() {
        if let Some(vm) = by_mesh.get(&p.mesh_address) {
            return Err(IpamError::Conflict(format!(
                "sync: peers[{i}].mesh_address {} is the mesh address of vm {vm} on this host",
                p.mesh_address
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::str::FromStr;

    use super::*;
    use crate::mesh::body::WgKey;

    fn peer(mesh: &str) -> PeerSpec {
        PeerSpec {
            public_key: WgKey::from_str("AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=").unwrap(),
            endpoint: "[fd00:10::2]:51820".parse().unwrap(),
            mesh_address: mesh.parse().unwrap(),
        }
    }

    #[test]
    fn a_peer_on_a_local_vms_mesh_address_is_a_conflict_naming_both() {
        let vms = vec![("web-1".to_owned(), "fdaa:1::7".to_owned())];
        assert!(check_peers(&[peer("fdaa::2")], &vms).is_ok());
        let e = check_peers(&[peer("fdaa::2"), peer("fdaa:1::7")], &vms).unwrap_err();
        assert!(matches!(e, IpamError::Conflict(_)), "{e:?}");
        assert_eq!(
            e.to_string(),
            "sync: peers[1].mesh_address fdaa:1::7 is the mesh address of vm web-1 on this host"
        );
    }
}
