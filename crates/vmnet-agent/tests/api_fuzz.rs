//! Property tests over the API: random JSON documents and random mutations of a valid VM config
//! never crash the agent or leak an undocumented answer. Every response is a documented status
//! with a body valid against openapi.json (checked by the harness), invalid input is
//! `INVALID_INPUT` and never reaches the kernel, and the good VM stays as it was.

mod common;

use axum::http::Method;
use common::Harness;
use proptest::prelude::*;
use serde_json::{Value, json};

fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        "[ -~]{0,24}".prop_map(Value::from),
        prop_oneof![
            Just("host"),
            Just("0.0.0.0/0"),
            Just("::/0"),
            Just("fdaa:1::7"),
            Just("2000::/3"),
            Just("10.0.0.1/8"),
            Just("vm-1"),
        ]
        .prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map(
                prop_oneof![
                    Just("id".to_owned()),
                    Just("user_id".to_owned()),
                    Just("tenant".to_owned()),
                    Just("mesh_ipv6".to_owned()),
                    Just("network".to_owned()),
                    Just("routes".to_owned()),
                    Just("destination".to_owned()),
                    Just("via".to_owned()),
                    "[a-z_]{1,10}",
                ],
                inner,
                0..5
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn good() -> Value {
    json!({"id": "vm-1", "user_id": 1, "tenant": 1, "mesh_ipv6": "fdaa:1::1",
           "network": {"routes": [{"destination": "0.0.0.0/0", "via": "host"}]}})
}

/// Replaces the value at one of the config's paths with `v`.
fn mutate(path: usize, v: Value) -> Value {
    let mut cfg = good();
    match path % 8 {
        0 => cfg["id"] = v,
        1 => cfg["user_id"] = v,
        2 => cfg["tenant"] = v,
        3 => cfg["mesh_ipv6"] = v,
        4 => cfg["network"] = v,
        5 => cfg["network"]["routes"] = v,
        6 => cfg["network"]["routes"][0]["destination"] = v,
        _ => cfg["network"]["routes"][0]["via"] = v,
    }
    cfg
}

fn run(cases: Vec<Value>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let h = Harness::new().await;
        assert_eq!(h.put_vm(&good()).await.0, 200);
        let before = h.call(Method::GET, "/v1/vms/vm-1", None).await.1;
        for body in cases {
            let applies = h.driver.kernel().applies.len();
            // check_documented (in the harness) validates status and body against openapi.json.
            let (st, v) = h
                .call(Method::PUT, "/v1/vms/vm-1", Some(body.clone()))
                .await;
            match st.as_u16() {
                200 => {
                    // A valid mutation: put the good config back for the next case.
                    assert_eq!(h.put_vm(&good()).await.0, 200);
                }
                400 => {
                    assert_eq!(v["error"]["code"], "INVALID_INPUT", "{v}");
                    assert_eq!(
                        h.driver.kernel().applies.len(),
                        applies,
                        "invalid input reached the kernel: {body}"
                    );
                }
                other => panic!("PUT {body} answered {other}: {v}"),
            }
            let now = h.call(Method::GET, "/v1/vms/vm-1", None).await.1;
            assert_eq!(now["config"], before["config"]);
            assert_eq!(now["status"]["state"], "applied");
        }
    });
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    fn random_documents_are_answered_as_documented(docs in prop::collection::vec(any_json(), 8)) {
        run(docs);
    }

    #[test]
    fn mutated_configs_are_answered_as_documented(muts in prop::collection::vec((0usize..8, any_json()), 8)) {
        run(muts.into_iter().map(|(p, v)| mutate(p, v)).collect());
    }
}
