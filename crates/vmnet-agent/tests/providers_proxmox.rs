//! Provider pools, Proxmox VE (spec: hosted-pool-networking.md, "Addresses on an instance",
//! provider pools), against a fake Proxmox VE API2 JSON on 127.0.0.1, through the agent's API
//! and its poller, on SQLite and PostgreSQL: the cluster resources listed once, the guest agent
//! asked only for running VMs that have it enabled, loopback and link-local dropped, no agent →
//! no addresses, a failing agent call keeping that machine's last good addresses, and 401.

mod common;
#[macro_use]
mod provider_fake;

use std::sync::Arc;
use std::time::Duration;

use axum::http::Method;
use common::Harness;
use provider_fake::Fake;
use serde_json::{Value, json};
use vmnet_agent::provider::fetch::Direct;
use vmnet_agent::provider::http::HttpSettings;
use vmnet_agent::provider::poller::{Poller, PollerSettings};
use vmnet_ipam::ProviderPool;
use vmnet_model::pool::ProviderRules;

const TOKEN: &str = "root@pam!vmnet=5e1c0d9a-0000-4000-8000-000000000001";

fn vm(vmid: u32, node: &str, status: &str) -> Value {
    json!({"id": format!("qemu/{vmid}"), "type": "qemu", "node": node, "vmid": vmid,
           "name": format!("vm{vmid}"), "status": status, "template": 0, "maxcpu": 2,
           "maxmem": 2_147_483_648u64, "uptime": 100})
}

fn interfaces(eth0: &[(&str, u8)]) -> Value {
    let addrs: Vec<Value> = eth0
        .iter()
        .map(|(a, p)| {
            json!({"ip-address": a, "prefix": p,
                   "ip-address-type": if a.contains(':') { "ipv6" } else { "ipv4" }})
        })
        .collect();
    json!([
        {"name": "lo", "hardware-address": "00:00:00:00:00:00",
         "ip-addresses": [{"ip-address": "127.0.0.1", "ip-address-type": "ipv4", "prefix": 8},
                          {"ip-address": "::1", "ip-address-type": "ipv6", "prefix": 128}],
         "statistics": {"rx-bytes": 0, "tx-bytes": 0}},
        {"name": "eth0", "hardware-address": "bc:24:11:00:00:01", "ip-addresses": addrs}
    ])
}

struct World {
    h: Harness,
    fake: Fake,
    poller: Arc<Poller>,
    _tmp: tempfile::TempDir,
}

async fn world(h: Harness) -> World {
    let fake = Fake::start(&format!("PVEAPIToken={TOKEN}")).await;
    let tmp = tempfile::tempdir().unwrap();
    let token = tmp.path().join("pve.token");
    // The agent reads credentials only from its credentials directory, and the fake speaks
    // plain HTTP on loopback.
    let rules = ProviderRules::new(tmp.path().to_str().unwrap(), true).unwrap();
    h.agent.set_provider_rules(rules.clone());
    std::fs::write(&token, TOKEN).unwrap();
    std::fs::set_permissions(&token, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let (st, v) = h
        .call(
            Method::PUT,
            "/v1/pools/pve/provider",
            Some(
                json!({"provider": "proxmox-ve", "api_url": format!("{}/api2/json", fake.url),
                        "credentials": {"file": token.display().to_string()},
                        "poll_interval_secs": 10}),
            ),
        )
        .await;
    assert!(st.is_success(), "{st} {v}");
    let settings = PollerSettings {
        http: HttpSettings {
            request_timeout: Duration::from_millis(500),
            ..HttpSettings::default()
        },
        tick: Duration::from_millis(50),
    };
    let direct = Arc::new(Direct::new(&settings.http).unwrap());
    let poller = Poller::new(h.agent.db().clone(), settings, direct, rules);
    h.agent.set_providers(Arc::clone(&poller)).unwrap();
    for (id, node, vmid) in [
        ("web", "pve1", 100),
        ("noagent", "pve1", 101),
        ("stopped", "pve2", 102),
        ("gone", "pve2", 103),
        ("moved", "pve1", 105),
    ] {
        let (st, v) = h
            .call(
                Method::POST,
                "/v1/instances",
                Some(json!({"instance_id": id, "pool_id": "pve",
                            "machine": {"node": node, "vmid": vmid}})),
            )
            .await;
        assert_eq!(st.as_u16(), 201, "{v}");
    }
    {
        let mut st = fake.st();
        st.resources = vec![
            vm(100, "pve1", "running"),
            vm(101, "pve1", "running"),
            vm(102, "pve2", "stopped"),
            json!({"id": "lxc/104", "type": "lxc", "node": "pve1", "vmid": 104, "status": "running"}),
            // Migrated to pve3 since the instance was made: the poller follows the list.
            vm(105, "pve3", "running"),
        ];
        st.configs.insert(
            100,
            json!({"agent": "enabled=1,fstrim_cloned_disks=1", "cores": 2, "ipconfig0": "ip=dhcp"}),
        );
        st.configs
            .insert(101, json!({"cores": 1, "ipconfig0": "ip=dhcp"}));
        st.configs.insert(105, json!({"agent": "1"}));
        st.agents.insert(
            100,
            interfaces(&[
                ("10.10.0.5", 24),
                ("2001:db8:10::5", 64),
                ("fe80::be24:11ff:fe00:1", 64),
                ("169.254.1.9", 16),
            ]),
        );
        st.agents.insert(105, interfaces(&[("10.10.0.9", 24)]));
    }
    World {
        h,
        fake,
        poller,
        _tmp: tmp,
    }
}

impl World {
    async fn poll(&self) -> Value {
        let (_, v) = self.h.call(Method::GET, "/v1/pools/pve", None).await;
        let pool: ProviderPool = serde_json::from_value(v["provider"].clone()).unwrap();
        serde_json::to_value(self.poller.poll_pool(&pool).await).unwrap()
    }

    async fn addresses(&self, id: &str) -> (Vec<String>, bool) {
        let (_, v) = self
            .h
            .call(Method::GET, &format!("/v1/instances/{id}"), None)
            .await;
        let list = v["addresses"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_owned())
            .collect();
        (list, v["addresses_stale"].as_bool().unwrap())
    }
}

/// One listing, then config (and agent only where enabled) for running VMs; loopback and
/// link-local dropped; no agent, stopped and missing VMs have none.
async fn guest_agent_addresses_of_running_vms(h: Harness) {
    let w = world(h).await;
    let st = w.poll().await;
    assert_eq!(st["state"], "ok", "{st}");
    assert_eq!(st["machines"], 5);
    assert_eq!(st["missing"], json!(["gone"]));
    let mut requests = w.fake.take_requests();
    assert_eq!(requests[0], "/api2/json/cluster/resources?type=vm");
    requests[1..].sort();
    assert_eq!(
        requests[1..],
        [
            "/api2/json/nodes/pve1/qemu/100/agent/network-get-interfaces",
            "/api2/json/nodes/pve1/qemu/100/config",
            "/api2/json/nodes/pve1/qemu/101/config",
            "/api2/json/nodes/pve3/qemu/105/agent/network-get-interfaces",
            "/api2/json/nodes/pve3/qemu/105/config",
        ],
        "no agent call without the agent, nothing for stopped or missing VMs"
    );
    assert_eq!(st["last_requests"], 6);
    assert_eq!(
        w.addresses("web").await,
        (
            vec!["10.10.0.5/24".into(), "2001:db8:10::5/64".into()],
            false
        )
    );
    assert_eq!(w.addresses("noagent").await, (vec![], false));
    assert_eq!(w.addresses("stopped").await, (vec![], false));
    assert_eq!(w.addresses("gone").await, (vec![], false));
    assert_eq!(
        w.addresses("moved").await,
        (vec!["10.10.0.9/24".into()], false)
    );

    // The guest renumbers: the next poll replaces the list.
    w.fake
        .st()
        .agents
        .insert(100, interfaces(&[("10.10.0.77", 24)]));
    w.poll().await;
    assert_eq!(
        w.addresses("web").await,
        (vec!["10.10.0.77/24".into()], false)
    );
    // The VM stops: it reports nothing any more.
    w.fake.st().resources[0]["status"] = json!("stopped");
    w.poll().await;
    assert_eq!(w.addresses("web").await, (vec![], false));
}

/// A failing guest agent call (500 while the agent is not up) keeps that machine's last good
/// addresses, stale, and the pool shows `degraded`; 401 on the listing is `auth_failed` and
/// keeps every machine's addresses.
async fn failures_keep_the_last_good_addresses(h: Harness) {
    let w = world(h).await;
    assert_eq!(w.poll().await["state"], "ok");
    w.fake.st().fail_suffix = Some(("/qemu/100/agent/network-get-interfaces".into(), 500));
    let st = w.poll().await;
    assert_eq!(st["state"], "degraded", "{st}");
    assert_eq!(st["last_error_kind"], "status");
    assert!(
        st["last_error"]
            .as_str()
            .unwrap()
            .starts_with("1 of 5 machines failed; instance web: GET "),
        "{st}"
    );
    assert_eq!(
        w.addresses("web").await,
        (
            vec!["10.10.0.5/24".into(), "2001:db8:10::5/64".into()],
            true
        )
    );
    assert_eq!(
        w.addresses("moved").await,
        (vec!["10.10.0.9/24".into()], false)
    );
    w.fake.st().fail_suffix = None;
    assert_eq!(w.poll().await["state"], "ok");
    assert!(!w.addresses("web").await.1);

    w.fake.st().authorization = "PVEAPIToken=root@pam!other=x".into();
    let st = w.poll().await;
    assert_eq!(st["state"], "auth_failed", "{st}");
    let (_, status) = w.h.call(Method::GET, "/v1/status", None).await;
    assert_eq!(status["provider_pools"][0]["state"], "auth_failed");
    assert!(
        !status.to_string().contains("5e1c0d9a"),
        "the secret never shows"
    );
    assert_eq!(
        w.addresses("web").await,
        (
            vec!["10.10.0.5/24".into(), "2001:db8:10::5/64".into()],
            true
        )
    );
    assert_eq!(
        w.addresses("moved").await,
        (vec!["10.10.0.9/24".into()], true)
    );
}

both!(
    guest_agent_addresses_of_running_vms,
    failures_keep_the_last_good_addresses,
);
