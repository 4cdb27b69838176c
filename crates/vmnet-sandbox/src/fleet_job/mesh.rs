//! The fleet's WireGuard mesh: every host's agent runs `vmnet serve --mesh` with an interface
//! `<host prefix>wg` (unique on the machine) and a mesh address the sandbox hands out as the
//! control plane would (`fdaa::<host index>`), and the mesh's data plane: its BPF maps pinned on
//! a bpffs mounted at `<state>/<host>/mesh-bpf` ([`MESH_BPF_DIR`]), its VM registrations in a
//! database `mesh` of the fleet's PostgreSQL cluster that every agent shares. Once all hosts are
//! up, each is synced with the others (endpoints on the private network, IPv6); the checks ping
//! every other host's mesh address across the interface, and send TCP from every VM's guest to
//! every VM's mesh address on the other hosts ([`vm_plan`]: answered within a tenant, dropped
//! between tenants). `vmnet-lab down` stops each host's `wireguard-go` (which outlives its agent by
//! design) by the pid serving the interface's UAPI socket, and unmounts the bpffs.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};
use vmnet_agent::client::Client;
use vmnet_agent::mesh::runtime::DEFAULT_PORT;
use vmnet_agent::mesh::view::{MeshView, SyncOutcome};
use vmnet_kernel::wg::uapi::Uapi;
use vmnet_model::Error;

use super::checks::FleetCheck;
use crate::echo::EchoService;
use crate::fleet::HostNet;
use crate::sandbox::ECHO_PORT;
use crate::{SandboxError, traffic};

/// The directory (under each host's state directory) where its agent's mesh maps are pinned.
pub const MESH_BPF_DIR: &str = "mesh-bpf";
/// The database of the fleet's VM registrations (shared by every agent).
pub const REGISTRY_DB: &str = "mesh";

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

/// The `vmnet serve` arguments that turn the mesh on for `net`, its data plane pinned under
/// `bpf_root` (a mounted bpffs) and its VMs registered in `registry`.
#[must_use]
pub fn agent_args(net: &HostNet, bpf_root: &Path, registry: &str) -> Vec<String> {
    vec![
        "--mesh".to_owned(),
        "--wg-interface".to_owned(),
        ifname(&net.prefix),
        "--mesh-address".to_owned(),
        host_mesh(net).to_string(),
        "--mesh-bpf-root".to_owned(),
        bpf_root.display().to_string(),
        "--mesh-registry".to_owned(),
        registry.to_owned(),
    ]
}

/// Mounts a bpffs for a host's mesh maps at `dir` (made first).
///
/// # Errors
/// When the directory cannot be made or the mount fails.
pub fn mount_bpf(dir: &Path) -> Result<(), SandboxError> {
    std::fs::create_dir_all(dir).map_err(|e| SandboxError::Io {
        what: format!("mkdir {}", dir.display()),
        source: e,
    })?;
    if !vmnet_kernel::mesh::is_bpffs(dir) {
        vmnet_kernel::mesh::mount_bpffs(dir).map_err(|e| SandboxError::Io {
            what: format!("mount bpffs at {}", dir.display()),
            source: e,
        })?;
    }
    Ok(())
}

/// Unmounts the mesh bpffs of every host state directory under `sandbox_dir` (the pins go
/// with it). Returns the directories unmounted.
#[must_use]
pub fn unmount_bpf(sandbox_dir: &Path) -> Vec<String> {
    let mut done = Vec::new();
    let Ok(entries) = std::fs::read_dir(sandbox_dir) else {
        return done;
    };
    for e in entries.flatten() {
        let dir = e.path().join(MESH_BPF_DIR);
        if vmnet_kernel::mesh::is_bpffs(&dir)
            && nix::mount::umount2(&dir, nix::mount::MntFlags::MNT_DETACH).is_ok()
        {
            done.push(dir.display().to_string());
        }
    }
    done
}

/// A VM with a mesh address and its simulated guest, for the checks across hosts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeshGuest {
    /// The host's name.
    pub host: String,
    /// The VM id.
    pub vm: String,
    /// The guest's namespace.
    pub guest_ns: String,
    /// The VM's mesh address.
    pub mesh: Ipv6Addr,
    /// The VM's tenant.
    pub tenant: u32,
}

/// One planned VM-to-VM check across hosts: from guest `from` to guest `to`'s mesh address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmPlan {
    /// Index of the source guest.
    pub from: usize,
    /// Index of the target guest.
    pub to: usize,
    /// The check's name.
    pub name: String,
    /// What it should see: `from <source mesh>` within a tenant, `no reach` between tenants
    /// (no tenant-0 whitelist is synced in the sandbox).
    pub expected: String,
}

/// The VM-to-VM checks across hosts for `guests`: every ordered pair on different hosts.
#[must_use]
pub fn vm_plan(guests: &[MeshGuest]) -> Vec<VmPlan> {
    let mut out = Vec::new();
    for (i, a) in guests.iter().enumerate() {
        for (j, b) in guests.iter().enumerate().filter(|(_, b)| b.host != a.host) {
            let expected = if a.tenant == b.tenant {
                format!("from {}", a.mesh)
            } else {
                crate::ns_job::checks::NO_REACH.to_owned()
            };
            out.push(VmPlan {
                from: i,
                to: j,
                name: format!(
                    "vm {} -> {} on {} (mesh, tenant {} -> {})",
                    a.vm, b.vm, b.host, a.tenant, b.tenant
                ),
                expected,
            });
        }
    }
    out
}

/// Runs [`vm_plan`]: an echo service on every guest's mesh address, then TCP from each guest
/// (up to 3 tries for an answer expected; the first packets of a flow can wait for a tunnel's
/// handshake).
///
/// # Errors
/// When an echo service cannot be started.
pub fn vm_checks(guests: &[MeshGuest]) -> Result<Vec<FleetCheck>, SandboxError> {
    let mut services = Vec::new();
    for g in guests {
        services.push(EchoService::start(
            &g.guest_ns,
            &[SocketAddr::new(IpAddr::V6(g.mesh), ECHO_PORT)],
        )?);
    }
    let mut out = Vec::new();
    for p in vm_plan(guests) {
        let (a, b) = (&guests[p.from], &guests[p.to]);
        let target = SocketAddr::new(IpAddr::V6(b.mesh), ECHO_PORT);
        let tries = if p.expected == crate::ns_job::checks::NO_REACH {
            1
        } else {
            3
        };
        let mut seen = crate::ns_job::checks::NO_REACH.to_owned();
        for _ in 0..tries {
            if let Ok(r) = traffic::tcp_echo(&a.guest_ns, target, Duration::from_secs(1)) {
                seen = format!("from {}", r.peer.ip());
                break;
            }
        }
        out.push(FleetCheck {
            host: a.host.clone(),
            check: p.name,
            ok: seen == p.expected,
            expected: p.expected,
            seen,
        });
    }
    drop(services);
    Ok(out)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn g(host: &str, vm: &str, mesh: &str, tenant: u32) -> MeshGuest {
        MeshGuest {
            host: host.into(),
            vm: vm.into(),
            guest_ns: format!("ns-{vm}"),
            mesh: mesh.parse().unwrap(),
            tenant,
        }
    }

    #[test]
    fn vms_on_other_hosts_answer_within_their_tenant_only() {
        let guests = [
            g("host-1", "a", "fdaa:1::1", 1),
            g("host-1", "b", "fdaa:1::2", 2),
            g("host-2", "c", "fdaa:2::1", 2),
        ];
        let p = vm_plan(&guests);
        let pairs: Vec<(usize, usize, &str)> = p
            .iter()
            .map(|x| (x.from, x.to, x.expected.as_str()))
            .collect();
        assert_eq!(
            pairs,
            vec![
                (0, 2, "no reach"),
                (1, 2, "from fdaa:1::2"),
                (2, 0, "no reach"),
                (2, 1, "from fdaa:2::1"),
            ],
            "same-host pairs are the single-host job's; across hosts only tenant 2 answers"
        );
        assert_eq!(p[1].name, "vm b -> c on host-2 (mesh, tenant 2 -> 2)");
    }
}
