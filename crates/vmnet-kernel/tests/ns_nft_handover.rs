//! The table records one agent hands to the next (root required): a driver saves the records
//! of the tables it found as planned, and a new driver (a restarted agent) takes them instead
//! of listing those tables again. These tests edit a table while no driver runs and check the
//! next one still finds and replaces the edit; that a record naming another namespace (its
//! cookie) is not used even at the right generation; that a table nobody touched is taken
//! without a commit; and that a record taken but not used before a stop is handed on.

mod ns_support;

use ns_support::Env;
use serde_json::{Value, json};
use vmnet_kernel::netns;
use vmnet_kernel::nftgen::GenSocket;
use vmnet_kernel::ns::{Change, NetlinkNsDriver, NsDriver};
use vmnet_plan::ns::VmPlan;
use vmnet_testkit::nft::{last_rule_handle, nft};

fn fw_vm(env: &Env, uid: u32) -> VmPlan {
    let v = json!({"id": format!("h{uid:x}"), "user_id": uid, "tenant": 1,
        "mesh_ipv6": format!("fdaa:3::{uid:x}"),
        "network": {"routes": [{"destination": "0.0.0.0/0", "via": "host"}]},
        "firewall": {"enabled": true,
            "inbound": [{"protocol": "tcp", "ports": "22", "prefixes": ["2001:db8::/32"]},
                        {"protocol": "any", "prefixes": ["198.51.100.0/24"]}],
            "outbound": [{"protocol": "any", "prefixes": ["0.0.0.0/0", "::/0"]}]}});
    env.plan(&v.to_string())
}

/// A new driver on the env's sandbox: what a restarted agent starts with.
fn driver(env: &Env) -> NetlinkNsDriver {
    NetlinkNsDriver::new(env.settings.clone(), Some(env.sb.host())).expect("driver")
}

/// The nf_tables generation of `ns` now.
fn generation(ns: &str) -> u32 {
    netns::run_in(ns, || GenSocket::open_here().unwrap().read().unwrap()).unwrap()
}

/// Deletes the last rule of chain `fw_in` of the VM's table, by hand.
fn delete_a_rule(plan: &VmPlan, table: &str) {
    let h = last_rule_handle(&plan.netns, table, "fw_in")
        .unwrap()
        .to_string();
    nft(
        &plan.netns,
        &["delete", "rule", "inet", table, "fw_in", "handle", &h],
    )
    .unwrap();
}

fn replaced(changes: &[Change]) -> bool {
    changes
        .iter()
        .any(|c| matches!(c, Change::ReplaceNft { .. }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn a_table_edited_between_two_agents_is_found_and_a_record_of_another_netns_is_not_used() {
    let env = Env::new();
    let plan = fw_vm(&env, 0x71);
    let table = env.settings.name_prefix.clone();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tables.json");

    // The first agent: applies, checks (the listing records the table), stops and saves.
    let first = driver(&env);
    first.apply(&plan).await.unwrap();
    assert!(first.apply(&plan).await.unwrap().is_empty());
    assert_eq!(first.save_table_records(&file).unwrap(), 1);
    drop(first);

    // While no agent runs: a rule deleted. The next agent takes the record, but the
    // generation moved: it lists the table and puts the rule back.
    delete_a_rule(&plan, &table);
    let second = driver(&env);
    assert_eq!(second.restore_table_records(&file).unwrap(), 1);
    assert!(!file.exists(), "the file is taken once");
    let changes = second.apply(&plan).await.unwrap();
    assert!(replaced(&changes), "the edit is repaired: {changes:?}");
    assert!(second.apply(&plan).await.unwrap().is_empty());
    assert_eq!(second.save_table_records(&file).unwrap(), 1);
    drop(second);

    // A record of another namespace (its cookie) at the generation this one is at after an
    // edit: not used, the table is listed and repaired.
    delete_a_rule(&plan, &table);
    let mut saved: Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    let rec = &mut saved["tables"][0];
    let cookie = rec["cookie"].as_u64().unwrap();
    rec["cookie"] = json!(cookie + 1);
    rec["generation"] = json!(generation(&plan.netns));
    std::fs::write(&file, serde_json::to_vec(&saved).unwrap()).unwrap();
    let third = driver(&env);
    assert_eq!(third.restore_table_records(&file).unwrap(), 1);
    let changes = third.apply(&plan).await.unwrap();
    assert!(
        replaced(&changes),
        "a record of another netns is not used: {changes:?}"
    );

    // Untouched between two agents: taken, nothing committed, nothing changed.
    assert!(third.apply(&plan).await.unwrap().is_empty());
    assert_eq!(third.save_table_records(&file).unwrap(), 1);
    drop(third);
    let at = generation(&plan.netns);
    let fourth = driver(&env);
    assert_eq!(fourth.restore_table_records(&file).unwrap(), 1);
    assert!(fourth.apply(&plan).await.unwrap().is_empty());
    assert_eq!(generation(&plan.netns), at, "no commit");

    // Taken and stopped before any check used it: saved again, and good for the next agent.
    assert_eq!(fourth.save_table_records(&file).unwrap(), 1);
    drop(fourth);
    let fifth = driver(&env);
    assert_eq!(fifth.restore_table_records(&file).unwrap(), 1);
    assert_eq!(fifth.save_table_records(&file).unwrap(), 1);
    drop(fifth);
    let sixth = driver(&env);
    assert_eq!(sixth.restore_table_records(&file).unwrap(), 1);
    assert!(sixth.apply(&plan).await.unwrap().is_empty());
    assert_eq!(generation(&plan.netns), at, "no commit");
    sixth.remove(plan.user_id).await.unwrap();
}
