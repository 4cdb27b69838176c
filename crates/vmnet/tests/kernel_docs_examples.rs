//! Every JSON example of the book that is something a user sends, sent to a real agent
//! (`vmnet serve` in a sandbox host): each ```json,vm config is accepted by `PUT /v1/vms/{id}`
//! and applied, each ```json,vm-refused is refused with 400 INVALID_INPUT and leaves nothing
//! stored, and each ```json,host-spec is applied by `vmnet apply FILE`.
#![allow(missing_docs)]

use serde_json::Value;
use vmnet_agent::api::types::{VmState, VmView};
use vmnet_testkit::{Sandbox, require_root};

mod agent_support;
use agent_support::{options, run_cli, start};
mod docs_support;
use docs_support::json_blocks;

fn id_of(v: &Value, what: &str) -> String {
    v["id"]
        .as_str()
        .unwrap_or_else(|| panic!("{what}: no id"))
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn the_books_json_examples_are_what_the_agent_takes() {
    require_root();
    let vms = json_blocks("vm");
    let refused = json_blocks("vm-refused");
    let specs = json_blocks("host-spec");
    assert!(
        !vms.is_empty() && !refused.is_empty() && !specs.is_empty(),
        "the book has examples of every kind"
    );
    let sb = Sandbox::new("dx").expect("sandbox");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_owned();
    let agent = start(&options(&sb, &dir, 10)).await;
    let client = agent.client().clone();

    for b in &vms {
        let what = format!("{} ```{}", b.page, b.info);
        let body: Value = serde_json::from_str(&b.text).unwrap();
        let id = id_of(&body, &what);
        let v: VmView = client
            .put(&format!("/v1/vms/{id}"), &body)
            .await
            .unwrap_or_else(|e| panic!("{what}: refused: {e}\n{}", agent.log_text()));
        assert_eq!(v.status.state, VmState::Applied, "{what}: {v:?}");
        let _: VmView = client
            .delete(&format!("/v1/vms/{id}"))
            .await
            .unwrap_or_else(|e| panic!("{what}: delete: {e}"));
    }

    for b in &refused {
        let what = format!("{} ```{}", b.page, b.info);
        let body: Value = serde_json::from_str(&b.text).unwrap();
        let id = id_of(&body, &what);
        let e = client
            .put::<VmView>(&format!("/v1/vms/{id}"), &body)
            .await
            .expect_err(&format!("{what}: accepted"));
        assert_eq!(e.code, vmnet_model::ErrorCode::InvalidInput, "{what}: {e}");
        assert!(e.message.contains(&id), "{what}: names the VM: {e}");
        let gone = client.get::<VmView>(&format!("/v1/vms/{id}")).await;
        assert!(gone.is_err(), "{what}: nothing stored");
    }

    for (i, b) in specs.iter().enumerate() {
        let what = format!("{} ```{}", b.page, b.info);
        let file = dir.join(format!("spec{i}.json"));
        std::fs::write(&file, &b.text).unwrap();
        let (ok, out, err) = run_cli(&dir, &["apply", file.to_str().unwrap()]);
        assert!(ok, "{what}: vmnet apply: {err}\n{out}");
        let spec: Value = serde_json::from_str(&b.text).unwrap();
        for vm in spec["vms"].as_array().into_iter().flatten() {
            let id = id_of(vm, &what);
            let v: VmView = client
                .get(&format!("/v1/vms/{id}"))
                .await
                .unwrap_or_else(|e| panic!("{what}: vm {id}: {e}"));
            assert_eq!(v.status.state, VmState::Applied, "{what}: {v:?}");
        }
    }
}
