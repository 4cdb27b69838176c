//! Tap names that are orphans, tap ownership by prefix, and the stored instance's NIC.

use super::*;

#[test]
fn only_instance_tap_names_are_orphans() {
    let t = vmnet_model::nic::tap_name("inst-1", 0).unwrap();
    assert!(is_instance_tap(t.as_str()));
    assert!(is_instance_tap("bc0123456789n99"));
    for other in [
        "bcm0",
        "bc0123456789",
        "bc0123456789n",
        "bc0123456789n100",
        "bc0123456789x0",
        "bcABCDEF0123n0",
        "br0",
    ] {
        assert!(!is_instance_tap(other), "{other}");
    }
}

#[test]
fn the_nic_carries_the_stored_policy_sandbox_flag_and_allocation() {
    let inst = Instance {
        instance_id: "inst-1".into(),
        pool_id: "p1".into(),
        host_id: Some("h1".into()),
        vcpus: 1,
        memory_mib: 512,
        recreate_on_host_loss: false,
        state: vmnet_model::pool::InstanceState::Running,
        conditions: Vec::new(),
        address: None,
        address6: None,
        network_policy: vmnet_model::nic::NetworkPolicy::Private,
        sandbox: true,
        allocation_id: "alloc-7-inst-1".into(),
        addresses: Vec::new(),
        machine: None,
        addresses_stale: false,
        addresses_polled_at_unix_ms: None,
    };
    let bridge: IfName = "br0".parse().unwrap();
    let spec = spec_of(&inst, None, &bridge).unwrap();
    assert_eq!(spec.allocation_id, "alloc-7-inst-1");
    assert_eq!(spec.policy, vmnet_model::nic::NetworkPolicy::Private);
    assert!(spec.sandbox);
}

#[test]
fn an_instance_owns_its_taps_by_their_prefix() {
    let p = tap_prefix("inst-1");
    assert_eq!(p.len(), TAP_PREFIX_LEN);
    for i in [0, 7, 15] {
        let t = vmnet_model::nic::tap_name("inst-1", i).unwrap();
        assert!(t.as_str().starts_with(&p), "{t}");
        assert!(!t.as_str().starts_with(&tap_prefix("inst-2")));
    }
}
