use std::net::IpAddr;

use super::*;

fn req(cidr: &str, gw: &str) -> AddRange {
    AddRange {
        pool_id: "p1".into(),
        cidr: cidr.into(),
        gateway: gw.into(),
        ..Default::default()
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn err(r: &AddRange) -> String {
    r.validate().unwrap_err().to_string()
}

#[test]
fn ipv6_defaults_after_the_gateway_and_below_the_anycast_block() {
    let r = req("2001:db8::/64", "2001:db8::1").validate().unwrap();
    assert_eq!(r.family, Family::Ipv6);
    assert_eq!(r.first_host, ip("2001:db8::2"));
    assert_eq!(r.last_host, ip("2001:db8::ffff:ffff:ffff:ff7f"));
    assert_eq!(r.size(), (1u128 << 64) - 1 - 128 - 1);
}

#[test]
fn ipv6_link_local_gateway_defaults_to_the_lowest_usable_address() {
    let r = req("2001:db8:1::/64", "fe80::1").validate().unwrap();
    assert_eq!(r.gateway, ip("fe80::1"));
    assert_eq!(r.first_host, ip("2001:db8:1::1"));
}

#[test]
fn ipv6_slash127_and_slash128_use_every_address() {
    let mut r = req("2001:db8::/127", "fe80::1");
    assert_eq!(
        r.validate().map(|r| (r.first_host, r.last_host)).unwrap(),
        (ip("2001:db8::"), ip("2001:db8::1"))
    );
    r.cidr = "2001:db8::5/128".into();
    let one = r.validate().unwrap();
    assert_eq!(
        (one.first_host, one.last_host),
        (ip("2001:db8::5"), ip("2001:db8::5"))
    );
    assert_eq!(one.size(), 1);
}

#[test]
fn ipv6_rules_name_the_field() {
    let cases = [
        (
            req("2001:db8::/32", "2001:db8::1"),
            "pool p1: cidr 2001:db8::/32 has prefix length 32; it must be between /48 and /128",
        ),
        (
            req("2001:db8::1/64", "2001:db8::1"),
            "pool p1: cidr 2001:db8::1/64 has host bits set (the network is 2001:db8::/64)",
        ),
        (
            req("fe80::/64", "fe80::1"),
            "pool p1: cidr fe80::/64 lies in fe80::/10 (link-local), which cannot hold guest addresses",
        ),
        (
            req("ff02::/64", "fe80::1"),
            "pool p1: cidr ff02::/64 lies in ff00::/8 (multicast), which cannot hold guest addresses",
        ),
        (
            req("::/64", "fe80::1"),
            "pool p1: cidr ::/64 lies in ::/8 (reserved: unspecified, loopback and IPv4-mapped \
             addresses), which cannot hold guest addresses",
        ),
        (
            req("2001:db8::/64", "::1"),
            "pool p1: gateway ::1 lies in ::/8 (reserved: unspecified, loopback and IPv4-mapped \
             addresses), which cannot be a gateway",
        ),
        (
            req("2001:db8::/64", "ff02::1"),
            "pool p1: gateway ff02::1 lies in ff00::/8 (multicast), which cannot be a gateway",
        ),
        (
            req("2001:db8::/64", "2001:db8::"),
            "pool p1: gateway 2001:db8:: is the subnet-router anycast address of 2001:db8::/64",
        ),
        (
            req("2001:db8::/64", "10.0.0.1"),
            "pool p1: gateway 10.0.0.1 is IPv4; an IPv6 range needs IPv6 addresses",
        ),
        (
            req("nonsense", "fe80::1"),
            "pool p1: cidr \"nonsense\" is not an IPv4 or IPv6 CIDR such as 2001:db8::/64",
        ),
    ];
    for (r, want) in cases {
        assert_eq!(err(&r), want);
    }
    let mut r = req("2001:db8::/64", "2001:db8::1");
    r.first_host = Some("2001:db8:1::2".into());
    assert_eq!(
        err(&r),
        "pool p1: first_host 2001:db8:1::2 is outside cidr 2001:db8::/64"
    );
    r.first_host = Some("2001:db8::".into());
    assert_eq!(
        err(&r),
        "pool p1: first_host 2001:db8:: is the subnet-router anycast address of 2001:db8::/64"
    );
    r.first_host = None;
    r.last_host = Some("2001:db8::ffff:ffff:ffff:ffff".into());
    assert_eq!(
        err(&r),
        "pool p1: last_host 2001:db8::ffff:ffff:ffff:ffff is a reserved subnet anycast address \
         of 2001:db8::/64 (RFC 2526)"
    );
    r.first_host = Some("2001:db8::9".into());
    r.last_host = Some("2001:db8::6".into());
    assert_eq!(
        err(&r),
        "pool p1: first_host 2001:db8::9 is after last_host 2001:db8::6"
    );
}

#[test]
fn ipv4_ranges_follow_the_first_range_rules() {
    let r = req("10.0.1.0/24", "10.0.1.1").validate().unwrap();
    assert_eq!(r.family, Family::Ipv4);
    assert_eq!(
        (r.first_host, r.last_host),
        (ip("10.0.1.2"), ip("10.0.1.254"))
    );
    assert_eq!(
        err(&req("127.0.0.0/24", "10.0.0.1")),
        "pool p1: cidr 127.0.0.0/24 lies in 127.0.0.0/8 (loopback), which cannot hold guest addresses"
    );
}

#[test]
fn clash_is_per_family() {
    let a = req("2001:db8::/64", "2001:db8::1").validate().unwrap();
    let mut b = req("2001:db8::/56", "fe80::1").validate().unwrap();
    b.pool_id = "p2".into();
    assert_eq!(
        a.clash(&b).unwrap(),
        "cidr 2001:db8::/64 overlaps cidr 2001:db8::/56 of pool p2"
    );
    let v4 = req("10.0.0.0/24", "10.0.0.1").validate().unwrap();
    assert_eq!(a.clash(&v4), None);
    // A shared link-local gateway is fine: neither leases it.
    let mut c = req("2001:db8:1::/64", "fe80::1").validate().unwrap();
    c.pool_id = "p3".into();
    assert_eq!(b.clash(&c), None);
    let mut d = req("2001:db8:2::/64", "2001:db8:1::7").validate().unwrap();
    d.pool_id = "p4".into();
    assert_eq!(
        d.clash(&c).unwrap(),
        "gateway 2001:db8:1::7 is a leasable address of pool p3 (2001:db8:1::1 to 2001:db8:1:0:ffff:ffff:ffff:ff7f)"
    );
}
