//! Unit tests of the pure parts of [`super`] and of the create path.

use vmnet_model::vm::parse_vm_config;
use vmnet_plan::ns::{NsSettings, plan_vm};

use super::super::create::create_body;
use super::*;

fn plan(mesh: bool) -> VmPlan {
    let json = if mesh {
        r#"{"id":"a","user_id":7,"tenant":0,"mesh_ipv6":"fdaa::7","network":{"routes":[{"destination":"0.0.0.0/0","via":"host"}]}}"#
    } else {
        r#"{"id":"a","user_id":7,"tenant":0}"#
    };
    plan_vm(
        &parse_vm_config(json.as_bytes()).unwrap(),
        &NsSettings::default(),
    )
    .unwrap()
}

/// The state a correct apply of `p` leaves (links 1..=3 in the netns, 10 on the host).
fn good_state(p: &VmPlan) -> VmState {
    let mut st = VmState::default();
    let link = |name: &str, index, mtu| KLink {
        index,
        name: name.into(),
        mtu,
        up: true,
        mac: None,
        no_auto_link_local: true,
        ipv6_off: false,
    };
    st.ns_links.insert("lo".into(), link("lo", 1, 65536));
    st.ns_links
        .insert(p.tap.name.clone(), link(&p.tap.name, 2, 1380));
    st.ns_addrs.insert((2, IpAddr::V4(p.tap.ipv4.addr()), 30));
    st.ns_addrs
        .insert((2, IpAddr::V6(p.tap.ipv6_link_local.addr()), 64));
    st.ns_addrs
        .insert((2, IpAddr::V4(p.tap.metadata_ipv4.addr()), 32));
    if let Some(v) = &p.veth {
        let peer = KLink {
            mac: Some(v.peer_mac),
            ..link(&v.peer_name, 3, 1380)
        };
        st.ns_links.insert(v.peer_name.clone(), peer);
        st.ns_addrs.insert((3, IpAddr::V4(v.peer_ipv4.addr()), 30));
        st.ns_addrs
            .insert((3, IpAddr::V6(v.peer_ipv6_link_local.addr()), 64));
        st.host_link = Some(KLink {
            mac: Some(v.host_mac),
            no_auto_link_local: true,
            ..link(&v.host_name, 10, 1380)
        });
        st.host_addrs
            .insert((10, IpAddr::V4(v.host_ipv4.addr()), 30));
        let entry = |mac| KNeigh {
            mac: Some(mac),
            permanent: true,
        };
        st.ns_neigh = Some(entry(v.host_mac));
        st.host_neigh = Some(entry(v.peer_mac));
    }
    st
}

#[test]
fn a_good_state_has_no_fixed_drift() {
    for mesh in [true, false] {
        let p = plan(mesh);
        let st = good_state(&p);
        assert_eq!(link_fixes(&p, &st), []);
        assert_eq!(fixed_drift(&p, &st), None);
    }
}

#[test]
fn missing_links_are_fixed_one_by_one_never_by_a_rebuild() {
    let p = plan(true);
    let peer = p.veth.as_ref().unwrap().peer_name.clone();
    let mut st = good_state(&p);
    st.host_link = None;
    assert_eq!(
        link_fixes(&p, &st),
        [LinkFix::HalfVeth { host_left: false }]
    );
    st.ns_links.remove(&peer);
    assert_eq!(link_fixes(&p, &st), [LinkFix::AddVeth]);
    let mut st = good_state(&p);
    st.ns_links.remove(&peer);
    assert_eq!(link_fixes(&p, &st), [LinkFix::HalfVeth { host_left: true }]);
    let mut st = good_state(&p);
    st.ns_links.remove(&p.tap.name);
    assert_eq!(link_fixes(&p, &st), [LinkFix::Tap]);
    // A mesh address added: the pair is added; removed: the pair is deleted.
    let q = plan(false);
    assert_eq!(link_fixes(&p, &good_state(&q)), [LinkFix::AddVeth]);
    assert_eq!(link_fixes(&q, &good_state(&p)), [LinkFix::DelVeth]);
    assert!(matches!(
        LinkFix::DelVeth.change(&q),
        Change::DelVeth { host } if host == "vmnh0007"
    ));
}

#[test]
fn stale_addresses_are_drift_link_locals_the_plan_does_not_put_included() {
    let p = plan(true);
    let mut st = good_state(&p);
    st.ns_addrs
        .insert((2, "fe80::4:ff:fe00:1".parse().unwrap(), 64));
    assert_eq!(
        fixed_drift(&p, &st).unwrap(),
        "vmnn0007: vmnt0007 stale addresses fe80::4:ff:fe00:1/64"
    );
    st.ns_addrs.insert((2, "172.16.0.5".parse().unwrap(), 30));
    st.host_addrs
        .insert((10, "2001:db8::9".parse().unwrap(), 64));
    assert_eq!(
        fixed_drift(&p, &st).unwrap(),
        "vmnn0007: vmnt0007 stale addresses 172.16.0.5/30 fe80::4:ff:fe00:1/64; host vmnh0007 stale addresses 2001:db8::9/64"
    );
}

#[test]
fn fixed_drift_names_what_is_wrong() {
    let p = plan(true);
    let mut st = good_state(&p);
    st.ns_links.get_mut(&p.tap.name).unwrap().mtu = 1500;
    st.host_addrs.clear();
    st.sysctls_bad = vec!["net/ipv4/ip_forward".into()];
    let what = fixed_drift(&p, &st).unwrap();
    assert_eq!(
        what,
        "vmnn0007: vmnt0007 mtu/up; host vmnh0007 addresses; sysctls net/ipv4/ip_forward"
    );
}

#[test]
fn the_create_transaction_skips_only_the_replace_prologue() {
    let p = plan(true);
    let full = p.nft["nftables"].as_array().unwrap().clone();
    let fresh: serde_json::Value = serde_json::from_str(&create_body(&p, false)).unwrap();
    let fresh = fresh["nftables"].as_array().unwrap();
    assert_eq!(fresh.len(), full.len() - 2);
    assert_eq!(fresh[..], full[2..]);
    assert!(fresh.iter().all(|c| c.get("delete").is_none()));
    // Without the firewall's accept rules: here the plan has none, so the same.
    let same: serde_json::Value = serde_json::from_str(&create_body(&p, true)).unwrap();
    assert_eq!(same["nftables"].as_array().unwrap(), fresh);
}

#[test]
fn every_ipv6_address_on_the_host_end_is_stale() {
    // A host end made when the plan put `fe80::1:<uid>/128` on it, or one given a link-local
    // by hand: the host end carries no IPv6 address.
    let p = plan(true);
    let v = p.veth.as_ref().unwrap();
    for ll in [
        v.host_ipv6_link_local.addr(),
        "fe80::aa:bbff:fecc:1".parse().unwrap(),
    ] {
        let mut st = good_state(&p);
        st.host_addrs.insert((10, IpAddr::V6(ll), 128));
        let drift = fixed_drift(&p, &st).expect("drift");
        assert_eq!(
            drift,
            format!("vmnn0007: host {} stale addresses {ll}/128", v.host_name)
        );
    }
    // In the netns too (`addrgenmode none`: the kernel makes none there), a link-local the
    // plan does not put on the VM end is stale.
    let mut st = good_state(&p);
    st.ns_addrs
        .insert((3, IpAddr::V6("fe80::aa:bbff:fecc:1".parse().unwrap()), 64));
    assert_eq!(
        fixed_drift(&p, &st).unwrap(),
        format!(
            "vmnn0007: {} stale addresses fe80::aa:bbff:fecc:1/64",
            v.peer_name
        )
    );
}

#[test]
fn a_wrong_veth_mac_neighbour_entry_addrgenmode_or_ipv6_off_is_drift() {
    let p = plan(true);
    let v = p.veth.as_ref().unwrap();
    type Edit = fn(&mut VmState);
    let cases: [(&str, Edit); 9] = [
        ("host vmnh0007 disable_ipv6", |st| {
            st.host_link.as_mut().unwrap().ipv6_off = true;
        }),
        ("vmnp0007 disable_ipv6", |st| {
            st.ns_links.get_mut("vmnp0007").unwrap().ipv6_off = true;
        }),
        ("vmnt0007 disable_ipv6", |st| {
            st.ns_links.get_mut("vmnt0007").unwrap().ipv6_off = true;
        }),
        ("host vmnh0007 mac", |st| {
            st.host_link.as_mut().unwrap().mac = Some([2, 0, 0, 0, 0, 1])
        }),
        ("vmnp0007 mac", |st| {
            st.ns_links.get_mut("vmnp0007").unwrap().mac = None;
        }),
        ("vmnp0007 neighbour fe80::1:7", |st| st.ns_neigh = None),
        ("host vmnh0007 addrgenmode", |st| {
            st.host_link.as_mut().unwrap().no_auto_link_local = false;
        }),
        ("host vmnh0007 neighbour fe80::2", |st| {
            st.host_neigh.as_mut().unwrap().permanent = false;
        }),
        ("host vmnh0007 neighbour fe80::2", |st| {
            st.host_neigh.as_mut().unwrap().mac = Some([6, 2, 0, 0, 0, 8]);
        }),
    ];
    for (want, edit) in cases {
        let mut st = good_state(&p);
        edit(&mut st);
        assert_eq!(fixed_drift(&p, &st).unwrap(), format!("vmnn0007: {want}"));
    }
    // The planned MACs are the uid's.
    assert_eq!(
        (v.host_mac, v.peer_mac),
        vmnet_plan::ns::veth_macs(p.user_id)
    );
}

#[test]
fn a_missing_metadata_address_is_drift() {
    for mesh in [true, false] {
        let p = plan(mesh);
        let mut st = good_state(&p);
        st.ns_addrs
            .remove(&(2, IpAddr::V4(p.tap.metadata_ipv4.addr()), 32));
        let d = fixed_drift(&p, &st).expect("drift");
        assert!(d.contains(&format!("{} addresses", p.tap.name)), "{d}");
    }
}

#[test]
fn a_vm_side_link_with_a_kernel_made_link_local_is_drift() {
    let p = plan(true);
    let v = p.veth.as_ref().unwrap();
    let mut st = good_state(&p);
    st.ns_links
        .get_mut(&v.peer_name)
        .unwrap()
        .no_auto_link_local = false;
    let eui64: IpAddr = "fe80::402:ff:fe00:7".parse().unwrap();
    st.ns_addrs.insert((3, eui64, 64));
    let drift = fixed_drift(&p, &st).expect("drift");
    assert!(
        drift.contains(&format!("{} addrgenmode", v.peer_name))
            && drift.contains(&format!(
                "{} stale addresses fe80::402:ff:fe00:7/64",
                v.peer_name
            )),
        "{drift}"
    );
}
