//! The root helper as a real process: started with its socket as descriptor 3, entered into a
//! sandbox namespace, driven by the pool firewall; a ruleset naming anything but bcd's three
//! tables is refused with a reason and changes nothing; the tables it makes are owned by it
//! (another process's flush leaves them, its delete is refused); killed, it is restarted by the
//! runtime's watchdog and the tables come back.

use std::process::Command;
use std::time::Duration;

use vmnet_agent::pool::helper::{HelperClient, Request};
use vmnet_kernel::pool::firewall::{FirewallError, NftExec, PoolFirewall};
use vmnet_model::nic::{InstanceSpec, MacAddr, NetworkPolicy, NicSpec};
use vmnet_plan::pool::nft::{Firewall, HostAddrs};

fn helper_in(ns: &str) -> HelperClient {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vmnet-pool-helper"));
    cmd.env("VMNET_HELPER_NETNS", ns);
    HelperClient::spawn(cmd).expect("spawn the helper")
}

fn list(ns: &str) -> String {
    let out = vmnet_testkit::netns::exec(ns, "nft", &["list", "tables"], Duration::from_secs(10))
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
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
        r#"{"nftables":[{"delete":{"table":{"family":"ip","name":"nat"}}}]}"#,
        "ip nat",
    );
    refuse(
        r#"{"nftables":[{"add":{"table":{"family":"inet","name":"bcd_taps"}}}]}"#,
        "verb \"add\" on a \"table\"",
    );
    refuse("include \"/etc/nftables.conf\"", "not JSON");
    refuse(
        r#"{"nftables":[{"delete":{"table":{"family":"inet","name":"bcd_taps"}}},{"add":{"table":{"family":"inet","name":"other"}}}]}"#,
        "command 1",
    );
    assert_eq!(list(&host), tables, "refused batches changed nothing");

    // The tables belong to the helper: another process's flush leaves them, its delete fails.
    let nft = |args: &[&str]| {
        vmnet_testkit::netns::exec(&host, "nft", args, Duration::from_secs(10)).unwrap()
    };
    assert!(nft(&["flush", "ruleset"]).status.success());
    assert_eq!(
        list(&host),
        tables,
        "an external flush leaves the owned tables"
    );
    let del = nft(&["delete", "table", "bridge", "bcd_instances"]);
    assert!(
        !del.status.success()
            && String::from_utf8_lossy(&del.stderr).contains("Operation not permitted"),
        "{del:?}"
    );
    assert!(fw.audit().unwrap().drift.is_empty());
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
async fn runtime_keeps_tables_through_a_flush_and_restarts_a_killed_helper() {
    vmnet_testkit::require_root();
    let sb = vmnet_testkit::Sandbox::new("pi").unwrap();
    let host = sb.host();
    let helper = helper_in(&host);
    let first_pid = helper.pid();
    let rt = vmnet_agent::pool::runtime::PoolRuntime::start(
        helper,
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
            nameservers: vec![],
        }],
    };
    rt.add_instance(&inst).unwrap();
    assert_eq!(rt.status().taps, 1);
    let tap = inst.tap_names().unwrap()[0].to_string();
    let full = |l: &str| {
        ["bridge bcd_instances", "inet bcd_taps", "arp bcd_taps"]
            .iter()
            .all(|t| l.contains(&format!("table {t}")))
    };

    // An external flush: the tables stay and no audit finds anything to repair.
    let out =
        vmnet_testkit::netns::exec(&host, "nft", &["flush", "ruleset"], Duration::from_secs(5))
            .unwrap();
    assert!(out.status.success());
    assert!(full(&list(&host)), "{}", list(&host));
    let audits = rt.audit_record().audits;
    let t = std::time::Instant::now();
    while rt.audit_record().audits < audits + 2 {
        assert!(t.elapsed() < Duration::from_secs(3), "no audit ran");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(rt.status().drift_repairs, 0, "{:?}", rt.status());

    // The helper is killed (our own child, by its pid): the kernel drops its tables; the
    // watchdog starts a new helper and re-applies everything, the tap's elements included.
    let pid = libc::pid_t::try_from(first_pid).unwrap();
    // SAFETY: kill(2) of a process this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let killed = std::time::Instant::now();
    let back = loop {
        let l = list(&host);
        if full(&l) && rt.audit_record().helper_restarts == 1 {
            break killed.elapsed();
        }
        assert!(
            killed.elapsed() < Duration::from_secs(5),
            "tables not restored after the helper was killed: {l}; {:?}",
            rt.audit_record()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let rec = rt.audit_record();
    eprintln!(
        "helper killed -> tables listed again by nft: {back:?} (watchdog: exit noticed -> \
         tables re-applied in {:?} ms)",
        rec.last_helper_restart_ms
    );
    let taps = vmnet_testkit::netns::exec(
        &host,
        "nft",
        &["list", "set", "bridge", "bcd_instances", "taps"],
        Duration::from_secs(5),
    )
    .unwrap();
    assert!(
        String::from_utf8_lossy(&taps.stdout).contains(&tap),
        "the tap's elements are back"
    );
    let fw = rt.firewall();
    assert!(fw.lock().unwrap().audit().unwrap().drift.is_empty());
    // The new helper owns the tables too.
    let del = vmnet_testkit::netns::exec(
        &host,
        "nft",
        &["delete", "table", "arp", "bcd_taps"],
        Duration::from_secs(5),
    )
    .unwrap();
    assert!(!del.status.success(), "{del:?}");
    rt.remove_instance("inst-r").unwrap();
    assert!(!list(&host).contains("bcd_taps"));
    drop(rt);
    drop(sb);
}
