//! `vmnet-lab bench agent --all-features`: every namespace-mode feature on each VM, and the guests'
//! metadata connections held open, so the agent's RSS is read under the full load of issue 15.
//!
//! - Each VM's config adds, to the plain bench VM (a mesh address, both families via host),
//!   both throughput limits (private 100, public 20 MiB/s), a public IPv4 (the first
//!   [`PUBLIC_V4_VMS`]) and a public IPv6 /128, and a 50-prefix firewall (the configs of
//!   `vmnet-lab bench vms --public --firewall`). Metadata and packet activity are on in every bench
//!   agent. The mesh data plane is not: it needs a WireGuard interface the sandbox host lacks.
//! - At the last checkpoint every VM's guest is simulated as `vmnet-guest` connects: one
//!   keep-alive connection to 169.254.169.254:80 made inside the VM's namespace, a v2 token, one
//!   `GET /latest/meta-data`; the connections stay open while the agent's usage is read again.

use std::os::fd::AsFd;
use std::time::Duration;

use nix::sched::{CloneFlags, setns};
use serde_json::Value;
use vmnet_model::Error;
use vmnet_plan::ns::{NsSettings, plan_vm};

use crate::vms::{LIMITS, firewall, public};

/// VMs with a public IPv4: 192.0.2.0/24 and 198.51.100.0/24 (the sandbox's uplink is in the
/// third documentation range); every VM has a public IPv6.
pub const PUBLIC_V4_VMS: u32 = 512;

/// The body of bench VM `uid` with every feature on.
#[must_use]
pub fn vm_body_full(uid: u32) -> Value {
    let mut v = serde_json::json!({
        "id": format!("bench-{uid}"),
        "user_id": uid,
        "tenant": 1,
        "mesh_ipv6": format!("fdaa:1::{uid:x}"),
        "private_network_throughput_mibps": LIMITS.0,
        "public_network_throughput_mibps": LIMITS.1,
        "network": {"routes": [
            {"destination": "0.0.0.0/0", "via": "host"},
            {"destination": "::/0", "via": "host"}
        ]}
    });
    public::add_public(&mut v, uid);
    if uid > PUBLIC_V4_VMS {
        // 203.0.113.0/24 holds the sandbox's own uplink addresses, which the agent refuses.
        if let Some(o) = v.as_object_mut() {
            o.remove("public_ipv4");
        }
    }
    v["firewall"] = firewall::firewall(0);
    v
}

/// The open metadata connections of the simulated guests; closed on drop.
#[derive(Debug)]
pub struct Guests {
    /// Connections open.
    pub open: usize,
    /// Guests whose connection, token or first GET failed.
    pub failed: usize,
    _conns: Vec<std::net::TcpStream>,
}

/// Connects the guests of VMs `1..=n` (configs from `body`, the agent's `prefix`), as
/// `vmnet-guest` does, from a thread of its own (it enters each VM's namespace).
///
/// # Errors
/// `INTERNAL` when a VM cannot be planned or the thread fails.
pub fn connect_guests(n: u32, prefix: &str, body: impl Fn(u32) -> Value) -> Result<Guests, Error> {
    let settings = NsSettings {
        name_prefix: prefix.to_owned(),
        ..NsSettings::default()
    };
    let mut spaces = Vec::new();
    for uid in 1..=n {
        let cfg = vmnet_model::vm::from_value(&body(uid))?;
        spaces.push(plan_vm(&cfg, &settings)?.netns);
    }
    std::thread::spawn(move || {
        let mut conns = Vec::new();
        let mut failed = 0;
        for ns in &spaces {
            let conn = vmnet_kernel::netns::open(ns)
                .map_err(std::io::Error::other)
                .and_then(|f| {
                    setns(f.as_fd(), CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)
                })
                .and_then(|()| crate::metadata::open_guest(Duration::from_secs(2)));
            match conn {
                Ok(c) => conns.push(c),
                Err(_) => failed += 1,
            }
        }
        Guests {
            open: conns.len(),
            failed,
            _conns: conns,
        }
    })
    .join()
    .map_err(|_| Error::internal("guest connections: thread panicked"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_feature_is_in_a_valid_config() {
        for uid in [1, PUBLIC_V4_VMS, PUBLIC_V4_VMS + 1, 1000] {
            let v = vm_body_full(uid);
            let cfg = vmnet_model::vm::from_value(&v).expect("valid");
            assert!(cfg.public_ipv6.is_some(), "{uid}");
            assert_eq!(cfg.public_ipv4.is_some(), uid <= PUBLIC_V4_VMS, "{uid}");
            assert!(cfg.firewall.as_ref().is_some_and(|f| f.enabled), "{uid}");
            assert_eq!(cfg.private_network_throughput_mibps, LIMITS.0);
            assert_eq!(cfg.public_network_throughput_mibps, LIMITS.1);
        }
    }
}
