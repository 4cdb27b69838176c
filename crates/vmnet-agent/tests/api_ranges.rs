//! In-process API tests of a pool's ranges (`/v1/pools/{id}/ranges`): adding IPv4 ranges after
//! the first and IPv6 ranges, the dual-stack walk-through over the API (`Instance.address6`,
//! `addresses` IPv4 lease first, then IPv6), `pool` and `leases` showing both families,
//! removing ranges, and errors with their codes and statuses. Every response is checked against
//! openapi.json.

mod common;

use common::{Harness, assert_error, assert_invalid, instance, range};
use serde_json::json;

#[tokio::test]
async fn dual_stack_over_the_api() {
    let h = Harness::new().await;
    h.with_range("p1", range("10.0.0.0/29", "10.0.0.1")).await;
    let (st, r6) = h
        .post(
            "/v1/pools/p1/ranges",
            json!({"cidr": "2001:db8::/64", "gateway": "2001:db8::1",
                   "first_host": "2001:db8::2", "last_host": "2001:db8::6"}),
        )
        .await;
    assert_eq!(st, 201, "{r6}");
    assert_eq!(
        r6,
        json!({"pool_id": "p1", "family": "ipv6", "cidr": "2001:db8::/64",
               "gateway": "2001:db8::1", "first_host": "2001:db8::2", "last_host": "2001:db8::6"})
    );
    h.with_host("h1", 64, 65536).await;
    for i in 0..5 {
        let v = h.with_instance(instance(&format!("i{i}"), "p1")).await;
        assert_eq!(v["address"], format!("10.0.0.{}", i + 2));
        assert_eq!(v["address6"], format!("2001:db8::{}", i + 2));
        assert_eq!(
            v["addresses"],
            json!([
                format!("10.0.0.{}/29", i + 2),
                format!("2001:db8::{}/64", i + 2)
            ])
        );
    }
    // The NIC carries both leases and both gateways, and so does the runtime plugin spec.
    let (st, nics) = h.get("/v1/instances/i0/nics").await;
    assert_eq!(st, 200, "{nics}");
    let nic = &nics["nics"][0];
    assert_eq!(nic["addresses"], json!(["10.0.0.2/29", "2001:db8::2/64"]));
    assert_eq!(
        (&nic["gateway"], &nic["gateway6"]),
        (&json!("10.0.0.1"), &json!("2001:db8::1"))
    );
    let plugin = &nics["runtime"]["plugin"]["nics"][0];
    assert_eq!(plugin["addresses"], nic["addresses"]);
    assert_eq!(plugin["gateway6"], "2001:db8::1");
    assert_error(
        &h.post("/v1/instances", instance("i5", "p1")).await,
        503,
        "CAPACITY_UNAVAILABLE",
        &["Pool p1 has no free IP address"],
    );
    let (st, del) = h.delete("/v1/instances/i2").await;
    assert_eq!(
        (st.as_u16(), &del["address6"]),
        (200, &json!("2001:db8::4"))
    );
    let (_, leases) = h.get("/v1/pools/p1/leases").await;
    let addrs: Vec<&str> = leases
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["address"].as_str().unwrap())
        .collect();
    assert_eq!(
        addrs,
        [
            "10.0.0.2",
            "10.0.0.3",
            "10.0.0.5",
            "10.0.0.6",
            "2001:db8::2",
            "2001:db8::3",
            "2001:db8::5",
            "2001:db8::6"
        ]
    );
    let (_, pool) = h.get("/v1/pools/p1").await;
    assert_eq!(
        (&pool["leases"], &pool["leases_ipv6"]),
        (&json!(4), &json!(4))
    );
    assert_eq!(pool["ranges"][1], r6);
    let (_, list) = h.get("/v1/pools/p1/ranges").await;
    assert_eq!(list, pool["ranges"]);
    // Removing a range that holds leases is 409; an unknown one 404; the path spells the cidr.
    assert_error(
        &h.delete("/v1/pools/p1/ranges/2001:db8::/64").await,
        409,
        "CONFLICT",
        &["pool p1: range 2001:db8::/64 holds 4 leases; delete their instances first"],
    );
    assert_error(
        &h.delete("/v1/pools/p1/ranges/2001:db8:9::/64").await,
        404,
        "NOT_FOUND",
        &["range 2001:db8:9::/64 of pool p1 not found"],
    );
    for i in [0, 1, 3, 4] {
        assert_eq!(h.delete(&format!("/v1/instances/i{i}")).await.0, 200);
    }
    let (st, gone) = h.delete("/v1/pools/p1/ranges/2001:db8::/64").await;
    assert_eq!((st.as_u16(), gone), (200, r6));
    let v = h.with_instance(instance("v4only", "p1")).await;
    assert_eq!(
        (&v["address6"], &v["addresses"]),
        (&json!(null), &json!(["10.0.0.2/29"]))
    );
    let (_, nics) = h.get("/v1/instances/v4only/nics").await;
    assert_eq!(nics["nics"][0]["addresses"], json!(["10.0.0.2/29"]));
    assert_eq!(nics["nics"][0]["gateway6"], json!(null));
    assert!(
        nics["runtime"]["plugin"]["nics"][0]
            .get("gateway6")
            .is_none()
    );
}

#[tokio::test]
async fn range_errors_name_the_field_with_their_codes() {
    let h = Harness::new().await;
    h.with_range("p1", range("10.0.0.0/24", "10.0.0.1")).await;
    assert_invalid(
        &h.post("/v1/pools/p1/ranges", range("2001:db8::/40", "fe80::1"))
            .await,
        "pool p1: cidr 2001:db8::/40 has prefix length 40; it must be between /48 and /128",
    );
    assert_invalid(
        &h.post("/v1/pools/p1/ranges", range("2001:db8::/64", "ff02::2"))
            .await,
        "pool p1: gateway ff02::2 lies in ff00::/8 (multicast), which cannot be a gateway",
    );
    assert_error(
        &h.post(
            "/v1/pools/p1/ranges",
            json!({"cidr": "2001:db8::/64", "gateway": "fe80::1", "dns": []}),
        )
        .await,
        400,
        "INVALID_INPUT",
        &["unknown field `dns`"],
    );
    assert_error(
        &h.post("/v1/pools/p1/ranges", range("10.0.0.128/25", "10.0.0.129"))
            .await,
        409,
        "CONFLICT",
        &["pool p1: cidr 10.0.0.128/25 overlaps cidr 10.0.0.0/24 of pool p1"],
    );
    assert_error(
        &h.post("/v1/pools/p2/ranges", range("10.0.1.0/24", "10.0.1.1"))
            .await,
        409,
        "CONFLICT",
        &["pool p2 has no first IPv4 range"],
    );
    assert_error(
        &h.delete("/v1/pools/p1/ranges/10.0.0.0/24").await,
        409,
        "CONFLICT",
        &["range 10.0.0.0/24 is the first IPv4 range"],
    );
    assert_invalid(
        &h.delete("/v1/pools/p1/ranges/2001:db8::/x").await,
        "pool p1: cidr \"2001:db8::/x\" is not a CIDR such as 2001:db8::/64",
    );
    assert_error(
        &h.get("/v1/pools/nope/ranges").await,
        404,
        "NOT_FOUND",
        &["pool nope not found"],
    );
    // The first range's route keeps refusing IPv6.
    assert_invalid(
        &h.put_range("p1", range("2001:db8::/64", "2001:db8::1"))
            .await,
        "pool p1: cidr 2001:db8::/64 is IPv6; only IPv4 ranges are supported",
    );
}
