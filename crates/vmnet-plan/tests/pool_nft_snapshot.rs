//! Snapshot of the rendered nft JSON: the full replace of the three tables for two instances
//! (one `private` sandbox, one `none`), and one instance's add delta. Set `UPDATE_SNAPSHOTS=1`
//! to rewrite the files after a deliberate change, then review the diff.

use std::path::PathBuf;

use vmnet_model::nic::{InstanceSpec, MacAddr, NetworkPolicy, NicSpec, NodeSpec};
use vmnet_plan::pool::nft::{Change, HostAddrs, plan, render_full, render_instance, tap_entries};

fn instance(id: &str, ip: &str, policy: NetworkPolicy, sandbox: bool) -> InstanceSpec {
    InstanceSpec {
        id: id.into(),
        allocation_id: format!("alloc-{id}"),
        policy,
        sandbox,
        nics: vec![NicSpec {
            network: Some("br0".parse().unwrap()),
            mac: MacAddr::for_instance(id),
            addresses: vec![format!("{ip}/29").parse().unwrap()],
            gateway: Some("10.0.0.1".parse().unwrap()),
            gateway6: None,
            nameservers: vec!["10.0.0.1".parse().unwrap()],
        }],
    }
}

fn check(name: &str, value: &serde_json::Value) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/pool_snapshots")
        .join(name);
    let text = serde_json::to_string_pretty(value).unwrap() + "\n";
    if std::env::var_os("UPDATE_SNAPSHOTS").is_some() {
        std::fs::write(&path, &text).unwrap();
    }
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run with UPDATE_SNAPSHOTS=1)", path.display()));
    assert!(
        want == text,
        "{name} differs from the snapshot; run with UPDATE_SNAPSHOTS=1 and review"
    );
}

#[test]
fn full_replace_snapshot() {
    let node = NodeSpec {
        instances: vec![
            instance("inst-a", "10.0.0.2", NetworkPolicy::Private, true),
            instance("inst-b", "10.0.0.3", NetworkPolicy::None, false),
        ],
    };
    let host = HostAddrs {
        own: vec![
            "10.0.0.1".parse().unwrap(),
            "192.0.2.10".parse().unwrap(),
            "fe80::1".parse().unwrap(),
        ],
        gateways: vec!["10.0.0.1".parse().unwrap()],
    };
    check("full.json", &render_full(&plan(&node, &host).unwrap()));
}

#[test]
fn instance_add_snapshot() {
    let e = tap_entries(&instance(
        "inst-c",
        "10.0.0.4",
        NetworkPolicy::Public,
        false,
    ))
    .unwrap();
    check("add_instance.json", &render_instance(&e, Change::Add));
}

/// `full.listed.json` is what nft 1.0.6 listed (`nft -j list ruleset`) after applying
/// `full.json` in an empty namespace: implied `ether type` matches left out, anonymous sets
/// sorted, handles added. Read by content, it is the plan. Regenerate it with the snapshot:
/// `nft -j -f full.json` in a throwaway namespace, then `nft -j list ruleset`.
#[test]
fn the_listing_of_the_full_replace_reads_as_the_plan() {
    use vmnet_plan::nftdiff::{Tables, diff};
    use vmnet_plan::pool::nft::OWNED_TABLES;
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/pool_snapshots");
    let read = |name: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(dir.join(name)).unwrap()).unwrap()
    };
    let planned = Tables::read(&read("full.json"), &OWNED_TABLES);
    let listed = Tables::read(&read("full.listed.json"), &OWNED_TABLES);
    assert_eq!(planned.tables.len(), 3);
    assert_eq!(diff(&planned, &listed), []);
    assert_eq!(
        listed.rule_counts().values().sum::<usize>(),
        planned.rule_counts().values().sum::<usize>()
    );
}
