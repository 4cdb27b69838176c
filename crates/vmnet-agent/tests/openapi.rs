//! `openapi.json` and the router agree: every route the router serves is documented and every
//! documented operation is served; every schema reference resolves; every operation documents
//! its error responses with the error body. (Each API test also validates every response it
//! gets against the document, see `common::check_documented`.)

mod common;

use std::collections::BTreeSet;

use axum::http::Method;
use common::{Harness, openapi};
use serde_json::Value;

fn documented(doc: &Value) -> BTreeSet<(String, String)> {
    let mut ops = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for m in ["get", "put", "post", "delete", "patch", "head", "options"] {
            if item.get(m).is_some() {
                ops.insert((m.to_uppercase(), path.clone()));
            }
        }
    }
    ops
}

#[test]
fn every_route_is_documented_and_every_documented_route_is_served() {
    let doc = openapi();
    let served: BTreeSet<(String, String)> = vmnet_agent::api::routes()
        .into_iter()
        .map(|(m, p)| (m.to_string(), p.to_owned()))
        .collect();
    let documented = documented(&doc);
    let missing: Vec<_> = served.difference(&documented).collect();
    let extra: Vec<_> = documented.difference(&served).collect();
    assert!(
        missing.is_empty(),
        "served but not in openapi.json: {missing:?}"
    );
    assert!(
        extra.is_empty(),
        "in openapi.json but not served: {extra:?}"
    );
}

#[tokio::test]
async fn every_documented_operation_answers_from_its_handler() {
    // No documented (method, path) falls through to the unknown-route fallback.
    let h = Harness::new().await;
    let doc = openapi();
    for (m, p) in documented(&doc) {
        let path = p.replace("{id}", "x1");
        let method = Method::from_bytes(m.as_bytes()).unwrap();
        // A stream (`GET /v1/events`) answers its own content type, not a JSON body.
        let ok = &doc["paths"][p.as_str()][m.to_lowercase()]["responses"]["200"]["content"];
        if let Some(ct) = ok
            .as_object()
            .and_then(|c| c.keys().next())
            .filter(|ct| *ct != "application/json")
        {
            let req = axum::http::Request::builder()
                .method(method)
                .uri(&path)
                .body(axum::body::Body::empty())
                .unwrap();
            let resp = tower::ServiceExt::oneshot(h.router.clone(), req)
                .await
                .unwrap();
            assert_eq!(resp.status(), 200, "{m} {p}");
            assert_eq!(resp.headers()["content-type"], ct.as_str(), "{m} {p}");
            continue;
        }
        let body = matches!(method, Method::PUT | Method::POST).then(|| serde_json::json!({}));
        let (_, v) = h.call(method, &path, body).await;
        let msg = v["error"]["message"].as_str().unwrap_or("");
        assert!(
            !msg.starts_with("no route"),
            "{m} {p} is documented but not routed: {v}"
        );
    }
}

#[test]
fn refs_resolve_and_errors_are_documented() {
    let doc = openapi();
    fn walk(doc: &Value, v: &Value) {
        match v {
            Value::Object(o) => {
                if let Some(r) = o.get("$ref").and_then(Value::as_str) {
                    assert!(
                        doc.pointer(r.trim_start_matches('#')).is_some(),
                        "dangling {r}"
                    );
                }
                o.values().for_each(|x| walk(doc, x));
            }
            Value::Array(a) => a.iter().for_each(|x| walk(doc, x)),
            _ => {}
        }
    }
    walk(&doc, &doc);
    assert_eq!(doc["openapi"], "3.0.3");
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (m, op) in item
            .as_object()
            .unwrap()
            .iter()
            .filter(|(k, _)| *k != "parameters")
        {
            let responses = op["responses"].as_object().unwrap();
            assert!(
                responses.keys().any(|k| k.starts_with('2')),
                "{m} {path}: no success response"
            );
            assert!(
                responses.contains_key("500"),
                "{m} {path}: 500 not documented"
            );
            for (code, r) in responses.iter().filter(|(k, _)| !k.starts_with('2')) {
                assert_eq!(
                    r["$ref"], "#/components/responses/Error",
                    "{m} {path} {code}: not the error body"
                );
            }
            if matches!(m.as_str(), "put" | "post") && op.get("requestBody").is_some() {
                assert!(
                    responses.contains_key("400"),
                    "{m} {path}: a body can be invalid, 400 must be documented"
                );
            }
        }
    }
}
