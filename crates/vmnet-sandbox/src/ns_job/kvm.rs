//! `vmnet-lab up --sandbox --guests kvm` for a namespace-mode spec: a real Linux guest per VM
//! instead of a simulated one ([`crate::kvm::ns`]), booted by qemu in the VM's namespace on the
//! tap the agent made there, and the checks run from inside the guests:
//!
//! - boot, the guest address, the mesh address and host routes `vmnet-guest` applied from the
//!   metadata service, then the connectivity checks of [`super::checks`] (NAT, the MSS clamp,
//!   IPv6 via host, the mesh between guests, public addresses from the fake internet);
//! - bulk traffic through the clamp and a public limit measured by iperf3 in the guest
//!   ([`crate::kvm::ns_traffic`]);
//! - changes by `PUT` applied by `vmnet-guest` in the running guest while qemu holds the tap (a
//!   mesh address moved and back, a host route added and removed, a restart of vmnet-guest),
//!   each watched from inside the guest: see [`super::kvm_change`];
//! - wake on packet: a guest's qemu saved to a file and quit, a connection from the fake
//!   internet, and on the `vm_wake` event qemu restored on the same tap: the held SYN reaches the
//!   guest and the connection is served ([`super::kvm_wake`]).
//!
//! The firewall, metadata, packet-activity and firewall-change checks of the simulated guests
//! are not run with real guests. The guests stay up with the sandbox (their pids are in the state
//! file; `vmnet-lab down --sandbox` stops them), each with its serial console in
//! `<state>/vms/<vm>/console.log`.

use std::net::Ipv4Addr;
use std::time::Duration;

use vmnet_agent::api::types::VmView;
use vmnet_agent::client::Client;
use vmnet_model::Error;
use vmnet_model::vm::{Via, VmConfig};

use super::checks::CheckResult;
use super::steps::{self, VmRow};
use crate::kvm::ns::{self as kns, NsGuest};
use crate::kvm::{self, Vm, VmConfig as QemuConfig};
use crate::sandbox;
use crate::state::{Paths, SandboxState};

/// How long real guests get to boot and configure their network (TCG on a loaded host is slow).
const BOOT_WAIT: Duration = Duration::from_secs(600);

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
            disks: Vec::new(),
            cpus: 1,
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
    results.extend(super::kvm_change::run(client, &configs, &mut guests).await);
    results.extend(
        super::kvm_wake::run(client, inet, (paths, st), &configs, &mut guests, &mut rows).await,
    );
    for g in guests {
        g.vm.detach();
    }
    Ok((rows, results))
}
