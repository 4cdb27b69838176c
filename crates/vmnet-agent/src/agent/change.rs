//! What kind of change a PUT makes to a VM's config: the agent applies a firewall-only change by
//! replacing the VM's netns table and a limits-only change by changing its HTB classes in place,
//! instead of a full apply.

use vmnet_model::vm::VmConfig;

/// Whether `new` differs from `old` in its firewall only (and does differ).
pub(super) fn firewall_only_change(old: &VmConfig, new: &VmConfig) -> bool {
    let same_rest = VmConfig {
        firewall: new.firewall.clone(),
        ..old.clone()
    };
    same_rest == *new && old != new
}

/// Whether `new` differs from `old` in its throughput limits only (and does differ).
pub(super) fn limits_only_change(old: &VmConfig, new: &VmConfig) -> bool {
    let same_rest = VmConfig {
        private_network_throughput_mibps: new.private_network_throughput_mibps,
        public_network_throughput_mibps: new.public_network_throughput_mibps,
        ..old.clone()
    };
    same_rest == *new && old != new
}
