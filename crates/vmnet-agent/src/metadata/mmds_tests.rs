use std::sync::Arc;

use http_body_util::BodyExt;
use serde_json::json;

use super::*;

fn tokens() -> Tokens {
    Tokens::new(
        Arc::new(crate::metadata::tokens::TokenKey::random().unwrap()),
        "web-7",
    )
}

fn doc() -> Value {
    json!({"latest": {"meta-data": {
        "instance-id": "web-7", "mesh-ipv6": "fdaa:1::7", "host-routes": "0.0.0.0/0\n::/0",
        "network": {"x": "y"}, "number": 5}}})
}

struct Call {
    status: StatusCode,
    body: String,
    headers: HeaderMap,
}

fn call(
    version: MetadataVersion,
    tokens: &Tokens,
    method: &Method,
    path: &str,
    hdrs: &[(&'static str, &str)],
    now: u64,
) -> Call {
    let mut h = HeaderMap::new();
    for (k, v) in hdrs {
        h.append(*k, HeaderValue::from_str(v).unwrap());
    }
    let asked = Asked {
        method,
        path,
        headers: &h,
        now,
    };
    let r = respond(&doc(), version, tokens, true, asked);
    let status = r.status();
    let headers = r.headers().clone();
    let body = futures::executor::block_on(r.into_body().collect())
        .unwrap()
        .to_bytes();
    Call {
        status,
        body: String::from_utf8(body.to_vec()).unwrap(),
        headers,
    }
}

#[test]
fn get_leaf_folder_json_and_errors() {
    let t = tokens();
    let now = 1000;
    let v1 = MetadataVersion::V1;
    let c = call(
        v1,
        &t,
        &Method::GET,
        "/latest/meta-data/mesh-ipv6",
        &[],
        now,
    );
    assert_eq!((c.status, c.body.as_str()), (StatusCode::OK, "fdaa:1::7"));
    assert_eq!(c.headers["content-type"], "text/plain");
    let c = call(
        v1,
        &t,
        &Method::GET,
        "/latest/meta-data/host-routes",
        &[],
        now,
    );
    assert_eq!(c.body, "0.0.0.0/0\n::/0");
    let c = call(v1, &t, &Method::GET, "/latest//meta-data/", &[], now);
    assert_eq!(
        c.body,
        "host-routes\ninstance-id\nmesh-ipv6\nnetwork/\nnumber"
    );
    let c = call(v1, &t, &Method::GET, "/", &[], now);
    assert_eq!(c.body, "latest/");
    let c = call(
        v1,
        &t,
        &Method::GET,
        "/latest/meta-data/network",
        &[("accept", "application/json")],
        now,
    );
    assert_eq!(c.body, r#"{"x":"y"}"#);
    assert_eq!(c.headers["content-type"], "application/json");
    let c = call(
        v1,
        &t,
        &Method::GET,
        "/latest/meta-data/instance-id",
        &[("accept", "application/json")],
        now,
    );
    assert_eq!(c.body, r#""web-7""#);
    let c = call(v1, &t, &Method::GET, "/latest/meta-data/number", &[], now);
    assert_eq!(c.status, StatusCode::NOT_IMPLEMENTED);
    let c = call(v1, &t, &Method::GET, "/latest/nope", &[], now);
    assert_eq!(
        (c.status, c.body.as_str()),
        (StatusCode::NOT_FOUND, "Resource not found: /latest/nope.")
    );
}

#[test]
fn version_2_needs_a_valid_token() {
    let t = tokens();
    let now = 1000;
    let v2 = MetadataVersion::V2;
    let leaf = "/latest/meta-data/instance-id";
    let c = call(v2, &t, &Method::GET, leaf, &[], now);
    assert_eq!(c.status, StatusCode::UNAUTHORIZED);
    assert!(c.body.starts_with("No MMDS token provided."), "{}", c.body);
    let c = call(
        v2,
        &t,
        &Method::GET,
        leaf,
        &[("x-metadata-token", "forged")],
        now,
    );
    assert_eq!(
        (c.status, c.body.as_str()),
        (StatusCode::UNAUTHORIZED, "MMDS token not valid.")
    );
    let tok = call(
        v2,
        &t,
        &Method::PUT,
        TOKEN_PATH,
        &[("x-metadata-token-ttl-seconds", "2")],
        now,
    );
    assert_eq!(tok.status, StatusCode::OK);
    let c = call(
        v2,
        &t,
        &Method::GET,
        leaf,
        &[("x-metadata-token", &tok.body)],
        now,
    );
    assert_eq!((c.status, c.body.as_str()), (StatusCode::OK, "web-7"));
    // The EC2 header names work too.
    let c = call(
        v2,
        &t,
        &Method::GET,
        leaf,
        &[("x-aws-ec2-metadata-token", &tok.body)],
        now,
    );
    assert_eq!(c.status, StatusCode::OK);
    // Expired.
    let later = now + 2;
    let c = call(
        v2,
        &t,
        &Method::GET,
        leaf,
        &[("x-metadata-token", &tok.body)],
        later,
    );
    assert_eq!(c.status, StatusCode::UNAUTHORIZED);
}

#[test]
fn token_put_answers_the_granted_ttl_under_the_name_asked() {
    let t = tokens();
    let now = 1000;
    for (name, ttl) in TTL_HEADERS.iter().zip(["60", "21600"]) {
        let c = call(
            MetadataVersion::V2,
            &t,
            &Method::PUT,
            TOKEN_PATH,
            &[(name, ttl)],
            now,
        );
        assert_eq!(c.status, StatusCode::OK, "{name}");
        assert_eq!(
            c.headers.get(*name).and_then(|v| v.to_str().ok()),
            Some(ttl),
            "{name}: {:?}",
            c.headers
        );
        let other = TTL_HEADERS.iter().find(|n| *n != name).unwrap();
        assert!(c.headers.get(*other).is_none(), "{name}: {:?}", c.headers);
    }
    // A refused TTL grants nothing and answers no TTL.
    let c = call(
        MetadataVersion::V2,
        &t,
        &Method::PUT,
        TOKEN_PATH,
        &[(TTL_HEADERS[0], "0")],
        now,
    );
    assert_eq!(c.status, StatusCode::BAD_REQUEST);
    assert!(c.headers.get(TTL_HEADERS[0]).is_none());
}

#[test]
fn version_1_takes_no_token_or_a_valid_one() {
    let t = tokens();
    let now = 1000;
    let v1 = MetadataVersion::V1;
    let leaf = "/latest/meta-data/instance-id";
    assert_eq!(
        call(v1, &t, &Method::GET, leaf, &[], now).status,
        StatusCode::OK
    );
    let tok = call(
        v1,
        &t,
        &Method::PUT,
        TOKEN_PATH,
        &[("x-aws-ec2-metadata-token-ttl-seconds", "60")],
        now,
    );
    assert_eq!(tok.status, StatusCode::OK);
    let ok = call(
        v1,
        &t,
        &Method::GET,
        leaf,
        &[("x-metadata-token", &tok.body)],
        now,
    );
    assert_eq!(ok.status, StatusCode::OK);
    let bad = call(
        v1,
        &t,
        &Method::GET,
        leaf,
        &[("x-metadata-token", "forged")],
        now,
    );
    assert_eq!(bad.status, StatusCode::UNAUTHORIZED);
}

#[test]
fn token_put_errors() {
    let t = tokens();
    let now = 1000;
    let v2 = MetadataVersion::V2;
    let c = call(v2, &t, &Method::PUT, TOKEN_PATH, &[], now);
    assert_eq!(c.status, StatusCode::BAD_REQUEST);
    assert!(
        c.body.starts_with("Token time to live value not found."),
        "{}",
        c.body
    );
    for bad in ["0", "21601", "x", " 5", "05", "+5", "5 "] {
        let c = call(
            v2,
            &t,
            &Method::PUT,
            TOKEN_PATH,
            &[("x-metadata-token-ttl-seconds", bad)],
            now,
        );
        assert_eq!(c.status, StatusCode::BAD_REQUEST, "{bad}");
    }
    let c = call(
        v2,
        &t,
        &Method::PUT,
        TOKEN_PATH,
        &[
            ("x-metadata-token-ttl-seconds", "60"),
            ("x-forwarded-for", "172.16.0.2"),
        ],
        now,
    );
    assert_eq!(c.status, StatusCode::BAD_REQUEST);
    assert!(c.body.contains("X-Forwarded-For"));
    let c = call(
        v2,
        &t,
        &Method::PUT,
        "/latest/meta-data",
        &[("x-metadata-token-ttl-seconds", "60")],
        now,
    );
    assert_eq!(c.status, StatusCode::NOT_FOUND);
}

#[test]
fn other_methods_and_the_rate_limit() {
    let t = tokens();
    let now = 1000;
    for m in [Method::POST, Method::PATCH, Method::DELETE] {
        let c = call(MetadataVersion::V1, &t, &m, "/", &[], now);
        assert_eq!(c.status, StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(c.headers["allow"], "GET, PUT");
    }
    let h = HeaderMap::new();
    let asked = Asked {
        method: &Method::GET,
        path: "/",
        headers: &h,
        now,
    };
    let r = respond(&doc(), MetadataVersion::V1, &t, false, asked);
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
}
