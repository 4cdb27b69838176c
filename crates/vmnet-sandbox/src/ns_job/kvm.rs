//! `vmnet-lab up --sandbox --guests kvm` for a namespace-mode spec: a real Linux guest per VM
//! instead of a simulated one ([`crate::kvm::ns`]), booted by qemu in the VM's namespace on the
//! tap the agent made there, and the checks run from inside the guests:
//!
//! - boot, the guest address, the mesh address and host routes `vmnet-guest` applied from the
//!   metadata service, then the connectivity checks of [`super::checks`] (NAT, the MSS clamp,
//!   IPv6 via host, the mesh between guests, public addresses from the fake internet);
//! - bulk traffic through the clamp and a public limit measured by iperf3 in the guest
//!   ([`crate::kvm::ns_traffic`]);
//! - a mesh address change by `PUT`, applied by `vmnet-guest` in the running guest while qemu
//!   holds the tap: the new address is on `eth0` and a mesh peer reaches it, the old one no
//!   longer answers; then a `PUT` of the original config puts the original address back.
//!
//! | check | expected |
//! |---|---|
//! | `mesh address change by PUT, in the running guest` | `<new>/128` on `eth0` |
//! | `mesh -> <vm> at its new address` | `from <peer mesh>` (from the peer's guest) |
//! | `mesh -> <vm> at its old address` | `no reach` |
//! | `mesh address changed back by PUT` | `<original>/128` |
//!
//! The firewall, metadata, packet-activity and firewall-change checks of the simulated guests
//! are not run with real guests. The guests stay up with the sandbox (their pids are in the state
//! file; `vmnet-lab down --sandbox` stops them), each with its serial console in
//! `<state>/vms/<vm>/console.log`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use vmnet_agent::api::types::VmView;
use vmnet_agent::client::{Client, segment};
use vmnet_model::Error;
use vmnet_model::vm::{Via, VmConfig};

use super::checks::{CheckResult, NO_REACH};
use super::steps::{self, VmRow};
use crate::kvm::ns::{self as kns, NsGuest};
use crate::kvm::{self, Vm, VmConfig as QemuConfig};
use crate::sandbox::{self, ECHO_PORT};
use crate::state::{Paths, SandboxState};

/// How long real guests get to boot and configure their network (TCG on a loaded host is slow).
const BOOT_WAIT: Duration = Duration::from_secs(600);
/// How long `vmnet-guest` gets to apply a changed mesh address.
const CHANGE_WAIT: Duration = Duration::from_secs(30);

/// Boots a real guest for each applied VM of `views` and runs the checks of the module docs;
/// `host` is `(prefix, host namespace, uplink IPv4)`, `inet` the fake internet. The VM rows and
/// check results; the guests are left running.
///
/// # Errors
/// `UNAVAILABLE` when the guest image cannot be built, `INTERNAL` when qemu cannot start.
pub(super) async fn run(
    paths: &Paths,
    st: &mut SandboxState,
    client: &Client,
    views: &[VmView],
    host: (&str, &str, Ipv4Addr),
    inet: &str,
) -> Result<(Vec<VmRow>, Vec<CheckResult>), Error> {
    let (image, accel) = kvm::setup()?;
    let mut guests = Vec::new();
    let mut rows = Vec::new();
    let mut infos = Vec::new();
    for v in views {
        let cfg = QemuConfig {
            name: v.config.id.clone(),
            netns: v.status.netns.clone(),
            nic_args: kns::nic_args(&v.status.tap, &v.status.guest_mac),
            seed_iso: None,
            cmdline_extra: kns::CMDLINE.into(),
            memory_mib: 384,
        };
        let vm = Vm::start(&cfg, &image, accel, &paths.dir)?;
        steps::record(paths, st, &format!("qemu {}", v.config.id), vm.pid())?;
        rows.push(steps::vm_row(v, &format!("qemu {}", vm.pid())));
        let mut info = steps::guest_info(host, v, "");
        info.public = super::public::public_check(
            &v.config,
            inet,
            sandbox::INET_UPLINK_V4,
            sandbox::INET_UPLINK_V6,
        );
        infos.push(info);
        guests.push(NsGuest {
            id: v.config.id.clone(),
            vm,
            ch: None,
            mesh: v.config.mesh_ipv6,
            host_routes6: v
                .config
                .network
                .routes
                .iter()
                .filter(|r| r.via == Via::Host && matches!(r.destination, ipnet::IpNet::V6(_)))
                .map(|r| r.destination.to_string())
                .collect(),
            ready_secs: None,
        });
    }
    let configs: Vec<VmConfig> = views.iter().map(|v| v.config.clone()).collect();
    let mut results = tokio::task::block_in_place(|| {
        let mut r = kns::wait_ready(&mut guests, BOOT_WAIT);
        for g in &guests {
            if let Some(s) = g.ready_secs {
                eprintln!("{}: network ready {s:.1} s after its qemu started", g.id);
            }
        }
        r.extend(kns::run_checks(&mut guests, &infos));
        r.extend(kvm::ns_traffic::run(inet, &configs, &mut guests));
        r
    });
    results.extend(mesh_change(client, &configs, &mut guests).await);
    for g in guests {
        g.vm.detach();
    }
    Ok((rows, results))
}

/// The VM whose mesh address the change check moves (index into `vms`) and the peer that
/// probes it: the first VM with a mesh address, no firewall and no VM routing via it (one
/// without public addresses if there is one), and another VM with a mesh address and no
/// firewall of the same tenant.
#[must_use]
pub fn change_pair(vms: &[VmConfig]) -> Option<(usize, usize)> {
    let plain =
        |v: &VmConfig| v.mesh_ipv6.is_some() && !v.firewall.as_ref().is_some_and(|f| f.enabled);
    let gateway = |m: Option<Ipv6Addr>| {
        vms.iter()
            .flat_map(|w| &w.network.routes)
            .any(|r| Some(r.via) == m.map(Via::Mesh))
    };
    // A VM without public addresses first: its move touches nothing but the mesh.
    let public = |v: &VmConfig| v.public_ipv4.is_some() || v.public_ipv6.is_some();
    let m = (0..vms.len())
        .filter(|&i| plain(&vms[i]) && !gateway(vms[i].mesh_ipv6))
        .min_by_key(|&i| public(&vms[i]))?;
    let p = vms
        .iter()
        .enumerate()
        .position(|(j, w)| j != m && plain(w) && w.tenant == vms[m].tenant)?;
    Some((m, p))
}

/// A mesh address for `old` that no VM of `vms` holds: its last group with the top bit flipped.
#[must_use]
pub fn moved_mesh(old: Ipv6Addr, vms: &[VmConfig]) -> Option<Ipv6Addr> {
    let mut seg = old.segments();
    (0..16u16).find_map(|k| {
        seg[7] = old.segments()[7] ^ (0x8000 | k);
        let a = Ipv6Addr::from(seg);
        (!vms.iter().any(|v| v.mesh_ipv6 == Some(a))).then_some(a)
    })
}

async fn mesh_change(
    client: &Client,
    vms: &[VmConfig],
    guests: &mut [NsGuest],
) -> Vec<CheckResult> {
    let Some((m, p)) = change_pair(vms) else {
        return Vec::new();
    };
    let (Some(old), Some(peer_mesh)) = (vms[m].mesh_ipv6, vms[p].mesh_ipv6) else {
        return Vec::new();
    };
    let Some(new) = moved_mesh(old, vms) else {
        return Vec::new();
    };
    let (Some(gi), Some(pi)) = (
        guests.iter().position(|g| g.id == vms[m].id),
        guests.iter().position(|g| g.id == vms[p].id),
    ) else {
        return Vec::new();
    };
    let id = vms[m].id.clone();
    let path = format!("/v1/vms/{}", segment(&id));
    let mut changed = vms[m].clone();
    changed.mesh_ipv6 = Some(new);
    let mut out = Vec::new();
    let mut add = |check: String, expected: String, seen: String| {
        out.push(CheckResult {
            vm: id.clone(),
            ok: seen == expected,
            check,
            expected,
            seen,
        });
    };
    let want = format!("{new}/128");
    let seen = match client.put::<VmView>(&path, &changed).await {
        Err(e) => format!("PUT failed: {e}"),
        Ok(_) => {
            tokio::task::block_in_place(|| guests[gi].wait_addresses(&want, "-6", CHANGE_WAIT))
        }
    };
    let applied = seen == want;
    add(
        "mesh address change by PUT, in the running guest".into(),
        want,
        seen,
    );
    if applied {
        let (to_new, to_old) = tokio::task::block_in_place(|| {
            let at = |a: Ipv6Addr| SocketAddr::new(IpAddr::V6(a), ECHO_PORT);
            let g = &mut guests[pi];
            let mut s = kns::probe(g, "tcp", at(new), None);
            if s == NO_REACH {
                std::thread::sleep(Duration::from_secs(1));
                s = kns::probe(g, "tcp", at(new), None);
            }
            (s, kns::probe(g, "tcp", at(old), None))
        });
        add(
            format!("mesh -> {id} at its new address, from {}", vms[p].id),
            format!("from {peer_mesh}"),
            to_new,
        );
        add(
            format!("mesh -> {id} at its old address, from {}", vms[p].id),
            NO_REACH.into(),
            to_old,
        );
    }
    let want = format!("{old}/128");
    let seen = match client.put::<VmView>(&path, &vms[m]).await {
        Err(e) => format!("PUT failed: {e}"),
        Ok(_) => {
            tokio::task::block_in_place(|| guests[gi].wait_addresses(&want, "-6", CHANGE_WAIT))
        }
    };
    add("mesh address changed back by PUT".into(), want, seen);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vms() -> Vec<VmConfig> {
        let spec = include_str!("../../../../examples/host.json");
        vmnet_agent::hostspec::HostSpec::parse("host.json", spec)
            .expect("example spec")
            .vms
    }

    #[test]
    fn the_change_moves_a_plain_vm_that_is_no_gateway_and_a_peer_probes_it() {
        let vms = vms();
        let (m, p) = change_pair(&vms).expect("a pair");
        // vm-gateway carries vm-behind-gateway's route; vm-firewall filters: vm-isolated moves.
        assert_eq!(vms[m].id, "vm-isolated");
        assert_eq!(vms[p].id, "vm-gateway");
    }

    #[test]
    fn the_two_vm_example_moves_the_vm_without_public_addresses() {
        let spec = include_str!("../../../../examples/ns-kvm.json");
        let vms = vmnet_agent::hostspec::HostSpec::parse("ns-kvm.json", spec)
            .expect("example spec")
            .vms;
        let (m, p) = change_pair(&vms).expect("a pair");
        assert_eq!(
            (vms[m].id.as_str(), vms[p].id.as_str()),
            ("vm-isolated", "vm-gateway")
        );
    }

    #[test]
    fn the_moved_address_is_free() {
        let vms = vms();
        let old: Ipv6Addr = "fdaa:1::8".parse().unwrap();
        assert_eq!(moved_mesh(old, &vms), Some("fdaa:1::8008".parse().unwrap()));
        let mut taken = vms.clone();
        taken[0].mesh_ipv6 = Some("fdaa:1::8008".parse().unwrap());
        assert_eq!(
            moved_mesh(old, &taken),
            Some("fdaa:1::8009".parse().unwrap())
        );
    }
}
