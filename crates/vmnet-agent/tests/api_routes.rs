//! In-process API tests of routing: a wrong method on a served path is `405` with `Allow` and
//! the `METHOD_NOT_ALLOWED` error body (never `INVALID_INPUT`), an unknown path stays `404`.
//! Every response is checked against openapi.json.

mod common;

use axum::http::Method;
use common::{Harness, assert_error};
use serde_json::json;

#[tokio::test]
async fn wrong_method_on_a_served_path_is_405_with_allow() {
    use axum::body::Body;
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let h = Harness::new().await;
    let cases = [
        (
            Method::POST,
            "/v1/vms/a0",
            "GET, PUT, DELETE",
            "method POST is not allowed on /v1/vms/{id}; allowed: GET, PUT, DELETE",
        ),
        (
            Method::DELETE,
            "/v1/instances",
            "GET, POST, PUT",
            "method DELETE is not allowed on /v1/instances; allowed: GET, POST, PUT",
        ),
        (
            Method::GET,
            "/v1/hosts/h1/lose",
            "POST",
            "method GET is not allowed on /v1/hosts/{id}/lose; allowed: POST",
        ),
    ];
    for (method, path, allow, message) in cases {
        let req = axum::http::Request::builder()
            .method(method.clone())
            .uri(path)
            .body(Body::empty())
            .unwrap();
        let resp = h.router.clone().oneshot(req).await.unwrap();
        assert_eq!(resp.status().as_u16(), 405, "{method} {path}");
        assert_eq!(resp.headers()["allow"], allow, "{method} {path}");
        assert_eq!(resp.headers()["content-type"], "application/json");
        assert!(resp.headers().get("x-vmnet-error-body").is_none());
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            v,
            json!({"error": {"code": "METHOD_NOT_ALLOWED", "message": message}})
        );
        // The harness also checks the answer against openapi.json.
        assert_error(
            &h.call(method, path, None).await,
            405,
            "METHOD_NOT_ALLOWED",
            &[message],
        );
    }
    // An unknown path stays 404.
    assert_error(
        &h.call(Method::POST, "/v1/vms/a0/x", None).await,
        404,
        "NOT_FOUND",
        &["no route POST /v1/vms/a0/x"],
    );
}

#[tokio::test]
async fn a_query_parameter_on_a_route_that_takes_none_is_invalid_input_naming_it() {
    let h = Harness::new().await;
    let cases = [
        ("/v1/vms?tenant=1", "\"tenant\"", "/v1/vms"),
        ("/v1/status?verbose", "\"verbose\"", "/v1/status"),
        ("/v1/vms/a0?x=1&y=2", "\"x\"", "/v1/vms/a0"),
        ("/v1/pools?limit=10", "\"limit\"", "/v1/pools"),
        // Decoded as the activity route decodes its own.
        ("/v1/vms?%74enant=1", "\"tenant\"", "/v1/vms"),
    ];
    for (path, name, route) in cases {
        assert_error(
            &h.get(path).await,
            400,
            "INVALID_INPUT",
            &[name, &format!("{route} takes no query parameters")],
        );
    }
    // No parameter at all is fine, and an unknown path stays 404 with or without one.
    assert_eq!(h.get("/v1/vms?").await.0.as_u16(), 200);
    assert_eq!(h.get("/v1/vms").await.0.as_u16(), 200);
    assert_error(
        &h.get("/v1/nope?x=1").await,
        404,
        "NOT_FOUND",
        &["/v1/nope"],
    );
    // The one route that reads a query still does: its own checks answer.
    assert_error(
        &h.get("/v1/activity?idle=1").await,
        400,
        "INVALID_INPUT",
        &["idle"],
    );
}
