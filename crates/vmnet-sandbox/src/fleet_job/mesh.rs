//! The fleet's WireGuard mesh: every host's agent runs `vmnet serve --mesh` with an interface
//! `<host prefix>wg` (unique on the machine) and a mesh address the sandbox hands out as the
//! control plane would (`fdaa::<host index>`); once all hosts are up, each is synced with the
//! others (endpoints on the private network, IPv6), and the checks ping every other host's
//! mesh address across the interface. `vmnet down` stops each host's `wireguard-go` (which
//! outlives its agent by design) by the pid serving the interface's UAPI socket.

use std::net::{IpAddr, Ipv6Addr};
use std::time::Duration;

use serde_json::{Value, json};
use vmnet_agent::client::Client;
use vmnet_agent::mesh::runtime::DEFAULT_PORT;
use vmnet_agent::mesh::view::{MeshView, SyncOutcome};
use vmnet_kernel::wg::uapi::Uapi;
use vmnet_model::Error;

use super::checks::FleetCheck;
use crate::fleet::HostNet;
use crate::traffic;

/// The mesh address the sandbox gives host `net`.
#[must_use]
pub fn host_mesh(net: &HostNet) -> Ipv6Addr {
    Ipv6Addr::new(0xfdaa, 0, 0, 0, 0, 0, 0, u16::from(net.index))
}

/// The mesh interface of the host with agent prefix `prefix`.
#[must_use]
pub fn ifname(prefix: &str) -> String {
    format!("{prefix}wg")
}

/// The `vmnet serve` arguments that turn the mesh on for `net`.
#[must_use]
pub fn agent_args(net: &HostNet) -> Vec<String> {
    vec![
        "--mesh".to_owned(),
        "--wg-interface".to_owned(),
        ifname(&net.prefix),
        "--mesh-address".to_owned(),
        host_mesh(net).to_string(),
    ]
}

/// Syncs every host with all the others. Returns each host's public key, in order.
///
/// # Errors
/// The API's error naming the host.
pub async fn sync_all(hosts: &[(String, HostNet, Client)]) -> Result<Vec<String>, Error> {
    let mut keys = Vec::new();
    for (name, _, c) in hosts {
        let v: MeshView = c
            .get("/v1/mesh")
            .await
            .map_err(|e| Error::new(e.code, format!("host {name}: GET /v1/mesh: {}", e.message)))?;
        keys.push(v.public_key);
    }
    for (i, (name, _, c)) in hosts.iter().enumerate() {
        let peers: Vec<Value> = hosts
            .iter()
            .zip(&keys)
            .enumerate()
            .filter(|(j, _)| *j != i)
            .map(|(_, ((_, net, _), key))| {
                json!({"public_key": key, "endpoint": format!("[{}]:{DEFAULT_PORT}", net.private_v6),
                       "mesh_address": host_mesh(net).to_string()})
            })
            .collect();
        let o: SyncOutcome = c
            .post("/v1/sync", Some(&json!({"peers": peers})))
            .await
            .map_err(|e| {
                Error::new(e.code, format!("host {name}: POST /v1/sync: {}", e.message))
            })?;
        eprintln!(
            "host {name}: mesh synced: {} peers, {} added, {} routes added",
            o.peers, o.added, o.routes_added
        );
    }
    Ok(keys)
}

/// Pings every other host's mesh address from each host (up to 5 tries of one echo each: the
/// first packet of a tunnel waits for its handshake).
#[must_use]
pub fn checks(hosts: &[(String, HostNet)]) -> Vec<FleetCheck> {
    let mut out = Vec::new();
    for (name, h) in hosts {
        for (other, k) in hosts.iter().filter(|(_, k)| k.index != h.index) {
            let dst = host_mesh(k);
            let mut seen = "no reply".to_owned();
            for _ in 0..5 {
                match traffic::ping(&h.ns, IpAddr::V6(dst), 1, Duration::from_secs(1)) {
                    Ok(p) if p.received == 1 => {
                        seen = "reply".to_owned();
                        break;
                    }
                    Ok(_) => {}
                    Err(e) => seen = format!("error: {e}"),
                }
            }
            out.push(FleetCheck {
                host: name.clone(),
                check: format!(
                    "mesh address of {other} ({dst}) across {}",
                    ifname(&h.prefix)
                ),
                expected: "reply".to_owned(),
                ok: seen == "reply",
                seen,
            });
        }
    }
    out
}

/// Stops the `wireguard-go` of each host prefix (checked by name) and removes its socket.
/// Returns what was stopped.
#[must_use]
pub fn stop_devices(prefixes: &[String]) -> Vec<String> {
    let mut stopped = Vec::new();
    for p in prefixes {
        let i = ifname(p);
        let u = Uapi::new(&i);
        if let Ok(pid) = u.server_pid() {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            if comm.trim() == "wireguard-go"
                && let Ok(raw) = i32::try_from(pid)
            {
                let pid_ = nix::unistd::Pid::from_raw(raw);
                let _ = nix::sys::signal::kill(pid_, nix::sys::signal::Signal::SIGTERM);
                for _ in 0..50 {
                    if u.server_pid().is_err() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                let _ = nix::sys::signal::kill(pid_, nix::sys::signal::Signal::SIGKILL);
                stopped.push(format!("wireguard-go {i} (pid {pid})"));
            }
        }
        if u.server_pid().is_err() {
            let _ = std::fs::remove_file(u.path());
        }
    }
    stopped
}
