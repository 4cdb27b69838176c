//! `vmnet-lab bench mesh --case propagation`: how long a VM registration takes to reach another
//! host's data plane when the fleet already holds many registrations.
//!
//! Two throwaway fleet hosts, A and B, each run the real agent with the mesh and its data plane
//! (`--mesh-bpf-root` on a bpffs mounted for the bench, `--mesh-registry` a database of a
//! throwaway PostgreSQL cluster both share), synced with each other. The store is first filled
//! with `vms` registrations for each of two more hosts (rows only: hosts that run no agent here),
//! and the bench waits until A's location map holds all of them. Then, `runs` times: a VM is
//! `PUT` on B and the clock starts at the answer; it stops when A's location map (read from the
//! pinned map, as the kernel sees it) points the VM's mesh address at B. The VM is deleted and
//! the time until A's entry is gone is measured the same way. Each change makes every agent
//! re-read the whole set (`LISTEN`/`NOTIFY`), so the figure grows with the fleet's size.
//!
//! # Cleanup
//! The agents are stopped by their guards, each `wireguard-go` by the pid serving its socket,
//! the bpffs is unmounted, the fleet's namespaces are deleted and the cluster removed.

use std::fmt::Write as _;
use std::net::Ipv6Addr;
use std::time::{Duration, Instant};

use serde_json::json;
use vmnet_agent::status::VmView;
use vmnet_kernel::mesh::MeshPlane;
use vmnet_model::Error;
use vmnet_sandbox::Fleet;
use vmnet_sandbox::agent::{AgentOptions, AgentProc};
use vmnet_sandbox::fleet_job::mesh::{agent_args, host_mesh, stop_devices, sync_all};
use vmnet_sandbox::mesh_lab::BpffsMount;
use vmnet_sandbox::postgres::{PgCluster, PgOptions};

use crate::vms::stats;

/// The goal of the issue: a registration reaches every peer host within 1 s.
pub const GOAL_MS: f64 = 1000.0;

fn unavailable(what: &str) -> impl Fn(String) -> Error + '_ {
    move |e| Error::unavailable(format!("bench mesh propagation: {what}: {e}"))
}

/// Stops the hosts' `wireguard-go` on drop.
struct Devices(Vec<String>);

impl Drop for Devices {
    fn drop(&mut self) {
        let _ = stop_devices(&self.0);
    }
}

/// Waits (polling every 2 ms, at most 10 s) until `cond` holds; the time it took.
fn until(mut cond: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        if cond() {
            return Some(start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    None
}

/// The registrations of `n` VMs on host `host` (rows only), as one SQL statement.
fn fill_sql(host: Ipv6Addr, n: u32, hextet: u16) -> String {
    format!(
        "INSERT INTO mesh_vms (host, mesh_address, user_id, tenant, public_block, gateway, registered_at) \
         SELECT '{host}', 'fdaa:{hextet:x}::' || to_hex(i), i, 1, NULL, 0, 1 \
         FROM generate_series(1, {n}) AS i"
    )
}

/// Runs the bench and returns its table.
///
/// # Errors
/// `UNAVAILABLE` when the fleet, the cluster, an agent or a check fails.
pub async fn run(vms: u32, runs: u32) -> Result<String, Error> {
    let fleet = Fleet::new(2).map_err(|e| unavailable("fleet")(e.to_string()))?;
    let hosts = fleet.hosts().to_vec();
    let _devices = Devices(hosts.iter().map(|h| h.prefix.clone()).collect());
    let pg = tokio::task::block_in_place(|| PgCluster::start(PgOptions::default()))
        .map_err(|e| unavailable("PostgreSQL")(format!("{e:#}")))?;
    let db = pg
        .fresh_database()
        .map_err(|e| unavailable("database")(format!("{e:#}")))?;
    let registry = pg.url(&db);
    let bpffs = BpffsMount::new(fleet.prefix()).map_err(|e| unavailable("bpffs")(e.to_string()))?;
    let exe = vmnet_sandbox::exe::vmnet()?;
    let state = std::env::temp_dir().join(format!("vmnet-bench-prop.{}", std::process::id()));
    let mut agents: Vec<AgentProc> = Vec::new();
    for h in &hosts {
        let pins = bpffs
            .dir(&h.prefix)
            .map_err(|e| unavailable("pin dir")(e.to_string()))?;
        let dir = state.join(&h.prefix);
        std::fs::create_dir_all(&dir).map_err(|e| unavailable("state dir")(e.to_string()))?;
        let agent = AgentOptions::new(&h.ns, &h.prefix, &dir)
            .exe(&exe)
            .args(agent_args(h, &pins, &registry))
            .start(Duration::from_secs(30))
            .await?;
        agents.push(agent);
    }
    let clients: Vec<_> = hosts
        .iter()
        .zip(&agents)
        .map(|(h, a)| (h.prefix.clone(), h.clone(), a.client().clone()))
        .collect();
    sync_all(&clients).await?;
    let plane_a = MeshPlane::load(Some(&hosts[0].ns), &bpffs.path().join(&hosts[0].prefix))
        .map_err(|e| unavailable("A's maps")(e.to_string()))?;
    // The fleet's size: `vms` registrations on each of two hosts without an agent here.
    for (i, other) in [0xf1u16, 0xf2].into_iter().enumerate() {
        let host = Ipv6Addr::new(0xfdaa, 0, 0, 0, 0, 0, 0, other);
        let hextet = 0x7000 + u16::try_from(i).unwrap_or(0);
        pg.psql(&db, &fill_sql(host, vms, hextet))
            .map_err(|e| unavailable("fill the store")(format!("{e:#}")))?;
    }
    let want = 2 * usize::try_from(vms).unwrap_or(0);
    let filled = tokio::task::block_in_place(|| {
        until(|| plane_a.locations().is_ok_and(|l| l.len() >= want))
    });
    let filled = filled.ok_or_else(|| {
        unavailable("fill")(format!(
            "A did not learn the {want} registrations within 10 s: {:?}",
            plane_a.locations().map(|l| l.len())
        ))
    })?;
    let (mut up, mut down) = (Vec::new(), Vec::new());
    let b = agents[1].client();
    let b_host = host_mesh(&hosts[1]);
    for run in 0..runs {
        let uid = 100 + run;
        let mesh = Ipv6Addr::new(
            0xfdaa,
            0x200,
            0,
            0,
            0,
            0,
            0,
            u16::try_from(uid).unwrap_or(1),
        );
        let id = format!("prop-{uid}");
        let body = json!({"id": id, "user_id": uid, "tenant": 1, "mesh_ipv6": mesh.to_string()});
        let _: VmView = b.put(&format!("/v1/vms/{id}"), &body).await?;
        let t = tokio::task::block_in_place(|| {
            until(|| {
                plane_a
                    .locations()
                    .is_ok_and(|l| l.get(&mesh).map(|x| x.host) == Some(b_host))
            })
        })
        .ok_or_else(|| unavailable("register")(format!("{mesh} not known on A within 10 s")))?;
        up.push(t);
        let _: VmView = b.delete(&format!("/v1/vms/{id}")).await?;
        let t = tokio::task::block_in_place(|| {
            until(|| plane_a.locations().is_ok_and(|l| !l.contains_key(&mesh)))
        })
        .ok_or_else(|| unavailable("unregister")(format!("{mesh} still on A after 10 s")))?;
        down.push(t);
    }
    drop(agents);
    let _ = std::fs::remove_dir_all(&state);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "mesh registrations: two agents sharing PostgreSQL, {vms} more registrations on each of two other hosts; a VM put on B until A's location map has it ({runs} runs)"
    );
    let _ = writeln!(
        out,
        "the store filled with {want} registrations: A had them all {:.0} ms after the inserts",
        filled.as_secs_f64() * 1000.0
    );
    let _ = writeln!(
        out,
        "{:<40} {:>10} {:>10} {:>10} {:>5}",
        "case", "median ms", "p99 ms", "goal ms", "met"
    );
    for (name, t) in [
        ("VM registered on B, known on A", &up),
        ("VM deleted on B, gone on A", &down),
    ] {
        let s = stats(t);
        let _ = writeln!(
            out,
            "{name:<40} {:>10.2} {:>10.2} {GOAL_MS:>10.0} {:>5}",
            s.median,
            s.p99,
            if s.p99 <= GOAL_MS { "yes" } else { "NO" }
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::fill_sql;

    #[test]
    fn the_fill_inserts_one_row_per_vm_of_the_host() {
        let sql = fill_sql("fdaa::f1".parse().unwrap(), 1000, 0x7000);
        assert!(
            sql.contains("SELECT 'fdaa::f1', 'fdaa:7000::' || to_hex(i), i, 1"),
            "{sql}"
        );
        assert!(sql.ends_with("generate_series(1, 1000) AS i"), "{sql}");
    }
}
