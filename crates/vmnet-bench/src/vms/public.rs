//! `vmnet-lab bench vms --public`: every VM gets a public IPv4 and a public IPv6 /128, and at each N
//! one VM's public mapping is removed and added again as the agent applies a change of the
//! public addresses alone ([`NsDriver::apply_public`]: the netns's DNAT rule, the /32 route, the
//! host elements in one transaction, the conntrack flush handed on), timed.
//!
//! # Limitations
//! The addresses come from the documentation ranges only: 768 IPv4 addresses (192.0.2.0/24,
//! 198.51.100.0/24, 203.0.113.0/24), so VMs past the 768th get only the IPv6 (2001:db8:9::/64).

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use vmnet_kernel::ns::NsDriver;
use vmnet_model::Error;
use vmnet_plan::ns::{NsSettings, plan_vm};

/// How many mapping changes are timed per N (each direction).
pub const MAPPING_ROUNDS: u32 = 50;

/// The `i`-th IPv4 documentation address (0-based), `None` past the 768th.
#[must_use]
pub fn doc_v4(i: u32) -> Option<String> {
    ["192.0.2", "198.51.100", "203.0.113"]
        .get(usize::try_from(i / 256).ok()?)
        .map(|n| format!("{n}.{}", i % 256))
}

/// Adds VM `uid`'s public addresses to its config JSON.
pub fn add_public(v: &mut Value, uid: u32) {
    if let Some(a) = uid.checked_sub(1).and_then(doc_v4) {
        v["public_ipv4"] = json!(a);
    }
    v["public_ipv6"] = json!(format!("2001:db8:9::{uid:x}"));
}

/// Removes and adds back the public mapping of VM `uid` (set up already with its public
/// addresses) [`MAPPING_ROUNDS`] times: (add latencies, remove latencies).
///
/// # Errors
/// `INTERNAL` when an apply fails.
pub async fn bench_mapping(
    driver: &dyn NsDriver,
    settings: &NsSettings,
    uid: u32,
    config: impl Fn(bool) -> Result<vmnet_model::vm::VmConfig, Error>,
) -> Result<(Vec<Duration>, Vec<Duration>), Error> {
    let with = plan_vm(&config(true)?, settings)?;
    let without = plan_vm(&config(false)?, settings)?;
    let (mut add, mut remove) = (Vec::new(), Vec::new());
    for _ in 0..MAPPING_ROUNDS {
        for (plan, out) in [(&without, &mut remove), (&with, &mut add)] {
            let t = Instant::now();
            driver
                .apply_public(plan)
                .await
                .map_err(|e| Error::internal(format!("apply vm {uid}: {e}")))?;
            out.push(t.elapsed());
        }
    }
    Ok((add, remove))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documentation_addresses_only() {
        assert_eq!(doc_v4(0).as_deref(), Some("192.0.2.0"));
        assert_eq!(doc_v4(256).as_deref(), Some("198.51.100.0"));
        assert_eq!(doc_v4(767).as_deref(), Some("203.0.113.255"));
        assert_eq!(doc_v4(768), None);
    }
}
