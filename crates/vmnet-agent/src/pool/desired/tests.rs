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
    let spec = spec_of(&inst, &NicRanges::default(), &bridge).unwrap();
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
    let ranges = NicRanges {
        first: Some(first.clone()),
        all: vec![PoolRange::from(&first), v6.clone(), second],
    };
    let mut inst = instance("inst-1");
    for (addr, cidr, gw) in [
        ("10.0.0.3", "10.0.0.0/29", "10.0.0.1"),
        ("10.0.1.9", "10.0.1.0/24", "10.0.1.1"),
    ] {
        inst.address = Some(addr.parse().unwrap());
        let r = ranges.lease_range(&inst).expect(addr);
        assert_eq!(r.cidr.to_string(), cidr, "{addr}");
        assert_eq!(r.gateway.to_string(), gw, "{addr}");
        assert_eq!(r.dns, first.dns, "{addr}");
    }
    // A lease in no range (the first was replaced since): the first range, so the NIC shows
    // it as /32 with the first range's gateway.
    inst.address = Some("10.9.9.9".parse().unwrap());
    assert_eq!(ranges.lease_range(&inst), Some(first.clone()));
    let bridge: IfName = "br0".parse().unwrap();
    let nic = &spec_of(&inst, &ranges, &bridge).unwrap().nics[0];
    assert_eq!(nic.addresses, ["10.9.9.9/32".parse::<IpNet>().unwrap()]);
    assert_eq!(nic.gateway, Some("10.0.0.1".parse().unwrap()));
    inst.address = None;
    assert_eq!(ranges.lease_range(&inst), Some(first.clone()));
    assert_eq!(NicRanges::default().lease_range(&inst), None);

    // Dual stack: the IPv4 lease with its range, then the IPv6 lease with the IPv6 range's
    // prefix and gateway.
    inst.address = Some("10.0.1.9".parse().unwrap());
    inst.address6 = Some("2001:db8::7".parse().unwrap());
    assert_eq!(ranges.lease6_range(&inst), Some(&v6));
    let nic = &spec_of(&inst, &ranges, &bridge).unwrap().nics[0];
    let addrs: Vec<String> = nic.addresses.iter().map(ToString::to_string).collect();
    assert_eq!(addrs, ["10.0.1.9/24", "2001:db8::7/64"]);
    assert_eq!(nic.gateway, Some("10.0.1.1".parse().unwrap()));
    assert_eq!(nic.gateway6, Some("2001:db8::1".parse().unwrap()));
    assert_eq!(nic.nameservers, first.dns);
}

/// An IPv6-only pool: the NIC takes the IPv6 lease and `gateway6`, no IPv4 gateway and no
/// nameservers; an IPv6 lease no range contains is a `/128` with the first IPv6 range's
/// gateway; without IPv6 ranges the lease is left out.
#[test]
fn an_ipv6_only_pool_gives_the_nic_its_ipv6_lease() {
    let v6 = PoolRange {
        pool_id: "p6".into(),
        family: vmnet_model::pool::Family::Ipv6,
        cidr: "2001:db8:6::/64".parse().unwrap(),
        gateway: "fe80::1".parse().unwrap(),
        first_host: "2001:db8:6::1".parse().unwrap(),
        last_host: "2001:db8:6::ffff".parse().unwrap(),
    };
    let ranges = NicRanges {
        first: None,
        all: vec![v6],
    };
    let bridge: IfName = "br0".parse().unwrap();
    let mut inst = instance("inst-6");
    inst.address6 = Some("2001:db8:6::1".parse().unwrap());
    let nic = &spec_of(&inst, &ranges, &bridge).unwrap().nics[0];
    assert_eq!(
        nic.addresses,
        ["2001:db8:6::1/64".parse::<IpNet>().unwrap()]
    );
    assert_eq!(
        (nic.gateway, nic.gateway6),
        (None, Some("fe80::1".parse().unwrap()))
    );
    assert!(nic.nameservers.is_empty());
    inst.address6 = Some("2001:db8:7::1".parse().unwrap());
    let nic = &spec_of(&inst, &ranges, &bridge).unwrap().nics[0];
    assert_eq!(
        nic.addresses,
        ["2001:db8:7::1/128".parse::<IpNet>().unwrap()]
    );
    assert_eq!(nic.gateway6, Some("fe80::1".parse().unwrap()));
    let nic = &spec_of(&inst, &NicRanges::default(), &bridge).unwrap().nics[0];
    assert!(nic.addresses.is_empty() && nic.gateway6.is_none());
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
