//! A fake provider on 127.0.0.1 for the provider-pool tests: Hetzner Cloud's `GET /v1/servers`
//! with `meta.pagination`, and Proxmox VE's `/api2/json/cluster/resources`, `…/config` and
//! `…/agent/network-get-interfaces`, in the documented shapes (with extra fields the clients
//! must ignore). It counts every request, checks the `Authorization` header (401 otherwise) and
//! answers scripted failures first: a status, 429 with a `Retry-After`, malformed JSON, or a
//! delay.

#![allow(dead_code, missing_docs)]

/// Runs each named test `fn name(h: Harness)` once on SQLite and once on PostgreSQL (modules
/// `sqlite` and `postgres` of the including test file).
macro_rules! both {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Harness::new().await).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Harness::postgres().await).await;
                }
            )*
        }
    };
}

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

/// A scripted answer, used (and dropped) by the next request.
#[derive(Debug, Clone)]
pub enum Script {
    /// Answer this status with a provider error body.
    Status(u16),
    /// Answer 429 with this `Retry-After` (none: no header).
    RateLimit(Option<String>),
    /// Answer 200 with a body that is not JSON.
    Malformed,
    /// Answer 200 with JSON of the wrong shape.
    WrongShape,
    /// Wait this long, then answer normally.
    Delay(Duration),
}

#[derive(Debug, Default)]
pub struct FakeState {
    /// Every request's path and query, in arrival order.
    pub requests: Vec<String>,
    /// The `Authorization` value the fake accepts.
    pub authorization: String,
    /// Hetzner: the servers (JSON objects), in id order.
    pub servers: Vec<Value>,
    /// Proxmox: `cluster/resources` entries.
    pub resources: Vec<Value>,
    /// Proxmox: each vmid's config.
    pub configs: BTreeMap<u32, Value>,
    /// Proxmox: each vmid's guest agent interfaces (`result`).
    pub agents: BTreeMap<u32, Value>,
    /// Proxmox: a status to answer for every request whose path ends with this suffix.
    pub fail_suffix: Option<(String, u16)>,
    /// Answers for the next requests.
    pub script: VecDeque<Script>,
}

pub struct Fake {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    pub state: Arc<Mutex<FakeState>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Fake {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Fake {
    pub async fn start(authorization: &str) -> Self {
        let state = Arc::new(Mutex::new(FakeState {
            authorization: authorization.into(),
            ..FakeState::default()
        }));
        let app = Router::new()
            .fallback(answer)
            .with_state(Arc::clone(&state));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self { url, state, task }
    }

    pub fn st(&self) -> std::sync::MutexGuard<'_, FakeState> {
        self.state.lock().unwrap()
    }

    /// Requests so far; resets the count.
    pub fn take_requests(&self) -> Vec<String> {
        std::mem::take(&mut self.st().requests)
    }

    pub fn script(&self, s: Script) {
        self.st().script.push_back(s);
    }
}

/// A Hetzner server with a public IPv4 (`203.0.113.x` / `198.51.100.x`), its /64 and a private
/// network address, as the reference shows it (with fields the client ignores).
pub fn hetzner_server(id: u64) -> Value {
    let hi = (id / 250) % 250;
    let lo = id % 250 + 1;
    json!({
        "id": id,
        "name": format!("srv-{id}"),
        "status": "running",
        "created": "2016-01-30T23:55:00+00:00",
        "public_net": {
            "ipv4": {"id": id, "ip": format!("203.0.{hi}.{lo}"), "blocked": false, "dns_ptr": "x.example.com"},
            "ipv6": {"id": id, "ip": format!("2001:db8:{id:x}::/64"), "blocked": false, "dns_ptr": []},
            "floating_ips": [],
            "firewalls": []
        },
        "private_net": [{"network": 4711, "ip": format!("10.{hi}.{}.{lo}", 0), "alias_ips": [], "mac_address": "86:00:ff:2a:7d:e1"}],
        "server_type": {"id": 1, "name": "cx22"},
        "labels": {}
    })
}

/// What `hetzner_server(id)` gives as addresses.
pub fn hetzner_addresses(id: u64) -> Vec<String> {
    let hi = (id / 250) % 250;
    let lo = id % 250 + 1;
    vec![
        format!("203.0.{hi}.{lo}/32"),
        format!("2001:db8:{id:x}::/64"),
        format!("10.{hi}.0.{lo}/32"),
    ]
}

fn json_response(status: StatusCode, v: &Value) -> Response {
    let mut r = (status, v.to_string()).into_response();
    r.headers_mut()
        .insert("content-type", HeaderValue::from_static("application/json"));
    r
}

fn error(status: u16) -> Response {
    let s = StatusCode::from_u16(status).unwrap();
    json_response(
        s,
        &json!({"error": {"code": "fake", "message": format!("fake {status}")}}),
    )
}

fn query(q: &str, key: &str) -> Option<u64> {
    q.split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .and_then(|(_, v)| v.parse().ok())
}

async fn answer(State(state): State<Arc<Mutex<FakeState>>>, req: Request) -> Response {
    let path = req.uri().path().to_owned();
    let q = req.uri().query().unwrap_or("").to_owned();
    let auth = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let (scripted, ok_auth, fail) = {
        let mut st = state.lock().unwrap();
        st.requests.push(if q.is_empty() {
            path.clone()
        } else {
            format!("{path}?{q}")
        });
        let fail = st
            .fail_suffix
            .as_ref()
            .filter(|(s, _)| path.ends_with(s.as_str()))
            .map(|(_, c)| *c);
        (st.script.pop_front(), st.authorization == auth, fail)
    };
    match scripted {
        Some(Script::Status(c)) => return error(c),
        Some(Script::RateLimit(after)) => {
            let mut r = error(429);
            if let Some(a) = after {
                r.headers_mut()
                    .insert("retry-after", HeaderValue::from_str(&a).unwrap());
            }
            return r;
        }
        Some(Script::Malformed) => {
            return Response::builder()
                .header("content-type", "application/json")
                .body(Body::from("{\"servers\": [{\"id\": 1,"))
                .unwrap();
        }
        Some(Script::WrongShape) => {
            return json_response(StatusCode::OK, &json!({"servers": "none", "data": 7}));
        }
        Some(Script::Delay(d)) => tokio::time::sleep(d).await,
        None => {}
    }
    if !ok_auth {
        return error(401);
    }
    if let Some(c) = fail {
        return error(c);
    }
    let st = state.lock().unwrap();
    if path == "/v1/servers" {
        let page = query(&q, "page").unwrap_or(1).max(1);
        let per_page = query(&q, "per_page").unwrap_or(25).clamp(1, 50);
        let total = st.servers.len() as u64;
        let last = total.div_ceil(per_page).max(1);
        let from = usize::try_from((page - 1) * per_page)
            .unwrap()
            .min(st.servers.len());
        let to = usize::try_from(page * per_page)
            .unwrap()
            .min(st.servers.len());
        return json_response(
            StatusCode::OK,
            &json!({
                "servers": st.servers[from..to],
                "meta": {"pagination": {
                    "page": page, "per_page": per_page,
                    "previous_page": if page > 1 { json!(page - 1) } else { Value::Null },
                    "next_page": if page < last { json!(page + 1) } else { Value::Null },
                    "last_page": last, "total_entries": total
                }}
            }),
        );
    }
    if path == "/api2/json/cluster/resources" {
        return json_response(StatusCode::OK, &json!({"data": st.resources}));
    }
    // /api2/json/nodes/{node}/qemu/{vmid}/config | …/agent/network-get-interfaces
    let parts: Vec<&str> = path.split('/').collect();
    if parts.len() >= 7 && parts[..4] == ["", "api2", "json", "nodes"] && parts[5] == "qemu" {
        let vmid: u32 = parts[6].parse().unwrap_or(0);
        let rest = parts[7..].join("/");
        if rest == "config" {
            return match st.configs.get(&vmid) {
                Some(c) => json_response(StatusCode::OK, &json!({"data": c})),
                None => error(500),
            };
        }
        if rest == "agent/network-get-interfaces" {
            return match st.agents.get(&vmid) {
                Some(r) => json_response(StatusCode::OK, &json!({"data": {"result": r}})),
                None => error(500),
            };
        }
    }
    error(404)
}
