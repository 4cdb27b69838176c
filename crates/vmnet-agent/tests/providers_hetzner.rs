//! Provider pools, Hetzner Cloud (spec: hosted-pool-networking.md, "Addresses on an instance",
//! provider pools), against a fake Hetzner Cloud API v1 on 127.0.0.1, through the agent's API
//! and its poller, on SQLite and PostgreSQL: pagination (1,000 servers in at most 25
//! requests), every poll replacing the addresses, 429 with Retry-After, 401, 500, timeouts and
//! malformed JSON keeping the last good addresses (stale), and the failure in `GET /v1/status`.

mod common;
#[macro_use]
mod provider_fake;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::Method;
use common::Harness;
use provider_fake::{Fake, Script, hetzner_addresses, hetzner_server};
use serde_json::{Value, json};
use vmnet_agent::provider::fetch::Direct;
use vmnet_agent::provider::http::HttpSettings;
use vmnet_agent::provider::poller::{Poller, PollerSettings};
use vmnet_ipam::{Machine, NewInstance, ProviderPool};
use vmnet_model::pool::ProviderRules;

const TOKEN: &str = "hz-test-token-7f3a";

/// A harness with a fake Hetzner API, a token file, pool `hz` pointing at both and a poller
/// with short timeouts.
struct World {
    h: Harness,
    fake: Fake,
    poller: Arc<Poller>,
    _tmp: tempfile::TempDir,
}

async fn world(h: Harness) -> World {
    let fake = Fake::start(&format!("Bearer {TOKEN}")).await;
    let tmp = tempfile::tempdir().unwrap();
    let token = tmp.path().join("hcloud.token");
    // The agent reads credentials only from its credentials directory, and the fake speaks
    // plain HTTP on loopback.
    let rules = ProviderRules::new(tmp.path().to_str().unwrap(), true).unwrap();
    h.agent.set_provider_rules(rules.clone());
    std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
    std::fs::set_permissions(&token, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let (st, v) = h
        .call(
            Method::PUT,
            "/v1/pools/hz/provider",
            Some(
                json!({"provider": "hetzner-cloud", "api_url": format!("{}/v1/", fake.url),
                        "credentials": {"file": token.display().to_string()}}),
            ),
        )
        .await;
    assert!(st.is_success(), "{st} {v}");
    assert_eq!(v["kind"], "provider");
    assert_eq!(v["provider"]["api_url"], format!("{}/v1", fake.url));
    assert_eq!(v["provider"]["poll_interval_secs"], 30);
    let settings = PollerSettings {
        http: HttpSettings {
            request_timeout: Duration::from_millis(500),
            max_retry_wait: Duration::from_secs(5),
            ..HttpSettings::default()
        },
        tick: Duration::from_millis(50),
    };
    let direct = Arc::new(Direct::new(&settings.http).unwrap());
    let poller = Poller::new(h.agent.db().clone(), settings, direct, rules);
    h.agent.set_providers(Arc::clone(&poller)).unwrap();
    World {
        h,
        fake,
        poller,
        _tmp: tmp,
    }
}

impl World {
    async fn pool(&self) -> ProviderPool {
        let (_, v) = self.h.call(Method::GET, "/v1/pools/hz", None).await;
        serde_json::from_value(v["provider"].clone()).unwrap()
    }

    async fn poll(&self) -> Value {
        let st = self.poller.poll_pool(&self.pool().await).await;
        serde_json::to_value(st).unwrap()
    }

    /// Instances `vm<id>` for server ids `ids`, created in one transaction.
    async fn machines(&self, ids: impl IntoIterator<Item = u64>) {
        let db = self.h.agent.db();
        let mut tx = vmnet_ipam::Store::begin(db).await.unwrap();
        for id in ids {
            let mut r = NewInstance::new(format!("vm{id}"), "hz");
            r.machine = Some(Machine::hetzner(id));
            vmnet_ipam::create_instance(&mut tx, &r).await.unwrap();
        }
        tx.commit().await.unwrap();
    }

    async fn instance(&self, id: &str) -> Value {
        let (st, v) = self
            .h
            .call(Method::GET, &format!("/v1/instances/{id}"), None)
            .await;
        assert!(st.is_success(), "{st} {v}");
        v
    }

    async fn status(&self) -> Value {
        let (st, v) = self.h.call(Method::GET, "/v1/status", None).await;
        assert!(st.is_success());
        assert!(!v.to_string().contains(TOKEN), "the secret never shows");
        v["provider_pools"][0].clone()
    }
}

fn strs(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_owned())
        .collect()
}

/// 1,000 servers on 20 pages of 50: one poll sends 20 requests (at most 25), every machine gets
/// its addresses; a second poll replaces them (changed, removed) and never appends.
async fn thousand_servers_paginated_and_replaced(h: Harness) {
    let w = world(h).await;
    w.fake.st().servers = (1..=1000).map(hetzner_server).collect();
    w.machines(1..=1000).await;
    let started = Instant::now();
    let st = w.poll().await;
    let took = started.elapsed();
    let requests = w.fake.take_requests();
    assert_eq!(st["state"], "ok", "{st}");
    assert_eq!(st["machines"], 1000);
    assert!(requests.len() <= 25, "{} requests", requests.len());
    assert_eq!(requests.len(), 20);
    assert_eq!(st["last_requests"], 20);
    assert!(
        requests.iter().all(|r| r.contains("per_page=50")),
        "{requests:?}"
    );
    println!(
        "1000 Hetzner machines: {} requests, poll {} ms",
        requests.len(),
        took.as_millis()
    );
    for id in [1u64, 50, 51, 777, 1000] {
        let v = w.instance(&format!("vm{id}")).await;
        assert_eq!(strs(&v["addresses"]), hetzner_addresses(id), "vm{id}");
        assert_eq!(v["addresses_stale"], false);
        assert!(v["addresses_polled_at_unix_ms"].is_i64());
        assert_eq!(v["machine"], json!({"server_id": id}));
        assert_eq!(v["host_id"], Value::Null);
    }
    // The provider changes server 7: a new IPv4, no IPv6, no private network; server 8 is gone.
    {
        let mut st = w.fake.st();
        st.servers[6]["public_net"]["ipv4"]["ip"] = json!("198.51.100.7");
        st.servers[6]["public_net"]["ipv6"] = Value::Null;
        st.servers[6]["private_net"] = json!([]);
        st.servers.remove(7);
    }
    let st = w.poll().await;
    assert_eq!(st["state"], "ok");
    assert_eq!(st["missing"], json!(["vm8"]));
    assert_eq!(
        strs(&w.instance("vm7").await["addresses"]),
        ["198.51.100.7/32"]
    );
    assert_eq!(
        strs(&w.instance("vm8").await["addresses"]),
        Vec::<String>::new()
    );
    assert_eq!(
        strs(&w.instance("vm9").await["addresses"]),
        hetzner_addresses(9)
    );
    // The same answer again: the same list, nothing appended.
    w.poll().await;
    assert_eq!(
        strs(&w.instance("vm7").await["addresses"]),
        ["198.51.100.7/32"]
    );
    assert_eq!(
        strs(&w.instance("vm9").await["addresses"]),
        hetzner_addresses(9)
    );
}

/// 500, malformed JSON, a wrong shape, a timeout and 401 each keep the last good addresses,
/// marked stale; the pool's state and error show in `GET /v1/status` (401: `auth_failed`); a
/// good poll clears `stale`.
async fn failures_keep_the_last_good_addresses(h: Harness) {
    let w = world(h).await;
    w.fake.st().servers = (1..=3).map(hetzner_server).collect();
    w.machines(1..=3).await;
    let (_, before) = w.h.call(Method::GET, "/v1/status", None).await;
    assert_eq!(
        before["provider_pools"],
        json!([]),
        "polling on, nothing polled yet"
    );
    assert_eq!(w.poll().await["state"], "ok");
    let good = w.instance("vm2").await;
    let cases: Vec<(Script, &str, &str)> = vec![
        (Script::Status(500), "status", "answered 500"),
        (Script::Status(302), "status", "answered 302"),
        (
            Script::Malformed,
            "malformed",
            "the answer is not the documented JSON",
        ),
        (
            Script::WrongShape,
            "malformed",
            "the answer is not the documented JSON",
        ),
        (
            Script::Delay(Duration::from_secs(2)),
            "timeout",
            "no answer within 500 ms",
        ),
    ];
    for (script, kind, words) in cases {
        let good = w.instance("vm2").await;
        w.fake.script(script.clone());
        let st = w.poll().await;
        assert_eq!(st["state"], "failing", "{script:?}: {st}");
        assert_eq!(st["last_error_kind"], kind, "{script:?}");
        assert!(
            st["last_error"].as_str().unwrap().contains(words),
            "{script:?}: {st}"
        );
        let v = w.instance("vm2").await;
        assert_eq!(v["addresses"], good["addresses"], "{script:?}: kept");
        assert_eq!(v["addresses_stale"], true, "{script:?}");
        assert_eq!(
            v["addresses_polled_at_unix_ms"],
            good["addresses_polled_at_unix_ms"]
        );
        assert_eq!(w.status().await["state"], "failing");
        assert_eq!(w.poll().await["state"], "ok", "{script:?}: recovers");
        assert_eq!(w.instance("vm2").await["addresses_stale"], false);
    }
    // The token is revoked: 401, shown as auth_failed, never as an empty address list.
    w.fake.st().authorization = "Bearer another".into();
    let st = w.poll().await;
    assert_eq!(st["state"], "auth_failed", "{st}");
    assert_eq!(st["last_error_kind"], "auth");
    assert_eq!(st["consecutive_failures"], 1);
    let v = w.instance("vm2").await;
    assert_eq!(v["addresses"], good["addresses"]);
    assert_eq!(v["addresses_stale"], true);
    let shown = w.status().await;
    assert_eq!(shown["state"], "auth_failed");
    assert!(
        shown["last_error"]
            .as_str()
            .unwrap()
            .ends_with("answered 401: the credentials were refused"),
        "{shown}"
    );
    // An unreadable token file is an auth failure too, naming the file only.
    std::fs::remove_file(w._tmp.path().join("hcloud.token")).unwrap();
    let st = w.poll().await;
    assert_eq!(st["state"], "auth_failed");
    assert_eq!(st["last_error_kind"], "credentials");
    assert_eq!(st["consecutive_failures"], 2);
    assert_eq!(
        w.fake.take_requests().len(),
        12,
        "no request without a token"
    );
}

/// 429 with `Retry-After: 1` is waited for and the request sent again; a `Retry-After` longer
/// than the poller waits fails the poll (`rate_limited`) and puts the next poll that far out.
async fn rate_limits_honour_retry_after(h: Harness) {
    let w = world(h).await;
    w.fake.st().servers = (1..=60).map(hetzner_server).collect();
    w.machines([1, 60]).await;
    w.fake.script(Script::RateLimit(Some("1".into())));
    let started = Instant::now();
    let st = w.poll().await;
    assert_eq!(st["state"], "ok", "{st}");
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "waited as asked"
    );
    assert_eq!(st["last_requests"], 3, "page 1 twice, then page 2");
    assert_eq!(
        strs(&w.instance("vm60").await["addresses"]),
        hetzner_addresses(60)
    );
    w.fake.take_requests();
    w.fake.script(Script::RateLimit(Some("120".into())));
    let st = w.poll().await;
    assert_eq!(st["state"], "failing");
    assert_eq!(st["last_error_kind"], "rate_limited");
    assert_eq!(
        w.fake.take_requests().len(),
        1,
        "not retried: the wait is too long"
    );
    let next =
        st["next_poll_at_unix_ms"].as_i64().unwrap() - st["last_poll_at_unix_ms"].as_i64().unwrap();
    assert!(next >= 120_000, "next poll in {next} ms");
    assert_eq!(w.instance("vm1").await["addresses_stale"], true);
}

/// The poller's rounds poll a due pool once, not again before its interval.
async fn rounds_poll_due_pools_once(h: Harness) {
    let w = world(h).await;
    w.fake.st().servers = vec![hetzner_server(5)];
    w.machines([5]).await;
    let task = tokio::spawn(Arc::clone(&w.poller).run());
    let deadline = Instant::now() + Duration::from_secs(5);
    while w.status().await["polls"] != 1 {
        assert!(Instant::now() < deadline, "no poll");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    task.abort();
    assert_eq!(w.status().await["polls"], 1, "not due again for 30 s");
    assert_eq!(w.fake.take_requests(), ["/v1/servers?page=1&per_page=50"]);
    assert_eq!(
        strs(&w.instance("vm5").await["addresses"]),
        hetzner_addresses(5)
    );
}

/// Bad provider bodies and machines are 400 naming the field; the secret is never asked for.
async fn bad_input_names_the_field(h: Harness) {
    let cases = [
        (
            json!({"provider": "aws", "credentials": {"env": "X"}}),
            "pool p: provider \"aws\" is not one of hetzner-cloud, proxmox-ve",
        ),
        (
            json!({"provider": "proxmox-ve", "credentials": {"env": "X"}}),
            "pool p: api_url is required for a proxmox-ve pool",
        ),
        (
            json!({"provider": "hetzner-cloud", "credentials": {"env": "1X"}}),
            "pool p: credentials.env \"1X\"",
        ),
        (
            json!({"provider": "hetzner-cloud", "credentials": {"token": "s3cret"}}),
            "pool: credentials",
        ),
        (
            json!({"provider": "hetzner-cloud", "credentials": {"env": "X"}, "poll_interval_secs": 0}),
            "pool p: poll_interval_secs 0 must be between 5 and 86400",
        ),
        (
            json!({"provider": "hetzner-cloud", "api_url": "https://u:pw@x.example/v1", "credentials": {"env": "X"}}),
            "pool p: api_url",
        ),
        // The agent's rules: its credentials directory only, https only.
        (
            json!({"provider": "hetzner-cloud", "credentials": {"file": "/var/lib/vmnet/wireguard.key"}}),
            "pool p: credentials.file \"/var/lib/vmnet/wireguard.key\" is not a file in the agent's credentials directory /etc/vmnet/credentials (vmnet serve --credentials-dir)",
        ),
        (
            json!({"provider": "hetzner-cloud", "credentials": {"file": "/etc/vmnet/credentials/../../shadow"}}),
            "pool p: credentials.file",
        ),
        (
            json!({"provider": "hetzner-cloud", "api_url": "http://203.0.113.9/v1", "credentials": {"env": "X"}}),
            "pool p: api_url \"http://203.0.113.9/v1\" must be https://",
        ),
    ];
    for (body, needle) in cases {
        let got = h
            .call(Method::PUT, "/v1/pools/p/provider", Some(body.clone()))
            .await;
        common::assert_error(&got, 400, "INVALID_INPUT", &[needle]);
    }
    let (st, _) = h
        .call(
            Method::PUT,
            "/v1/pools/hz/provider",
            Some(json!({"provider": "hetzner-cloud", "credentials": {"env": "HCLOUD_TOKEN"}})),
        )
        .await;
    assert!(st.is_success());
    let got = h
        .call(Method::POST, "/v1/instances", Some(json!({"instance_id": "vm1", "pool_id": "hz", "machine": {"node": "pve1", "vmid": 100}})))
        .await;
    common::assert_error(
        &got,
        400,
        "INVALID_INPUT",
        &["instance vm1: machine.node is not used by a hetzner-cloud pool"],
    );
    let got = h
        .call(
            Method::POST,
            "/v1/instances",
            Some(json!({"instance_id": "vm1", "pool_id": "hz"})),
        )
        .await;
    common::assert_error(
        &got,
        400,
        "INVALID_INPUT",
        &["instance vm1: machine is required"],
    );
    let (st, v) = h
        .call(
            Method::POST,
            "/v1/instances",
            Some(json!({"instance_id": "vm1", "pool_id": "hz", "machine": {"server_id": 42}})),
        )
        .await;
    assert_eq!(st.as_u16(), 201, "{v}");
    assert_eq!(v["addresses"], json!([]));
    let got = h
        .call(
            Method::POST,
            "/v1/instances",
            Some(json!({"instance_id": "vm2", "pool_id": "hz", "machine": {"server_id": 42}})),
        )
        .await;
    common::assert_error(
        &got,
        409,
        "CONFLICT",
        &["instance vm2: machine server 42 of pool hz is instance vm1"],
    );
    let got = h
        .call(
            Method::PUT,
            "/v1/pools/hz/range",
            Some(json!({"cidr": "10.9.0.0/24", "gateway": "10.9.0.1"})),
        )
        .await;
    common::assert_error(
        &got,
        409,
        "CONFLICT",
        &["pool hz is a provider pool (hetzner-cloud)"],
    );
}

both!(
    thousand_servers_paginated_and_replaced,
    failures_keep_the_last_good_addresses,
    rate_limits_honour_retry_after,
    rounds_poll_due_pools_once,
    bad_input_names_the_field,
);
