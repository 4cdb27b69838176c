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

/// A running instance `id` of pool `p1` on host `h1`, without a lease.
fn instance(id: &str) -> Instance {
    Instance {
        instance_id: id.into(),
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
        sandbox: false,
        allocation_id: format!("alloc-7-{id}"),
        addresses: Vec::new(),
        machine: None,
        addresses_stale: false,
        addresses_polled_at_unix_ms: None,
    }
}

#[test]
fn the_nic_carries_the_stored_policy_sandbox_flag_and_allocation() {
    let mut inst = instance("inst-1");
    inst.sandbox = true;
    let bridge: IfName = "br0".parse().unwrap();
    let spec = spec_of(&inst, None, &bridge).unwrap();
    assert_eq!(spec.allocation_id, "alloc-7-inst-1");
    assert_eq!(spec.policy, vmnet_model::nic::NetworkPolicy::Private);
    assert!(spec.sandbox);
}

/// A lease from an IPv4 range added after the first reaches the NIC with that range's prefix
/// and gateway (and the first range's nameservers), not the first range's.
#[test]
fn the_nic_takes_the_range_its_lease_is_in() {
    let first = IpRange {
        pool_id: "p1".into(),
        cidr: "10.0.0.0/29".parse().unwrap(),
        gateway: "10.0.0.1".parse().unwrap(),
        first_host: "10.0.0.2".parse().unwrap(),
        last_host: "10.0.0.6".parse().unwrap(),
        dns: vec!["10.0.0.1".parse().unwrap()],
    };
    let second = PoolRange {
        pool_id: "p1".into(),
        family: vmnet_model::pool::Family::Ipv4,
        cidr: "10.0.1.0/24".parse().unwrap(),
        gateway: "10.0.1.1".parse().unwrap(),
        first_host: "10.0.1.2".parse().unwrap(),
        last_host: "10.0.1.254".parse().unwrap(),
    };
    let v6 = PoolRange {
        pool_id: "p1".into(),
        family: vmnet_model::pool::Family::Ipv6,
        cidr: "2001:db8::/64".parse().unwrap(),
        gateway: "2001:db8::1".parse().unwrap(),
        first_host: "2001:db8::2".parse().unwrap(),
        last_host: "2001:db8::ffff".parse().unwrap(),
    };
    let all = [v6, second];
    let mut inst = instance("inst-1");
    for (addr, cidr, gw) in [
        ("10.0.0.3", "10.0.0.0/29", "10.0.0.1"),
        ("10.0.1.9", "10.0.1.0/24", "10.0.1.1"),
    ] {
        inst.address = Some(addr.parse().unwrap());
        let r = lease_range(Some(&first), &all, &inst).expect(addr);
        assert_eq!(r.cidr.to_string(), cidr, "{addr}");
        assert_eq!(r.gateway.to_string(), gw, "{addr}");
        assert_eq!(r.dns, first.dns, "{addr}");
    }
    inst.address = Some("10.9.9.9".parse().unwrap());
    assert_eq!(
        lease_range(Some(&first), &all, &inst),
        None,
        "a lease in no range"
    );
    inst.address = None;
    assert_eq!(lease_range(Some(&first), &all, &inst), Some(first.clone()));
    assert_eq!(lease_range(None, &all, &inst), None);
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
