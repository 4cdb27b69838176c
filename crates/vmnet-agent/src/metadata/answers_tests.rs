use std::sync::Arc;

use http_body_util::BodyExt;
use hyper::header::HeaderValue;
use hyper::{Method, StatusCode};
use serde_json::json;
use vmnet_model::vm::metadata::MetadataVersion;

use super::*;
use crate::metadata::mmds::{Asked, respond, respond_document};
use crate::metadata::tokens::{TokenKey, Tokens};

fn tricky() -> Value {
    json!({
        "latest": {"meta-data": {
            "instance-id": "web-7", "host-routes": "0.0.0.0/0\n::/0", "quote\"d": "a\"b\\c",
            "network": {"x": "y", "empty": {}}, "number": 5.25, "flag": true, "nothing": null,
            "list": ["a", {"b": "c"}, 3], "a/b": "slash", "t~1": "tilde", "~": "bare", "": "empty",
            "under-empty": {"": {"deep": "x"}}, "ünï": "côdé",
            "sl/ash": {"k": "v"}, "ti~lde": {"k~": {}},
        }},
        "": {"k": "v"},
    })
}

fn reply(r: MmdsResponse) -> (StatusCode, HeaderMap, Bytes) {
    let status = r.status();
    let headers = r.headers().clone();
    let body = futures::executor::block_on(r.into_body().collect())
        .unwrap()
        .to_bytes();
    (status, headers, body)
}

/// Every path of `doc` a request can name, sanitised (and not), the way `doc.pointer` takes it.
fn paths(v: &Value, at: &str, out: &mut Vec<String>) {
    out.push(if at.is_empty() { "/".into() } else { at.into() });
    match v {
        Value::Object(m) => {
            for (k, c) in m {
                paths(c, &format!("{at}/{}", escape(k)), out);
            }
        }
        Value::Array(a) => {
            for (i, c) in a.iter().enumerate() {
                paths(c, &format!("{at}/{i}"), out);
            }
        }
        _ => {}
    }
}

#[test]
fn cached_answers_are_those_of_the_lookup() {
    let value = tricky();
    let doc = Document::new(value.clone());
    // The root, latest, meta-data, network, network/empty, under-empty (not its "" child),
    // sl/ash, ti~lde, ti~lde/k~.
    assert_eq!(doc.cached(), 9);
    let mut all = Vec::new();
    paths(&value, "", &mut all);
    let extra = [
        "",
        "*",
        "//",
        "/latest/",
        "/latest//meta-data//",
        "/latest/meta-data/",
        "/latest/meta-data/nope",
        "/latest/meta-data/list/01",
        "/latest/meta-data/list/+1",
        "/latest/meta-data/~2",
        "/latest/meta-data/t~01",
        "/latest/meta-data/a~1b/",
        "/latest/meta-data/network/empty",
    ];
    all.extend(extra.iter().map(|s| (*s).to_owned()));
    let variants: Vec<String> = all
        .iter()
        .flat_map(|p| [p.clone(), format!("{p}/"), p.replace('/', "//")])
        .collect();
    let tokens = Tokens::new(Arc::new(TokenKey::random().unwrap()), "vm");
    let now = 1000;
    let mut hits = 0;
    for path in &variants {
        for accept in [
            None,
            Some("application/json"),
            Some("text/html, application/json"),
        ] {
            let mut h = HeaderMap::new();
            if let Some(a) = accept {
                h.append(hyper::header::ACCEPT, HeaderValue::from_static(a));
            }
            let asked = Asked {
                method: &Method::GET,
                path,
                headers: &h,
                now,
            };
            let slow = reply(respond(&value, MetadataVersion::V1, &tokens, true, asked));
            let fast = reply(respond_document(
                &doc,
                MetadataVersion::V1,
                &tokens,
                true,
                asked,
            ));
            assert_eq!(slow, fast, "{path} {accept:?}");
            if slow.0 == StatusCode::OK {
                hits += 1;
            }
        }
    }
    assert!(hits > 50, "{hits}");
}

#[test]
fn json_answers_share_one_buffer() {
    let value = tricky();
    let doc = Document::new(value.clone());
    let root = &doc.find("/").unwrap().json;
    assert_eq!(root.as_ref(), value.to_string().as_bytes());
    let md = &doc.find("/latest/meta-data").unwrap().json;
    let at = md.as_ptr() as usize - root.as_ptr() as usize;
    assert!(at + md.len() <= root.len(), "a slice of the root's buffer");
    assert!(doc.find("/latest/meta-data/under-empty").is_some());
    assert!(doc.find("/latest/meta-data/under-empty/").is_none());
    assert!(doc.find("/latest/meta-data/a~1b").is_none(), "a leaf");
    assert!(doc.find("/latest/meta-data/sl~1ash").is_some());
    assert!(doc.find("/latest/meta-data/ti~0lde/k~0").is_some());
    let listing = &doc.find("/latest/meta-data/network").unwrap().text;
    assert_eq!(listing.as_ref(), b"empty/\nx");
}
