//! The reconcile pass as the namespace-mode drift audit, on a real kernel (root required): an
//! agent whose driver manages a sandbox host repairs each kind of hand edit of the tables it
//! owns (a VM's netns table, the host table) within one full pass and counts it in
//! `drift_repairs_total`; passes over an unchanged ruleset re-apply nothing.

mod common;

use std::sync::Arc;

use axum::http::Method;
use common::Harness;
use serde_json::json;
use vmnet_kernel::ns::{NetlinkNsDriver, NsDriver};
use vmnet_plan::ns::{NsSettings, plan_vm};
use vmnet_testkit::Sandbox;
use vmnet_testkit::nft::{Edit, Target};

async fn repairs_total(h: &Harness) -> u64 {
    let (_, st) = h.call(Method::GET, "/v1/status", None).await;
    st["reconcile"]["drift_repairs_total"].as_u64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn each_hand_edit_of_an_owned_table_is_repaired_in_one_pass_and_counted() {
    vmnet_testkit::require_root();
    let sb = Sandbox::new("au").unwrap();
    let settings = NsSettings {
        name_prefix: sb.agent_prefix(),
        ..NsSettings::default()
    };
    let driver: Arc<dyn NsDriver> =
        Arc::new(NetlinkNsDriver::new(settings.clone(), Some(sb.host())).unwrap());
    let tmp = tempfile::tempdir().unwrap();
    let h = Harness::open_with(tmp.path(), Arc::clone(&driver), settings.clone()).await;
    // A fresh agent's first pass sets the host-wide state up: that is not a repair.
    let out = h.agent.reconcile().await.unwrap();
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    assert_eq!(out.repaired, Vec::<String>::new(), "the set-up is no drift");
    assert_eq!(repairs_total(&h).await, 0);
    let vm = json!({"id": "web", "user_id": 0x35, "tenant": 1, "mesh_ipv6": "fdaa:3::35",
        "network": {"routes": [{"destination": "0.0.0.0/0", "via": "host"}]}});
    let (status, _) = h.put_vm(&vm).await;
    assert!(status.is_success(), "{status}");
    let plan = plan_vm(
        &vmnet_model::vm::parse_vm_config(vm.to_string().as_bytes()).unwrap(),
        &settings,
    )
    .unwrap();

    let out = h.agent.reconcile().await.unwrap();
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    assert_eq!(out.repaired, Vec::<String>::new(), "a fresh VM is in sync");
    assert_eq!(repairs_total(&h).await, 0);

    let peer = &plan.veth.as_ref().unwrap().peer_name;
    let targets = [
        (
            "vm web",
            Target {
                netns: plan.netns.clone(),
                family: "inet".into(),
                table: settings.name_prefix.clone(),
                chain: "postrouting".into(),
                changed_rule: format!(
                    "oifname {peer} ip saddr 172.16.0.0/30 snat ip to 10.200.0.99"
                ),
                policy_chain: "mss".into(),
            },
        ),
        (
            "host",
            Target {
                netns: sb.host(),
                family: "ip".into(),
                table: format!("{}_host", settings.name_prefix),
                chain: "postrouting".into(),
                changed_rule: "ip saddr 10.200.0.0/14 masquerade".into(),
                policy_chain: "postrouting".into(),
            },
        ),
    ];
    let mut total = 0;
    for (owner, target) in &targets {
        for edit in Edit::ALL {
            target.apply(edit).unwrap();
            assert!(
                !driver.drift(&plan).await.unwrap().is_empty(),
                "{owner} {edit:?} is drift"
            );
            let out = h.agent.reconcile().await.unwrap();
            assert!(out.errors.is_empty(), "{owner} {edit:?}: {:?}", out.errors);
            assert_eq!(
                out.repaired.len(),
                1,
                "{owner} {edit:?}: {:?}",
                out.repaired
            );
            assert!(
                out.repaired[0].starts_with(owner),
                "{owner} {edit:?}: {:?}",
                out.repaired
            );
            total += 1;
            assert_eq!(repairs_total(&h).await, total, "{owner} {edit:?} counted");
            assert!(
                driver.drift(&plan).await.unwrap().is_empty(),
                "{owner} {edit:?} repaired within the pass"
            );
        }
    }
    // An unchanged ruleset is never re-applied.
    for _ in 0..3 {
        let out = h.agent.reconcile().await.unwrap();
        assert!(out.errors.is_empty() && out.repaired.is_empty(), "{out:?}");
    }
    assert_eq!(repairs_total(&h).await, total);
    let (_, st) = h.call(Method::GET, "/v1/status", None).await;
    assert_eq!(st["reconcile"]["last_ok"], true);
    drop(h);
    drop(sb);
}
