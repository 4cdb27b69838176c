//! In-process API tests of store rules, on SQLite and on PostgreSQL: overlapping pool ranges are
//! `409 CONFLICT` naming the other pool. Every response is checked against openapi.json.

mod common;

use axum::http::Method;
use common::{Harness, assert_error};
use serde_json::json;

async fn overlapping_range_is_409_naming_the_other_pool(h: &Harness) {
    let (st, r) = h
        .call(
            Method::PUT,
            "/v1/pools/p1/range",
            Some(json!({"cidr": "10.20.0.0/24", "gateway": "10.20.0.1"})),
        )
        .await;
    assert_eq!(st, 200, "{r}");
    let got = h
        .call(
            Method::PUT,
            "/v1/pools/p2/range",
            Some(json!({"cidr": "10.20.0.0/16", "gateway": "10.20.128.1"})),
        )
        .await;
    assert_error(
        &got,
        409,
        "CONFLICT",
        &["pool p2: cidr 10.20.0.0/16 overlaps cidr 10.20.0.0/24 of pool p1"],
    );
    let (_, pools) = h.call(Method::GET, "/v1/pools", None).await;
    assert_eq!(
        pools.as_array().unwrap().len(),
        1,
        "the refused range created no pool: {pools}"
    );
    let got = h
        .call(
            Method::PUT,
            "/v1/pools/p2/range",
            Some(json!({"cidr": "0.0.0.0/0", "gateway": "10.20.0.1"})),
        )
        .await;
    assert_error(&got, 400, "INVALID_INPUT", &["pool p2: cidr 0.0.0.0/0"]);
}

macro_rules! both {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(&super::Harness::new().await).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(&super::Harness::postgres().await).await;
                }
            )*
        }
    };
}

both!(overlapping_range_is_409_naming_the_other_pool);
