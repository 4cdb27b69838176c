//! The firewall audit on a real kernel (root required): an agent with a 1 s audit period and an
//! hour between reconcile passes replaces each hand edit of a VM's filter table (an accept-all
//! rule added, a rule deleted, a chain policy flipped) within the period, counts it on the VM
//! and in the status, and never rewrites an untouched table.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::Method;
use common::Harness;
use serde_json::{Value, json};
use vmnet_kernel::ns::{NetlinkNsDriver, NsDriver};
use vmnet_plan::ns::{NsSettings, plan_vm};
use vmnet_testkit::Sandbox;
use vmnet_testkit::nft::{last_rule_handle, nft};

/// The handle of table `inet <table>` in `ns`: a replacement (delete, add) gives it a new one.
fn table_handle(ns: &str, table: &str) -> u64 {
    let out = nft(ns, &["-j", "list", "table", "inet", table]).unwrap();
    let v: Value = serde_json::from_str(&out).unwrap();
    v["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|i| i["table"]["handle"].as_u64())
        .unwrap()
}

async fn vm_repairs(h: &Harness) -> u64 {
    let (_, v) = h.call(Method::GET, "/v1/vms/fw", None).await;
    v["status"]["firewall_repairs"].as_u64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn each_hand_edit_of_the_filter_is_replaced_within_the_audit_period() {
    vmnet_testkit::require_root();
    let sb = Sandbox::new("fa").unwrap();
    let settings = NsSettings {
        name_prefix: sb.agent_prefix(),
        ..NsSettings::default()
    };
    let driver: Arc<dyn NsDriver> =
        Arc::new(NetlinkNsDriver::new(settings.clone(), Some(sb.host())).unwrap());
    let tmp = tempfile::tempdir().unwrap();
    let h = Harness::open_with(tmp.path(), Arc::clone(&driver), settings.clone()).await;
    h.agent.set_firewall_audit_period(Duration::from_secs(1));
    let vm = json!({"id": "fw", "user_id": 0x52, "tenant": 1, "mesh_ipv6": "fdaa:3::52",
        "network": {"routes": [{"destination": "0.0.0.0/0", "via": "host"}]},
        "firewall": {"enabled": true,
            "inbound": [{"protocol": "tcp", "ports": "22", "prefixes": ["198.51.100.0/24"]}]}});
    let (status, v) = h.put_vm(&vm).await;
    assert!(status.is_success(), "{status} {v}");
    assert_eq!(v["status"]["firewall_filtering"], true);
    let plan = plan_vm(
        &vmnet_model::vm::parse_vm_config(vm.to_string().as_bytes()).unwrap(),
        &settings,
    )
    .unwrap();
    let loop_task = tokio::spawn(Arc::clone(&h.agent).run_loop());
    let ns = plan.netns.clone();
    let table = settings.name_prefix.clone();

    // Untouched: audited every second, never rewritten.
    let handle = table_handle(&ns, &table);
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let (_, st) = h.call(Method::GET, "/v1/status", None).await;
    assert!(st["firewall"]["audits"].as_u64().unwrap() >= 2, "{st}");
    assert_eq!(st["firewall"]["audit_period_secs"], 1);
    assert_eq!(st["firewall"]["last_audit_tables"], 1);
    assert_eq!(st["firewall"]["repairs_total"], 0);
    assert_eq!(
        table_handle(&ns, &table),
        handle,
        "an untouched table is not rewritten"
    );

    let edits = ["accept-all rule added", "rule deleted", "policy flipped"];
    for (i, what) in edits.iter().enumerate() {
        // Read now: the previous repair replaced the table, and its handles with it.
        let del = last_rule_handle(&ns, &table, "fw_in").unwrap().to_string();
        let args: Vec<&str> = match i {
            0 => vec!["insert", "rule", "inet", &table, "filter", "accept"],
            1 => vec!["delete", "rule", "inet", &table, "fw_in", "handle", &del],
            _ => vec![
                "add",
                "chain",
                "inet",
                &table,
                "filter",
                "{ type filter hook forward priority 0; policy drop; }",
            ],
        };
        nft(&ns, &args).unwrap();
        assert!(
            !driver.drift(&plan).await.unwrap().is_empty(),
            "{what} is drift"
        );
        let t0 = Instant::now();
        while vm_repairs(&h).await < i as u64 + 1 {
            assert!(
                t0.elapsed() < Duration::from_millis(2500),
                "{what}: not replaced in time"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(
            driver.drift(&plan).await.unwrap().is_empty(),
            "{what}: replaced by the plan"
        );
    }
    let (_, st) = h.call(Method::GET, "/v1/status", None).await;
    assert_eq!(st["firewall"]["repairs_total"], 3, "{st}");
    assert_eq!(st["firewall"]["last_repairs"].as_array().unwrap().len(), 3);
    assert!(
        st["firewall"]["last_repairs"][0]
            .as_str()
            .unwrap()
            .starts_with("vm fw: ")
    );
    // The reconcile pass counted none of them: the audit got there first.
    assert_eq!(st["reconcile"]["drift_repairs_total"], 0);
    // Quiet again: nothing more is rewritten.
    let handle = table_handle(&ns, &table);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(table_handle(&ns, &table), handle);
    assert_eq!(vm_repairs(&h).await, 3);
    h.agent.stop_loop(loop_task).await;
    drop(h);
    drop(sb);
}
