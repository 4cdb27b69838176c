//! The bench VMs' configs: a mesh address, both families via host, both limits, and optionally
//! public addresses and a 50-prefix firewall.

use super::{LIMITS, firewall, public};

pub(super) fn vm_config(
    uid: u32,
) -> Result<vmnet_model::vm::VmConfig, vmnet_model::ValidationError> {
    vm_config_with(uid, LIMITS.1, false, None)
}

/// A bench VM's config with public limit `public_limit` (MiB/s), when `public` public
/// addresses, and with `firewall` the 50-prefix firewall of that variant.
pub(super) fn vm_config_with(
    uid: u32,
    public_limit: u32,
    public: bool,
    firewall: Option<u32>,
) -> Result<vmnet_model::vm::VmConfig, vmnet_model::ValidationError> {
    let mut v = serde_json::json!({
        "id": format!("bench-{uid}"),
        "user_id": uid,
        "tenant": 1,
        "mesh_ipv6": format!("fdaa:1::{uid:x}"),
        "private_network_throughput_mibps": LIMITS.0,
        "public_network_throughput_mibps": public_limit,
        "network": {"routes": [
            {"destination": "0.0.0.0/0", "via": "host"},
            {"destination": "::/0", "via": "host"}
        ]}
    });
    if public {
        public::add_public(&mut v, uid);
    }
    if let Some(variant) = firewall {
        v["firewall"] = firewall::firewall(variant);
    }
    vmnet_model::vm::from_value(&v)
}
