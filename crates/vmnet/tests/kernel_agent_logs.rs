//! The agent's configuration file and JSON log, end to end (root required: the agent runs in a
//! sandbox host namespace): `vmnet serve --config FILE` with `log-format = "json"` in the file
//! logs one JSON object per line (its worker too), and a VM's create, change and delete each
//! carry the VM id and the operation as fields.

mod agent_support;

use agent_support::{options, start, vm};
use serde_json::Value;
use vmnet_agent::api::types::VmView;
use vmnet_testkit::{Sandbox, require_root};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn a_json_log_from_the_config_file_names_the_vm_and_the_operation() {
    require_root();
    let sb = Sandbox::new("lj").expect("sandbox");
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("vmnet.toml");
    std::fs::write(&config, "log-format = \"json\"\n").unwrap();
    let mut agent = start(
        &options(&sb, tmp.path(), 60).args(["--config".to_owned(), config.display().to_string()]),
    )
    .await;
    let client = agent.client();
    let mut body = vm("lj", 1);
    let _: VmView = client.put("/v1/vms/lj1", &body).await.expect("create");
    body["private_network_throughput_mibps"] = 50.into();
    let _: VmView = client.put("/v1/vms/lj1", &body).await.expect("change");
    let _: VmView = client.delete("/v1/vms/lj1").await.expect("delete");
    let status = tokio::task::spawn_blocking(move || {
        let s = agent.sigterm().expect("SIGTERM");
        (s, agent)
    })
    .await
    .unwrap();
    let (status, agent) = status;
    let log = agent.log_text();
    assert!(status.success(), "{status:?}\n{log}");
    let lines: Vec<Value> = log
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}\n{log}")))
        .collect();
    for l in &lines {
        for field in ["timestamp", "level", "target", "message"] {
            assert!(l.get(field).is_some(), "no {field}: {l}");
        }
    }
    let ops: Vec<(&str, &str, &str)> = lines
        .iter()
        .filter(|l| l["vm"] == "lj1")
        .filter_map(|l| {
            Some((
                l["message"].as_str()?,
                l["op"].as_str()?,
                l["level"].as_str()?,
            ))
        })
        .collect();
    assert_eq!(
        ops,
        [
            ("vm applied", "create", "INFO"),
            ("vm applied", "change", "INFO"),
            ("vm deleted", "delete", "INFO"),
        ],
        "{log}"
    );
    assert!(
        lines.iter().any(|l| l["message"] == "vmnet agent stopped"),
        "{log}"
    );
}
