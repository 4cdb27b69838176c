//! `GET /v1/instances/{id}/nics`: an instance's NICs as this host realises them (spec: "What
//! reaches the host") and the NIC configs for the runtimes (libvirt, cloud-hypervisor,
//! Firecracker, qemu) and the runtime plugin spec.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use vmnet_ipam::Store;
use vmnet_model::Error;
use vmnet_model::nic::{DEFAULT_BRIDGE, IfName};
use vmnet_plan::pool::runtime as rt;
use vmnet_plan::pool::seed::guest_ifname;

use super::error::{ApiError, from_ipam};
use super::types::{InstanceNics, NicView, RuntimeConfigs};
use crate::agent::Agent;
use crate::pool::node::{NicRanges, spec_of};
use crate::pool::seeds;

/// The NICs of instance `id`: from the store (its leases and the ranges they are in) on this
/// agent's bridge
/// (`br0` without pool mode), with whether they are realised here.
///
/// # Errors
/// `NOT_FOUND` for an unknown instance; `UNAVAILABLE` on a store failure. A lease its range no
/// longer contains is no error: the NIC shows it as `/32` ([`vmnet_model::nic::lease_cidr`]).
pub async fn instance_nics(agent: &Agent, id: &str) -> Result<InstanceNics, Error> {
    let (inst, ranges) = {
        let mut tx = agent.db().begin().await.map_err(from_ipam)?;
        let got = async {
            let inst = vmnet_ipam::get_instance(&mut tx, id).await?;
            let ranges = NicRanges::read(&mut tx, &inst.pool_id).await?;
            Ok::<_, vmnet_ipam::IpamError>((inst, ranges))
        }
        .await;
        let _ = tx.rollback().await;
        got.map_err(from_ipam)?
    };
    let pool = agent.pool();
    let bridge: IfName = match pool {
        Some(p) => p.config().bridge.clone(),
        None => DEFAULT_BRIDGE.parse()?,
    };
    let spec = spec_of(&inst, &ranges, &bridge)?;
    let realised = match pool {
        Some(p) => p.is_realised(id).await,
        None => false,
    };
    let seed_dir = pool.filter(|_| realised).map(|p| {
        seeds::instance_dir(&p.config().seed_dir, id)
            .display()
            .to_string()
    });
    let taps = spec.tap_names()?;
    let nics = spec
        .nics
        .iter()
        .zip(&taps)
        .enumerate()
        .map(|(i, (n, tap))| NicView {
            index: u32::try_from(i).unwrap_or(u32::MAX),
            guest_ifname: guest_ifname(i),
            tap: tap.to_string(),
            mac: n.mac.to_string(),
            network: n
                .network
                .as_ref()
                .map(ToString::to_string)
                .unwrap_or_default(),
            addresses: n.addresses.iter().map(ToString::to_string).collect(),
            gateway: n.gateway.map(|g| g.to_string()),
            gateway6: n.gateway6.map(|g| g.to_string()),
            nameservers: n.nameservers.iter().map(ToString::to_string).collect(),
        })
        .collect();
    Ok(InstanceNics {
        instance_id: inst.instance_id.clone(),
        host_id: inst.host_id.clone(),
        realised,
        seed_dir,
        nics,
        runtime: RuntimeConfigs {
            libvirt_xml: rt::libvirt_interfaces(&spec)?,
            cloud_hypervisor_args: rt::cloud_hypervisor_args(&spec)?,
            firecracker: rt::firecracker_interfaces(&spec)?,
            qemu_args: rt::qemu_args(&spec)?,
            plugin: rt::plugin_spec(&spec)?,
        },
    })
}

/// `GET /v1/instances/{id}/nics`.
pub async fn get_nics(
    State(a): State<Arc<Agent>>,
    Path(id): Path<String>,
) -> Result<Json<InstanceNics>, ApiError> {
    Ok(Json(instance_nics(&a, &id).await?))
}
