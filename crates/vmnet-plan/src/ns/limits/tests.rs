//! Unit tests of the limits plan: which trees exist, their classes, and what the filters do to
//! real header bytes (a small u32 evaluator walks the planned keys like the kernel does).

use std::net::IpAddr;

use proptest::prelude::*;

use super::*;

fn plan(private: u32, public: u32, via_host: bool) -> LimitsPlan {
    plan_limits(private, public, via_host, "vmnt0007", Some("vmnp0007"))
}

/// The header bytes of an IPv4 or IPv6 packet from `src` to `dst` (only the address fields set).
fn header(src: IpAddr, dst: IpAddr) -> (u16, Vec<u8>) {
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let mut h = vec![0u8; 20];
            h[0] = 0x45;
            h[12..16].copy_from_slice(&s.octets());
            h[16..20].copy_from_slice(&d.octets());
            (ETH_P_IP, h)
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let mut h = vec![0u8; 40];
            h[0] = 0x60;
            h[8..24].copy_from_slice(&s.octets());
            h[24..40].copy_from_slice(&d.octets());
            (ETH_P_IPV6, h)
        }
        _ => panic!("mixed families"),
    }
}

/// What the tree does with a packet of `protocol`: the first filter (by priority, then handle)
/// whose keys all match, else HTB's default.
fn classify(tree: &TcTree, protocol: u16, pkt: &[u8]) -> u32 {
    let mut fs: Vec<&U32Filter> = tree
        .filters
        .iter()
        .filter(|f| f.protocol == protocol)
        .collect();
    fs.sort_by_key(|f| (f.prio, f.handle));
    for f in fs {
        let hit = f.keys.iter().all(|k| {
            let o = usize::try_from(k.off).unwrap();
            let w = u32::from_be_bytes(pkt[o..o + 4].try_into().unwrap());
            w & k.mask == k.value
        });
        if hit {
            return f.classid;
        }
    }
    tree.handle | tree.default_minor
}

/// The expected class of a remote address.
fn expected(remote: IpAddr) -> u32 {
    let net = IpNet::from(remote);
    if unshaped_prefixes().iter().any(|p| p.contains(&net)) {
        DIRECT_CLASSID
    } else if private_prefixes().iter().any(|p| p.contains(&net)) {
        PRIVATE_CLASSID
    } else {
        PUBLIC_CLASSID
    }
}

#[test]
fn no_limit_in_force_means_no_tree() {
    assert!(plan(0, 0, true).trees.is_empty());
    // The public limit without a public path (no route via host) is stored, not applied.
    let p = plan(0, 20, false);
    assert!(p.trees.is_empty());
    assert_eq!(p.public_mibps, 20);
    assert!(!p.public_applied);
    // No veth pair: no network path, nothing to shape.
    let p = plan_limits(10, 20, true, "vmnt0007", None);
    assert!(p.trees.is_empty());
    assert_eq!((p.private_mibps, p.public_mibps), (10, 20));
}

#[test]
fn both_directions_get_the_same_classes_on_the_right_devices() {
    let p = plan(20, 2, true);
    assert!(p.public_applied);
    let devs: Vec<_> = p
        .trees
        .iter()
        .map(|t| (t.dev.as_str(), t.direction))
        .collect();
    assert_eq!(
        devs,
        [
            ("vmnt0007", Direction::Download),
            ("vmnp0007", Direction::Upload)
        ]
    );
    for t in &p.trees {
        assert_eq!(t.handle, 0x0001_0000);
        assert_eq!(t.default_minor, 0);
        assert_eq!(t.overhead, -14);
        let c: Vec<_> = t
            .classes
            .iter()
            .map(|c| (c.class, c.classid, c.rate, c.limit_mibps, c.applied))
            .collect();
        assert_eq!(
            c,
            [
                (TrafficClass::Private, 0x0001_0010, 20 * 1_048_576, 20, true),
                (TrafficClass::Public, 0x0001_0020, 2 * 1_048_576, 2, true),
            ]
        );
        assert_eq!(t.classes[0].burst, 20 * 1_048_576 / 100);
        assert_eq!(t.classes[1].burst, 32 * 1024);
    }
}

#[test]
fn unlimited_and_unapplied_classes_stay_as_classes_at_the_unlimited_rate() {
    for p in [plan(10, 0, true), plan(10, 5, false)] {
        let public = &p.trees[0].classes[1];
        assert_eq!(public.rate, UNLIMITED_BYTES_PER_SEC);
        assert!(!public.applied);
    }
    let p = plan(0, 100_000, true);
    assert_eq!(p.trees[1].classes[0].rate, UNLIMITED_BYTES_PER_SEC);
    assert_eq!(p.trees[1].classes[1].rate, 100_000 * MIB);
    const { assert!(UNLIMITED_BYTES_PER_SEC > 100_000 * MIB) };
}

#[test]
fn a_limit_change_changes_only_the_class() {
    let a = plan(10, 50, true);
    let b = plan(10, 2, true);
    for (x, y) in a.trees.iter().zip(&b.trees) {
        assert_eq!(x.filters, y.filters);
        assert_eq!(x.classes[0], y.classes[0]);
        assert_ne!(x.classes[1], y.classes[1]);
        assert_eq!(
            (&x.dev, x.handle, x.overhead),
            (&y.dev, y.handle, y.overhead)
        );
    }
    // Adding the route via host applies the stored public limit: again a class change.
    let before = plan(10, 2, false);
    let after = plan(10, 2, true);
    assert_eq!(before.trees[0].filters, after.trees[0].filters);
    assert_eq!(before.trees[0].classes[1].rate, UNLIMITED_BYTES_PER_SEC);
    assert_eq!(after.trees[0].classes[1].rate, 2 * MIB);
}

#[test]
fn prefix_keys_encode_masks_per_word() {
    let k = |p: &str, base| prefix_keys(p.parse().unwrap(), base);
    assert_eq!(
        k("172.16.0.0/12", 16),
        [U32Key {
            off: 16,
            value: 0xac10_0000,
            mask: 0xfff0_0000
        }]
    );
    assert_eq!(
        k("0.0.0.0/0", 12),
        [U32Key {
            off: 12,
            value: 0,
            mask: 0
        }]
    );
    assert_eq!(
        k("fdaa::/16", 24),
        [U32Key {
            off: 24,
            value: 0xfdaa_0000,
            mask: 0xffff_0000
        }]
    );
    assert_eq!(
        k("fe80::/10", 8),
        [U32Key {
            off: 8,
            value: 0xfe80_0000,
            mask: 0xffc0_0000
        }]
    );
    assert_eq!(
        k("2001:db8::/40", 8),
        [
            U32Key {
                off: 8,
                value: 0x2001_0db8,
                mask: u32::MAX
            },
            U32Key {
                off: 12,
                value: 0,
                mask: 0xff00_0000
            },
        ]
    );
    assert_eq!(
        k("::/0", 24),
        [U32Key {
            off: 24,
            value: 0,
            mask: 0
        }]
    );
}

#[test]
fn filters_are_ordered_unshaped_private_then_public() {
    let f = filters(false);
    let v4: Vec<_> = f
        .iter()
        .filter(|f| f.protocol == ETH_P_IP)
        .map(|f| (f.handle, f.prefix.to_string(), f.classid))
        .collect();
    assert_eq!(
        v4,
        [
            (1, "169.254.0.0/16".to_owned(), DIRECT_CLASSID),
            (2, "10.0.0.0/8".to_owned(), PRIVATE_CLASSID),
            (3, "172.16.0.0/12".to_owned(), PRIVATE_CLASSID),
            (4, "192.168.0.0/16".to_owned(), PRIVATE_CLASSID),
            (5, "100.64.0.0/10".to_owned(), PRIVATE_CLASSID),
            (6, "0.0.0.0/0".to_owned(), PUBLIC_CLASSID),
        ]
    );
    let v6: Vec<_> = f
        .iter()
        .filter(|f| f.protocol == ETH_P_IPV6)
        .map(|f| (f.prio, f.prefix.to_string(), f.classid))
        .collect();
    assert_eq!(
        v6,
        [
            (IPV6_PRIO, "fe80::/10".to_owned(), DIRECT_CLASSID),
            (IPV6_PRIO, "ff00::/8".to_owned(), DIRECT_CLASSID),
            (IPV6_PRIO, "fdaa::/16".to_owned(), PRIVATE_CLASSID),
            (IPV6_PRIO, "::/0".to_owned(), PUBLIC_CLASSID),
        ]
    );
}

#[test]
fn known_addresses_land_in_their_class_both_ways() {
    let p = plan(10, 10, true);
    let (down, up) = (&p.trees[0], &p.trees[1]);
    let guest: IpAddr = "172.16.0.2".parse().unwrap();
    let mesh: IpAddr = "fdaa:1::7".parse().unwrap();
    for (remote, class) in [
        ("203.0.113.9", PUBLIC_CLASSID),
        ("8.8.8.8", PUBLIC_CLASSID),
        ("10.1.2.3", PRIVATE_CLASSID),
        ("172.31.255.255", PRIVATE_CLASSID),
        ("172.32.0.1", PUBLIC_CLASSID),
        ("192.168.1.1", PRIVATE_CLASSID),
        ("100.64.0.1", PRIVATE_CLASSID),
        ("100.128.0.1", PUBLIC_CLASSID),
        ("169.254.169.254", DIRECT_CLASSID),
    ] {
        let r: IpAddr = remote.parse().unwrap();
        let (proto, pkt) = header(r, guest);
        assert_eq!(classify(down, proto, &pkt), class, "download from {remote}");
        let (proto, pkt) = header(guest, r);
        assert_eq!(classify(up, proto, &pkt), class, "upload to {remote}");
        // The guest's own address never decides: the other end does.
        let (proto, pkt) = header(guest, r);
        assert_eq!(classify(down, proto, &pkt), PRIVATE_CLASSID, "{remote}");
    }
    for (remote, class) in [
        ("2001:db8::1", PUBLIC_CLASSID),
        ("fdaa:2::9", PRIVATE_CLASSID),
        ("fdab::1", PUBLIC_CLASSID),
        ("fe80::1", DIRECT_CLASSID),
        ("ff02::1:ff00:2", DIRECT_CLASSID),
    ] {
        let r: IpAddr = remote.parse().unwrap();
        let (proto, pkt) = header(r, mesh);
        assert_eq!(classify(down, proto, &pkt), class, "download from {remote}");
        let (proto, pkt) = header(mesh, r);
        assert_eq!(classify(up, proto, &pkt), class, "upload to {remote}");
    }
    // Not IP (ARP): no filter of its protocol, so HTB's default, the unshaped direct queue.
    assert_eq!(classify(down, 0x0806, &[0u8; 28]), DIRECT_CLASSID);
}

proptest! {
    #[test]
    fn every_address_is_classified_by_the_remote_end(
        a in any::<u32>(), b in any::<u128>(), v6 in any::<bool>(),
    ) {
        let p = plan(10, 20, true);
        let (remote, local): (IpAddr, IpAddr) = if v6 {
            (IpAddr::V6(b.into()), "fdaa:1::7".parse().unwrap())
        } else {
            (IpAddr::V4(a.into()), "172.16.0.2".parse().unwrap())
        };
        let want = expected(remote);
        let (proto, pkt) = header(remote, local);
        prop_assert_eq!(classify(&p.trees[0], proto, &pkt), want);
        let (proto, pkt) = header(local, remote);
        prop_assert_eq!(classify(&p.trees[1], proto, &pkt), want);
    }
}
