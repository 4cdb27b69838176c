//! One small fixture per validation rule of `set_ip_pool`, asserting the exact error code and
//! message and that the database is unchanged, run against both stores.
#![allow(missing_docs)]

mod common;

mod validation {
    //! One small fixture per validation rule of set_ip_pool, asserting the exact error.
    use vmnet_ipam::Db;
    use vmnet_model::ErrorCode;

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
        assert_err(set_pool(db, req).await, ErrorCode::InvalidInput, message);
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
}

conformance!(validation:
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
