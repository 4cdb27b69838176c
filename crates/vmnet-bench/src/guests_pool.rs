//! The pool-mode half of `vmnet-lab bench guests`: boot to network-ready of a real guest on a
//! pool-mode tap, set up as `vmnet-lab up --sandbox --guests kvm examples/pool.json` sets up its
//! guests ([`vmnet_sandbox::pool_job`]), with one instance.
//!
//! A throwaway sandbox host with the pool bridge holding the range's gateway, the agent in pool
//! mode (`vmnet serve --host-id --bridge`), the range and one public instance over its API (the
//! agent realises it: rules, tap, guard, NoCloud seed). Then `boots` guests, one at a time, each
//! from a fresh overlay (so cloud-init runs as on a first boot) with the instance's qemu
//! arguments from `GET /v1/instances/{id}/nics` and its `seed.iso`: each is timed from qemu's
//! start until, read from inside the guest over its command channel, `eth0` has the lease and the
//! default route goes via the gateway ([`KvmGuest::wait_network`]). The image's only networkd
//! file for `eth0` matches the namespace-mode MAC, so in pool mode that configuration is
//! cloud-init's, rendered from the seed.
//!
//! # Cleanup
//! Each guest is stopped by pid on drop, the instance deleted through the API (its tap, rules and
//! seed go with it), the agent stopped by its guard and the sandbox guard deletes the namespaces.

use std::time::Duration;

use vmnet_agent::api::types::InstanceNics;
use vmnet_agent::client::segment;
use vmnet_model::Error;
use vmnet_model::nic::IfName;
use vmnet_model::pool::Pool;
use vmnet_sandbox::kvm::pool::{KvmGuest, want_lease, want_route};
use vmnet_sandbox::kvm::{Accel, GuestImage, Vm};
use vmnet_sandbox::pool_job::agent::PoolAgent;
use vmnet_sandbox::pool_job::{self, PoolSpec};

/// The bench's pool: the walk-through's /29 with one public instance.
const SPEC: &str = r#"{
  "mode": "pool",
  "bridge": "br0",
  "pool": { "pool_id": "bench-pool", "cidr": "10.0.0.0/29", "gateway": "10.0.0.1",
            "dns": ["10.0.0.1"] },
  "host": { "host_id": "bench-host", "vcpus": 8, "memory_mib": 8192 },
  "instances": [ { "instance_id": "bench-pool-vm", "policy": "public" } ]
}"#;

fn unavailable(what: &str) -> impl Fn(String) -> Error + '_ {
    move |e| Error::unavailable(format!("bench guests, pool mode: {what}: {e}"))
}

/// Boots `boots` real guests one at a time on one pool-mode instance's tap (see the module
/// docs); the seconds from each qemu's start to network-ready, in boot order.
///
/// `dir` holds the agent's state and the guests' overlays and consoles; `wait` bounds each
/// boot (from its qemu's start).
///
/// # Errors
/// `UNAVAILABLE` when the sandbox or the agent cannot be set up or there is no `seed.iso`;
/// the API's error when the range or the instance is refused; `INTERNAL` when qemu cannot start
/// or a guest does not get its lease and default route within `wait`.
pub async fn boots(
    boots: u32,
    (image, accel, dir): (&GuestImage, Accel, &std::path::Path),
    wait: Duration,
) -> Result<Vec<f64>, Error> {
    let spec = PoolSpec::parse("(bench guests)", SPEC)?;
    let bridge: IfName = spec.bridge.parse()?;
    let net: ipnet::Ipv4Net = spec
        .pool
        .cidr
        .parse()
        .map_err(|e: ipnet::AddrParseError| unavailable("range")(e.to_string()))?;
    let sb =
        vmnet_sandbox::Sandbox::new("bp").map_err(|e| unavailable("sandbox")(e.to_string()))?;
    pool_job::host_bridge(&sb, &spec, &bridge, &net)?;
    let agent_dir = dir.join("pool-agent");
    std::fs::create_dir_all(&agent_dir)
        .map_err(|e| unavailable("state directory")(e.to_string()))?;
    let host = sb.host();
    let agent = PoolAgent::start(
        &spec,
        &host,
        &sb.agent_prefix(),
        &agent_dir,
        (&[], Duration::from_secs(30)),
    )
    .await?;
    agent.set_up_pool(&spec).await?;
    let inst = &spec.instances[0];
    let id = inst.instance_id.as_str();
    let created = agent.create_instance(&spec, inst).await?;
    let result = async {
        let lease = created
            .address
            .ok_or_else(|| Error::internal(format!("instance {id}: created without a lease")))?;
        let pool: Pool = agent
            .client
            .get(&format!("/v1/pools/{}", segment(&spec.pool.pool_id)))
            .await?;
        let range = pool
            .range
            .ok_or_else(|| Error::internal("bench guests: the pool has no range"))?;
        let nics: InstanceNics = agent
            .client
            .get(&format!("/v1/instances/{}/nics", segment(id)))
            .await?;
        let nic = nics.nics.first().filter(|_| nics.realised).ok_or_else(|| {
            Error::internal(format!(
                "instance {id}: not realised on the host; {}",
                agent.log_tail()
            ))
        })?;
        let mac = nic.mac.parse()?;
        let mut cfg = pool_job::kvm_config(id, &host, &nics)?;
        let (want4, want_gw) = (
            want_lease(lease, range.cidr.prefix_len()),
            want_route(range.gateway),
        );
        let mut out = Vec::new();
        for i in 0..boots {
            cfg.name = format!("pool{i}");
            let mut g = KvmGuest {
                id: cfg.name.clone(),
                vm: Vm::start(&cfg, image, accel, dir)?,
                ch: None,
                mac,
                ip4: lease,
                ip6: None,
                policy: inst.policy,
                ready_secs: None,
            };
            let s = tokio::task::block_in_place(|| g.wait_network(&want4, &want_gw, wait))?;
            eprintln!("pool-mode boot {}: network ready in {s:.1} s", i + 1);
            out.push(s);
        }
        Ok(out)
    }
    .await;
    // Deleting the instance through the API removes its tap, rules and seed.
    if let Err(e) = agent.delete_instance(id).await {
        eprintln!("warning: bench guests: delete instance {id}: {e}");
    }
    drop(agent);
    drop(sb);
    result
}
