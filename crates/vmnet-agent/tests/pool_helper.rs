//! The root helper as a real process: started with its socket as descriptor 3, entered into a
//! sandbox namespace, driven by the pool firewall; a ruleset naming anything but bcd's three
//! tables is refused with a reason and changes nothing.

use std::process::Command;
use std::time::Duration;

use vmnet_agent::pool::helper::{HelperClient, Request};
use vmnet_kernel::pool::firewall::{FirewallError, NftExec, PoolFirewall};
use vmnet_model::nic::{InstanceSpec, MacAddr, NetworkPolicy, NicSpec};
use vmnet_plan::pool::nft::{Firewall, HostAddrs};

fn helper_in(ns: &str) -> HelperClient {
    let ns = ns.to_owned();
    HelperClient::spawn(move || {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_vmnet-pool-helper"));
        cmd.env("VMNET_HELPER_NETNS", &ns);
        cmd
    })
    .expect("spawn the helper")
}

fn list(ns: &str) -> String {
    let out = vmnet_testkit::netns::exec(ns, "nft", &["list", "tables"], Duration::from_secs(10))
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
fn helper_applies_bcd_tables_and_refuses_anything_else() {
    vmnet_testkit::require_root();
    let sb = vmnet_testkit::Sandbox::new("ph").unwrap();
    let host = sb.host();
    let helper = helper_in(&host);
    assert_ne!(helper.pid(), std::process::id());
    let mut fw = PoolFirewall::new(helper);
    let inst = InstanceSpec {
        id: "inst-h".into(),
        allocation_id: "alloc-h".into(),
        policy: NetworkPolicy::Public,
        sandbox: false,
        nics: vec![NicSpec {
            network: Some("br0".parse().unwrap()),
            mac: MacAddr::for_instance("inst-h"),
            addresses: vec!["10.0.0.2/29".parse().unwrap()],
            gateway: Some("10.0.0.1".parse().unwrap()),
            gateway6: None,
            nameservers: vec![],
        }],
    };
    fw.replace(Firewall {
        taps: vec![],
        host: HostAddrs::default(),
    })
    .unwrap();
    fw.add_instance(&inst).unwrap();
    let tables = list(&host);
    assert!(tables.contains("table bridge bcd_instances"), "{tables}");
    assert!(
        tables.contains("table inet bcd_taps") && tables.contains("table arp bcd_taps"),
        "{tables}"
    );
    assert!(fw.audit().unwrap().drift.is_empty());

    // Refusals carry the reason and leave the tables alone.
    let refuse = |text: &str, want: &str| match fw.exec().apply(text) {
        Err(FirewallError::Helper(m)) => assert!(m.contains(want), "{text}: {m}"),
        other => panic!("{text}: expected a refusal, got {other:?}"),
    };
    refuse(
        r#"{"nftables":[{"flush":{"ruleset":null}}]}"#,
        "verb \"flush\"",
    );
    refuse(
        r#"{"nftables":[{"add":{"table":{"family":"ip","name":"nat"}}}]}"#,
        "ip nat",
    );
    refuse("include \"/etc/nftables.conf\"", "not JSON");
    refuse(
        r#"{"nftables":[{"delete":{"table":{"family":"inet","name":"bcd_taps"}}},{"add":{"table":{"family":"inet","name":"other"}}}]}"#,
        "command 1",
    );
    assert_eq!(list(&host), tables, "refused batches changed nothing");
    let bad = fw.exec().call(&Request::Apply {
        ruleset: "{}".into(),
    });
    assert!(bad.is_err());

    fw.remove_instance("inst-h").unwrap();
    let after = list(&host);
    assert!(!after.contains("bcd_taps"), "{after}");
    drop(fw);
    drop(sb);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn runtime_audit_repairs_a_flush_through_the_helper() {
    vmnet_testkit::require_root();
    let sb = vmnet_testkit::Sandbox::new("pi").unwrap();
    let host = sb.host();
    let rt = vmnet_agent::pool::runtime::PoolRuntime::start(
        helper_in(&host),
        HostAddrs::default(),
        Duration::from_millis(500),
    )
    .unwrap();
    let inst = InstanceSpec {
        id: "inst-r".into(),
        allocation_id: "alloc-r".into(),
        policy: NetworkPolicy::None,
        sandbox: false,
        nics: vec![NicSpec {
            network: Some("br0".parse().unwrap()),
            mac: MacAddr::for_instance("inst-r"),
            addresses: vec![],
            gateway: None,
            gateway6: None,
            nameservers: vec![],
        }],
    };
    rt.add_instance(&inst).unwrap();
    assert_eq!(rt.status().taps, 1);
    let out =
        vmnet_testkit::netns::exec(&host, "nft", &["flush", "ruleset"], Duration::from_secs(5))
            .unwrap();
    assert!(out.status.success());
    let t = std::time::Instant::now();
    while rt.status().drift_repairs == 0 {
        assert!(t.elapsed() < Duration::from_secs(3), "not repaired");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(list(&host).contains("table arp bcd_taps"));
    assert!(rt.status().last_drift.iter().any(|d| d.contains("missing")));
    rt.remove_instance("inst-r").unwrap();
    assert!(!list(&host).contains("bcd_taps"));
    drop(rt);
    drop(sb);
}
