//! One small fixture per validation rule of `set_ip_pool`, asserting the exact error code and
//! message and that the database is unchanged, run against both stores.
#![allow(missing_docs)]

mod common;

mod validation {
    //! One small fixture per validation rule of set_ip_pool, asserting the exact error.
    use crate::common::Kind;
    use vmnet_ipam::Db;

    use crate::common::*;

    async fn refused(
        db: &Db,
        cidr: &str,
        gw: &str,
        first: Option<&str>,
        last: Option<&str>,
        message: &str,
    ) {
        let mut req = range("p1", cidr, gw);
        req.first_host = first.map(Into::into);
        req.last_host = last.map(Into::into);
        let before = snapshot(db).await;
        assert_err(set_pool(db, req).await, Kind::Invalid, message);
        assert_eq!(snapshot(db).await, before);
    }

    pub async fn ipv6_range_refused(db: &Db) {
        refused(
            db,
            "2001:db8::/64",
            "2001:db8::1",
            None,
            None,
            "pool p1: cidr 2001:db8::/64 is IPv6; only IPv4 ranges are supported",
        )
        .await;
    }
    pub async fn malformed_cidr(db: &Db) {
        refused(
            db,
            "10.0.0/24",
            "10.0.0.1",
            None,
            None,
            "pool p1: cidr \"10.0.0/24\" is not an IPv4 CIDR such as 10.0.0.0/24",
        )
        .await;
    }
    pub async fn cidr_without_prefix(db: &Db) {
        refused(
            db,
            "10.0.0.0",
            "10.0.0.1",
            None,
            None,
            "pool p1: cidr \"10.0.0.0\" is not an IPv4 CIDR such as 10.0.0.0/24",
        )
        .await;
    }
    pub async fn host_bits_set(db: &Db) {
        refused(
            db,
            "10.0.0.1/24",
            "10.0.0.1",
            None,
            None,
            "pool p1: cidr 10.0.0.1/24 has host bits set (the network is 10.0.0.0/24)",
        )
        .await;
    }
    pub async fn malformed_gateway(db: &Db) {
        refused(
            db,
            "10.0.0.0/24",
            "10.0.0.300",
            None,
            None,
            "pool p1: gateway \"10.0.0.300\" is not an IPv4 address",
        )
        .await;
    }
    pub async fn ipv6_gateway(db: &Db) {
        refused(
            db,
            "10.0.0.0/24",
            "fe80::1",
            None,
            None,
            "pool p1: gateway fe80::1 is IPv6; only IPv4 is supported",
        )
        .await;
    }
    pub async fn malformed_first_host(db: &Db) {
        refused(
            db,
            "10.0.0.0/24",
            "10.0.0.1",
            Some("ten"),
            None,
            "pool p1: first_host \"ten\" is not an IPv4 address",
        )
        .await;
    }
    pub async fn malformed_last_host(db: &Db) {
        refused(
            db,
            "10.0.0.0/24",
            "10.0.0.1",
            None,
            Some(""),
            "pool p1: last_host \"\" is not an IPv4 address",
        )
        .await;
    }
    pub async fn first_host_outside_cidr(db: &Db) {
        refused(
            db,
            "10.0.0.0/24",
            "10.0.0.1",
            Some("10.0.1.2"),
            None,
            "pool p1: first_host 10.0.1.2 is outside cidr 10.0.0.0/24",
        )
        .await;
    }
    pub async fn last_host_outside_cidr(db: &Db) {
        refused(
            db,
            "10.0.0.0/24",
            "10.0.0.1",
            None,
            Some("10.0.1.2"),
            "pool p1: last_host 10.0.1.2 is outside cidr 10.0.0.0/24",
        )
        .await;
    }
    pub async fn first_host_after_last_host(db: &Db) {
        refused(
            db,
            "10.0.0.0/24",
            "10.0.0.1",
            Some("10.0.0.9"),
            Some("10.0.0.6"),
            "pool p1: first_host 10.0.0.9 is after last_host 10.0.0.6",
        )
        .await;
    }
    pub async fn default_first_host_outside_cidr(db: &Db) {
        refused(
            db,
            "10.0.0.0/24",
            "192.0.2.1",
            None,
            None,
            "pool p1: first_host 192.0.2.2 is outside cidr 10.0.0.0/24 (the default is the address after the gateway; set first_host explicitly)",
        )
        .await;
    }
    async fn refused_dns(db: &Db, dns: &[&str], message: &str) {
        let mut req = range("p1", "10.0.0.0/24", "10.0.0.1");
        req.dns = dns.iter().map(|s| (*s).to_owned()).collect();
        let before = snapshot(db).await;
        assert_err(set_pool(db, req).await, Kind::Invalid, message);
        assert_eq!(snapshot(db).await, before);
    }
    pub async fn whole_internet_refused(db: &Db) {
        refused(
            db,
            "0.0.0.0/0",
            "10.0.0.1",
            None,
            None,
            "pool p1: cidr 0.0.0.0/0 has prefix length 0; it must be between /16 and /32",
        )
        .await;
    }
    pub async fn cidr_larger_than_slash16_refused(db: &Db) {
        refused(
            db,
            "10.0.0.0/12",
            "10.0.0.1",
            None,
            None,
            "pool p1: cidr 10.0.0.0/12 has prefix length 12; it must be between /16 and /32",
        )
        .await;
    }
    pub async fn loopback_cidr_refused(db: &Db) {
        refused(
            db,
            "127.0.0.0/24",
            "127.0.0.1",
            None,
            None,
            "pool p1: cidr 127.0.0.0/24 lies in 127.0.0.0/8 (loopback), which cannot hold guest addresses",
        )
        .await;
    }
    pub async fn link_local_cidr_refused(db: &Db) {
        refused(
            db,
            "169.254.0.0/24",
            "169.254.0.1",
            None,
            None,
            "pool p1: cidr 169.254.0.0/24 lies in 169.254.0.0/16 (link-local), which cannot hold guest addresses",
        )
        .await;
    }
    pub async fn multicast_gateway_refused(db: &Db) {
        refused(
            db,
            "10.0.0.0/24",
            "224.0.0.1",
            Some("10.0.0.2"),
            None,
            "pool p1: gateway 224.0.0.1 lies in 224.0.0.0/4 (multicast), which cannot be a gateway",
        )
        .await;
    }
    pub async fn dns_unspecified_refused(db: &Db) {
        refused_dns(db, &["::"], "pool p1: dns[0] :: is the unspecified address").await;
    }
    pub async fn dns_broadcast_refused(db: &Db) {
        refused_dns(
            db,
            &["10.0.0.1", "255.255.255.255"],
            "pool p1: dns[1] 255.255.255.255 is the broadcast address",
        )
        .await;
    }
    pub async fn dns_ipv4_mapped_refused(db: &Db) {
        refused_dns(
            db,
            &["::ffff:192.0.2.53"],
            "pool p1: dns[0] ::ffff:192.0.2.53 is an IPv4-mapped IPv6 address; give the IPv4 address 192.0.2.53",
        )
        .await;
    }
    pub async fn dns_repeat_refused(db: &Db) {
        refused_dns(
            db,
            &["192.0.2.53", "192.0.2.53"],
            "pool p1: dns[1] 192.0.2.53 repeats dns[0]",
        )
        .await;
    }
    pub async fn dns_too_many_refused(db: &Db) {
        let many: Vec<String> = (1..=1000)
            .map(|i| format!("10.1.{}.{}", i / 200, i % 200 + 1))
            .collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        refused_dns(
            db,
            &many,
            "pool p1: dns has 1000 entries; at most 8 are allowed",
        )
        .await;
    }
}

conformance!(validation:
    whole_internet_refused,
    cidr_larger_than_slash16_refused,
    loopback_cidr_refused,
    link_local_cidr_refused,
    multicast_gateway_refused,
    dns_unspecified_refused,
    dns_broadcast_refused,
    dns_ipv4_mapped_refused,
    dns_repeat_refused,
    dns_too_many_refused,
    ipv6_range_refused,
    malformed_cidr,
    cidr_without_prefix,
    host_bits_set,
    malformed_gateway,
    ipv6_gateway,
    malformed_first_host,
    malformed_last_host,
    first_host_outside_cidr,
    last_host_outside_cidr,
    first_host_after_last_host,
    default_first_host_outside_cidr,
);
