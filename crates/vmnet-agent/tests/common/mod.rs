//! Shared harness of the in-process API tests: a fake namespace driver, an agent over a
//! temporary SQLite file, and a request helper that checks every response against
//! `openapi.json` (documented status for the operation, body valid against its schema).

#![allow(dead_code, missing_docs)]

pub mod schema;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use tower::ServiceExt;
use vmnet_agent::agent::Agent;
use vmnet_ipam::Db;
use vmnet_kernel::ns::{BoxFuture, Change, NsDriver, NsError, ObservedVm};
use vmnet_plan::ns::{NsSettings, VmPlan};

/// What the fake kernel holds and what the agent asked of it.
#[derive(Debug, Default)]
pub struct FakeKernel {
    /// Applied plans by user id (the "kernel state").
    pub vms: BTreeMap<u32, VmPlan>,
    /// User ids whose apply fails (the driver then leaves the previous state, as the real one).
    pub fail: BTreeSet<u32>,
    /// User ids whose apply fails when it would change what is applied (re-applying the
    /// current plan still succeeds, as with a kernel that rejects only the new routes).
    pub fail_changes: BTreeSet<u32>,
    /// Every apply call, in order (user id, vm id).
    pub applies: Vec<(u32, String)>,
    /// Every remove call, in order.
    pub removes: Vec<u32>,
    /// The desired user ids of every gc call, in order.
    pub gcs: Vec<Vec<u32>>,
    /// observe calls.
    pub observes: u32,
    /// User ids whose apply waits for a permit of its semaphore (a hung kernel call).
    pub hold: BTreeMap<u32, Arc<tokio::sync::Semaphore>>,
}

/// A fake [`NsDriver`]: keeps plans in memory, fails on demand.
#[derive(Debug, Clone, Default)]
pub struct FakeDriver(pub Arc<Mutex<FakeKernel>>);

impl FakeDriver {
    pub fn kernel(&self) -> std::sync::MutexGuard<'_, FakeKernel> {
        self.0.lock().unwrap()
    }
    pub fn fail(&self, uid: u32, on: bool) {
        let mut k = self.kernel();
        if on {
            k.fail.insert(uid);
        } else {
            k.fail.remove(&uid);
        }
    }
    pub fn fail_changes(&self, uid: u32, on: bool) {
        let mut k = self.kernel();
        if on {
            k.fail_changes.insert(uid);
        } else {
            k.fail_changes.remove(&uid);
        }
    }
    pub fn applied(&self, uid: u32) -> Option<VmPlan> {
        self.kernel().vms.get(&uid).cloned()
    }
}

impl NsDriver for FakeDriver {
    fn apply<'a>(&'a self, plan: &'a VmPlan) -> BoxFuture<'a, Result<Vec<Change>, NsError>> {
        Box::pin(async move {
            let gate = self.kernel().hold.get(&plan.user_id).cloned();
            if let Some(g) = gate {
                g.acquire().await.expect("semaphore open").forget();
            }
            let mut k = self.kernel();
            k.applies.push((plan.user_id, plan.vm_id.clone()));
            let changed = k.vms.get(&plan.user_id) != Some(plan);
            if k.fail.contains(&plan.user_id) || (changed && k.fail_changes.contains(&plan.user_id))
            {
                return Err(NsError::Missing(format!(
                    "injected failure for {}",
                    plan.netns
                )));
            }
            k.vms.insert(plan.user_id, plan.clone());
            Ok(if changed {
                vec![Change::CreateVm {
                    netns: plan.netns.clone(),
                }]
            } else {
                Vec::new()
            })
        })
    }

    fn drift<'a>(&'a self, plan: &'a VmPlan) -> BoxFuture<'a, Result<Vec<Change>, NsError>> {
        Box::pin(async move {
            let k = self.kernel();
            Ok(if k.vms.get(&plan.user_id) == Some(plan) {
                Vec::new()
            } else {
                vec![Change::CreateVm {
                    netns: plan.netns.clone(),
                }]
            })
        })
    }

    fn remove(&self, user_id: u32) -> BoxFuture<'_, Result<Vec<Change>, NsError>> {
        Box::pin(async move {
            let mut k = self.kernel();
            k.removes.push(user_id);
            Ok(k.vms
                .remove(&user_id)
                .map(|_| Change::RemoveVm { user_id })
                .into_iter()
                .collect())
        })
    }

    fn observe(&self) -> BoxFuture<'_, Result<Vec<ObservedVm>, NsError>> {
        Box::pin(async move {
            let mut k = self.kernel();
            k.observes += 1;
            Ok(k.vms
                .values()
                .map(|p| ObservedVm {
                    user_id: p.user_id,
                    netns: Some(p.netns.clone()),
                    host_veth: p
                        .veth
                        .as_ref()
                        .map(|v| (v.host_name.clone(), 1000 + p.user_id)),
                    ..ObservedVm::default()
                })
                .collect())
        })
    }

    fn gc<'a>(&'a self, keep: &'a [u32]) -> BoxFuture<'a, Result<Vec<u32>, NsError>> {
        Box::pin(async move {
            let mut k = self.kernel();
            let keep: BTreeSet<u32> = keep.iter().copied().collect();
            k.gcs.push(keep.iter().copied().collect());
            let gone: Vec<u32> = k
                .vms
                .keys()
                .copied()
                .filter(|u| !keep.contains(u))
                .collect();
            for u in &gone {
                k.vms.remove(u);
            }
            Ok(gone)
        })
    }
}

/// An agent over a temporary SQLite file with a fake driver, and its router.
pub struct Harness {
    pub dir: PathBuf,
    pub db_url: String,
    pub driver: FakeDriver,
    pub agent: Arc<Agent>,
    pub router: Router,
    _tmp: Option<tempfile::TempDir>,
}

pub fn settings() -> NsSettings {
    NsSettings {
        name_prefix: "tst".into(),
        ..NsSettings::default()
    }
}

impl Harness {
    pub async fn new() -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let mut h = Self::open(tmp.path(), FakeDriver::default(), settings()).await;
        h._tmp = Some(tmp);
        h
    }

    /// An agent over a fresh database of the test kit's shared PostgreSQL cluster.
    pub async fn postgres() -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let url = vmnet_testkit::postgres::PgCluster::shared()
            .fresh_database_url()
            .unwrap();
        let mut h = Self::open_url(tmp.path(), &url, FakeDriver::default(), settings()).await;
        h._tmp = Some(tmp);
        h
    }

    /// An agent over the database in `dir` (created if missing).
    pub async fn open(dir: &Path, driver: FakeDriver, settings: NsSettings) -> Self {
        let mut h = Self::open_with(dir, Arc::new(driver.clone()), settings).await;
        h.driver = driver;
        h
    }

    /// An agent over the database in `dir` applying through `kernel` (e.g. the real namespace
    /// driver in a sandbox); [`Harness::driver`] is then an unused fake.
    pub async fn open_with(dir: &Path, kernel: Arc<dyn NsDriver>, settings: NsSettings) -> Self {
        let db_url = format!("sqlite://{}", dir.join("vmnet.db").display());
        Self::open_url_with(dir, &db_url, kernel, FakeDriver::default(), settings).await
    }

    /// An agent over the database at `db_url`; `dir` is kept as the harness directory.
    pub async fn open_url(
        dir: &Path,
        db_url: &str,
        driver: FakeDriver,
        settings: NsSettings,
    ) -> Self {
        let kernel: Arc<dyn NsDriver> = Arc::new(driver.clone());
        Self::open_url_with(dir, db_url, kernel, driver, settings).await
    }

    /// An agent over the database at `db_url` applying through `kernel`; `driver` is kept as
    /// [`Harness::driver`].
    async fn open_url_with(
        dir: &Path,
        db_url: &str,
        kernel: Arc<dyn NsDriver>,
        driver: FakeDriver,
        settings: NsSettings,
    ) -> Self {
        let db_url = db_url.to_owned();
        let db = Db::connect(&db_url).await.unwrap();
        let agent = Agent::new(db, kernel, settings, Duration::from_secs(3600)).unwrap();
        let router = vmnet_agent::api::router(Arc::clone(&agent));
        Self {
            dir: dir.to_owned(),
            db_url,
            driver,
            agent,
            router,
            _tmp: None,
        }
    }

    /// Sends a request; asserts the response is documented (status and body); returns both.
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let bytes = body.map(|b| serde_json::to_vec(&b).unwrap());
        self.raw(method, path, bytes, Some("application/json"))
            .await
    }

    pub async fn raw(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
        content_type: Option<&str>,
    ) -> (StatusCode, Value) {
        let mut req = Request::builder().method(method.clone()).uri(path);
        if body.is_some()
            && let Some(ct) = content_type
        {
            req = req.header("content-type", ct);
        }
        let req = req.body(body.map_or_else(Body::empty, Body::from)).unwrap();
        let resp = self.router.clone().oneshot(req).await.unwrap();
        let status = resp.status();
        let ct = resp
            .headers()
            .get("content-type")
            .map(|v| v.to_str().unwrap().to_owned());
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        let value: Value = serde_json::from_slice(&bytes).unwrap_or_else(|e| {
            panic!("{method} {path}: {status} body is not JSON ({e}): {bytes:?}")
        });
        assert_eq!(
            ct.as_deref(),
            Some("application/json"),
            "{method} {path}: content type"
        );
        check_documented(&method, path, status, &value);
        (status, value)
    }

    pub async fn put_vm(&self, cfg: &Value) -> (StatusCode, Value) {
        let id = cfg["id"].as_str().unwrap().to_owned();
        self.call(Method::PUT, &format!("/v1/vms/{id}"), Some(cfg.clone()))
            .await
    }

    /// `GET path`.
    pub async fn get(&self, path: &str) -> (StatusCode, Value) {
        self.call(Method::GET, path, None).await
    }

    /// `PUT path` with a JSON body.
    pub async fn put(&self, path: &str, body: Value) -> (StatusCode, Value) {
        self.call(Method::PUT, path, Some(body)).await
    }

    /// `POST path` with a JSON body.
    pub async fn post(&self, path: &str, body: Value) -> (StatusCode, Value) {
        self.call(Method::POST, path, Some(body)).await
    }

    /// `DELETE path`.
    pub async fn delete(&self, path: &str) -> (StatusCode, Value) {
        self.call(Method::DELETE, path, None).await
    }

    /// `PUT /v1/pools/{pool}/range` with `body` (see [`range`]).
    pub async fn put_range(&self, pool: &str, body: Value) -> (StatusCode, Value) {
        self.put(&format!("/v1/pools/{pool}/range"), body).await
    }

    /// `PUT /v1/hosts/{id}` with this capacity.
    pub async fn put_host(&self, id: &str, vcpus: i64, memory_mib: i64) -> (StatusCode, Value) {
        let body = serde_json::json!({"vcpus": vcpus, "memory_mib": memory_mib});
        self.put(&format!("/v1/hosts/{id}"), body).await
    }

    /// A fixture: pool `pool` gets the range `body` (see [`range`]); asserts 200 and returns
    /// the range as answered.
    pub async fn with_range(&self, pool: &str, body: Value) -> Value {
        let (st, r) = self.put_range(pool, body).await;
        assert_eq!(st, StatusCode::OK, "range of pool {pool}: {r}");
        r
    }

    /// A fixture: host `id` with this capacity; asserts 200 and returns the host as answered.
    pub async fn with_host(&self, id: &str, vcpus: i64, memory_mib: i64) -> Value {
        let (st, h) = self.put_host(id, vcpus, memory_mib).await;
        assert_eq!(st, StatusCode::OK, "host {id}: {h}");
        h
    }

    /// A fixture: creates `body` (see [`instance`]); asserts 201 and returns the instance.
    pub async fn with_instance(&self, body: Value) -> Value {
        let (st, v) = self.post("/v1/instances", body).await;
        assert_eq!(st, StatusCode::CREATED, "create instance: {v}");
        v
    }

    /// The IPAM fixture most API tests start from: pool `p1` with range 10.0.0.0/29 (gateway
    /// .1, leases .2 to .6) and host `h1` with 64 vCPUs and 64 GiB.
    pub async fn with_pool_and_host(&self) {
        self.with_range("p1", range("10.0.0.0/29", "10.0.0.1"))
            .await;
        self.with_host("h1", 64, 65536).await;
    }
}

/// Asserts `400 INVALID_INPUT` with exactly `message`.
pub fn assert_invalid(got: &(StatusCode, Value), message: &str) {
    assert_eq!(got.0.as_u16(), 400, "{}", got.1);
    assert_eq!(
        got.1,
        serde_json::json!({"error": {"code": "INVALID_INPUT", "message": message}})
    );
}

/// The body of a range: `cidr` and `gateway`, the rest left to the defaults.
pub fn range(cidr: &str, gateway: &str) -> Value {
    serde_json::json!({"cidr": cidr, "gateway": gateway})
}

/// The body of an instance `id` in pool `pool` (1 vCPU, 512 MiB, placed by the store).
pub fn instance(id: &str, pool: &str) -> Value {
    serde_json::json!({"instance_id": id, "pool_id": pool, "vcpus": 1, "memory_mib": 512})
}

/// The body of instance `id` in `pool` placed on host `host`.
pub fn instance_on(id: &str, pool: &str, host: &str) -> Value {
    let mut v = instance(id, pool);
    v["host_id"] = host.into();
    v
}

/// A VM config: mesh address `fdaa:1::<uid hex>`, IPv4 default route via the host.
pub fn vm(id: &str, uid: u32) -> Value {
    serde_json::json!({"id": id, "user_id": uid, "tenant": 1, "mesh_ipv6": format!("fdaa:1::{uid:x}"),
           "network": {"routes": [{"destination": "0.0.0.0/0", "via": "host"}]}})
}

/// The OpenAPI document.
pub fn openapi() -> Value {
    serde_json::from_str(vmnet_agent::api::OPENAPI_JSON).expect("openapi.json is JSON")
}

/// The spec path template matching a concrete path, if any.
pub fn template_of(doc: &Value, path: &str) -> Option<String> {
    let segs: Vec<&str> = path.trim_end_matches('/').split('/').collect();
    doc["paths"]
        .as_object()
        .unwrap()
        .keys()
        .find(|t| {
            let ts: Vec<&str> = t.split('/').collect();
            ts.len() == segs.len()
                && ts
                    .iter()
                    .zip(&segs)
                    .all(|(a, b)| a.starts_with('{') || a == b)
        })
        .cloned()
}

/// Asserts that `status` is documented for the operation and `body` validates against its schema.
pub fn check_documented(method: &Method, path: &str, status: StatusCode, body: &Value) {
    let doc = openapi();
    let path_only = path.split('?').next().unwrap();
    let op = template_of(&doc, path_only).and_then(|t| {
        doc["paths"][t.as_str()]
            .get(method.as_str().to_lowercase())
            .cloned()
    });
    let schema = match &op {
        Some(op) => {
            let resp = op["responses"].get(status.as_str()).unwrap_or_else(|| {
                panic!("{method} {path}: status {status} is not documented for this operation (body {body})")
            });
            let resp = match resp.get("$ref").and_then(Value::as_str) {
                Some(r) => doc.pointer(r.trim_start_matches('#')).unwrap().clone(),
                None => resp.clone(),
            };
            resp["content"]["application/json"]["schema"].clone()
        }
        None => {
            // An unknown path is 404; a wrong method on a documented path is 405 (with Allow).
            let want = if template_of(&doc, path_only).is_some() {
                StatusCode::METHOD_NOT_ALLOWED
            } else {
                StatusCode::NOT_FOUND
            };
            assert_eq!(
                status, want,
                "{method} {path}: undocumented route answered {status}"
            );
            serde_json::json!({"$ref": "#/components/schemas/Error"})
        }
    };
    let errs = schema::validate(&doc, &schema, body);
    assert!(
        errs.is_empty(),
        "{method} {path} ({status}): response does not match openapi.json: {errs:#?}\nbody: {body}"
    );
    if !status.is_success() {
        let code = body["error"]["code"].as_str().unwrap();
        let expected = match code {
            "METHOD_NOT_ALLOWED" => 405,
            "INVALID_INPUT" => 400,
            "NOT_FOUND" => 404,
            "CONFLICT" => 409,
            "CAPACITY_UNAVAILABLE" | "UNAVAILABLE" => 503,
            _ => 500,
        };
        assert_eq!(
            status.as_u16(),
            expected,
            "{method} {path}: status of {code}"
        );
    }
}

/// Asserts an error answer: status, code, and that the message contains every `needle`.
pub fn assert_error(got: &(StatusCode, Value), status: u16, code: &str, needles: &[&str]) {
    assert_eq!(got.0.as_u16(), status, "status; body {}", got.1);
    assert_eq!(got.1["error"]["code"], code, "code; body {}", got.1);
    let msg = got.1["error"]["message"].as_str().unwrap();
    for n in needles {
        assert!(msg.contains(n), "message {msg:?} should contain {n:?}");
    }
}
