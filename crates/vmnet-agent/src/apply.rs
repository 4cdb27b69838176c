//! Applying a [`HostSpec`] through the API, declaratively (the semantics are documented in
//! [`crate::hostspec`]). Used by `vmnet apply FILE` and by `vmnet-lab up --sandbox`.

use vmnet_model::pool::{Host, Instance, IpRange};
use vmnet_model::{Error, ErrorCode};

use crate::api::types::{ApplyItem, ApplyReport};
use crate::client::{Client, segment};
use crate::hostspec::{HostSpec, pool_range};
use crate::status::{VmState, VmView};

fn item(kind: &str, id: &str, result: impl Into<String>) -> ApplyItem {
    ApplyItem {
        kind: kind.to_owned(),
        id: id.to_owned(),
        result: result.into(),
    }
}

/// Applies `spec` through the agent at `client`: pools, hosts, instances, VMs, then (with
/// `prune`) deletes the VMs the spec does not list.
///
/// # Errors
/// The first API error, prefixed with the entry it happened at; entries before it stay applied.
pub async fn apply_host_spec(
    client: &Client,
    spec: &HostSpec,
    prune: bool,
) -> Result<ApplyReport, Error> {
    let at = |kind: &str, id: &str| {
        let prefix = format!("apply {kind} {id}: ");
        move |e: Error| Error::new(e.code, format!("{prefix}{}", e.message))
    };
    let mut report = ApplyReport::default();
    for p in &spec.pools {
        let path = format!("/v1/pools/{}/range", segment(&p.pool_id));
        let r: IpRange = client
            .put(&path, &pool_range(p))
            .await
            .map_err(at("pool", &p.pool_id))?;
        report.items.push(item(
            "pool",
            &p.pool_id,
            format!("set {} ({}-{})", r.cidr, r.first_host, r.last_host),
        ));
    }
    for h in &spec.hosts {
        let path = format!("/v1/hosts/{}", segment(&h.host_id));
        let host: Host = client
            .put(&path, &h.capacity())
            .await
            .map_err(at("host", &h.host_id))?;
        report.items.push(item(
            "host",
            &h.host_id,
            format!("set {} vCPUs, {} MiB", host.vcpus, host.memory_mib),
        ));
    }
    for i in &spec.instances {
        let path = format!("/v1/instances/{}", segment(&i.instance_id));
        let result = match client.get::<Instance>(&path).await {
            Ok(existing) => format!("unchanged ({})", dash_addr(&existing)),
            Err(e) if e.code == ErrorCode::NotFound => {
                let created: Instance = client
                    .post("/v1/instances", Some(i))
                    .await
                    .map_err(at("instance", &i.instance_id))?;
                format!("created ({})", dash_addr(&created))
            }
            Err(e) => return Err(at("instance", &i.instance_id)(e)),
        };
        report.items.push(item("instance", &i.instance_id, result));
    }
    for vm in &spec.vms {
        let path = format!("/v1/vms/{}", segment(&vm.id));
        let current = match client.get::<VmView>(&path).await {
            Ok(v) => Some(v),
            Err(e) if e.code == ErrorCode::NotFound => None,
            Err(e) => return Err(at("vm", &vm.id)(e)),
        };
        let result = match current {
            Some(v) if v.config == *vm && v.status.state == VmState::Applied => {
                "unchanged".to_owned()
            }
            prev => {
                let view: VmView = client.put(&path, vm).await.map_err(at("vm", &vm.id))?;
                let verb = if prev.is_some() { "updated" } else { "created" };
                format!("{verb} ({})", view.status.state.as_str())
            }
        };
        report.items.push(item("vm", &vm.id, result));
    }
    if prune {
        let all: Vec<VmView> = client.get("/v1/vms").await.map_err(at("vm", "*"))?;
        for v in all
            .iter()
            .filter(|v| !spec.vms.iter().any(|s| s.id == v.config.id))
        {
            let path = format!("/v1/vms/{}", segment(&v.config.id));
            let _: VmView = client.delete(&path).await.map_err(at("vm", &v.config.id))?;
            report
                .items
                .push(item("vm", &v.config.id, "deleted (not in the spec)"));
        }
    }
    Ok(report)
}

fn dash_addr(i: &Instance) -> String {
    match i.address {
        Some(a) => format!("{} on {}", a, i.host_id.as_deref().unwrap_or("-")),
        None => format!("no address, on {}", i.host_id.as_deref().unwrap_or("-")),
    }
}
