//! Unit tests of the IPAM commands' parsing and tables.

use super::tables::{instances_table, report_table};
use super::{Deleted, HostCmd, parse_report};
use clap::Parser;
use vmnet_ipam::{
    Instance, InstanceState, SkipReason, SkippedInstance, StatusReportOutcome, UpdatedInstance,
};

#[derive(Debug, Parser)]
struct HostCli {
    #[command(subcommand)]
    cmd: HostCmd,
}

fn parse_host(args: &[&str]) -> Result<HostCmd, clap::Error> {
    HostCli::try_parse_from(std::iter::once("host").chain(args.iter().copied())).map(|c| c.cmd)
}

#[test]
fn host_report_takes_an_instance_with_addresses_or_a_file() {
    let c = parse_host(&[
        "report",
        "h1",
        "--instance",
        "vm1",
        "--address",
        "10.0.0.2/29",
        "--address",
        "2001:db8::5/64",
    ])
    .unwrap();
    let HostCmd::Report {
        host,
        instance,
        addresses,
        file,
    } = c
    else {
        panic!("{c:?}")
    };
    assert_eq!(host, "h1");
    assert_eq!(instance.as_deref(), Some("vm1"));
    assert_eq!(addresses, ["10.0.0.2/29", "2001:db8::5/64"]);
    assert!(file.is_none());
    let c = parse_host(&["report", "h1", "--file", "-"]).unwrap();
    assert!(matches!(c, HostCmd::Report { file: Some(f), .. } if f.as_os_str() == "-"));
    // Neither, both, addresses without an instance or an instance without addresses are
    // usage errors.
    for bad in [
        &["report", "h1"][..],
        &["report", "h1", "--instance", "vm1"],
        &["report", "h1", "--instance", "vm1", "--file", "r.json"],
        &[
            "report",
            "h1",
            "--address",
            "10.0.0.2/29",
            "--file",
            "r.json",
        ],
    ] {
        assert!(parse_host(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn report_files_are_parsed_strictly() {
    let r =
        parse_report(r#"{"instances": [{"instance_id": "vm1", "addresses": ["10.0.0.2/29"]}]}"#)
            .unwrap();
    assert_eq!(r.instances[0].addresses, ["10.0.0.2/29"]);
    let e = parse_report(r#"{"instances": [], "extra": true}"#).unwrap_err();
    assert!(
        matches!(e, vmnet_model::ValidationError::Json { .. }),
        "{e}"
    );
    assert!(
        e.message()
            .starts_with("status report: unknown field `extra`"),
        "{e}"
    );
}

#[test]
fn report_outcome_table() {
    let out = StatusReportOutcome {
        host_id: "h1".into(),
        updated: vec![UpdatedInstance {
            instance_id: "vm1".into(),
            added: vec!["2001:db8::5/64".into()],
            addresses: vec!["10.0.0.2/29".into(), "2001:db8::5/64".into()],
        }],
        skipped: vec![SkippedInstance {
            instance_id: "vm2".into(),
            reason: SkipReason::NotOnHost,
            message: "instance vm2 is placed on host h2, not h1".into(),
        }],
    };
    assert_eq!(
        report_table(&out),
        "INSTANCE  RESULT                 ADDED           ADDRESSES / WHY\n\
         --------  ---------------------  --------------  -----------------------------------------\n\
         vm1       updated                2001:db8::5/64  10.0.0.2/29,2001:db8::5/64\n\
         vm2       skipped (not_on_host)  -               instance vm2 is placed on host h2, not h1\n"
    );
}

#[test]
fn delete_says_what_was_released() {
    let mut i = Instance {
        instance_id: "vm3".into(),
        pool_id: "p1".into(),
        host_id: Some("h1".into()),
        vcpus: 1,
        memory_mib: 512,
        recreate_on_host_loss: false,
        state: InstanceState::Running,
        conditions: vec![],
        address: Some("10.0.0.4".parse().unwrap()),
        address6: None,
        network_policy: vmnet_ipam::NetworkPolicy::Private,
        sandbox: true,
        allocation_id: "alloc-1-vm3".into(),
        addresses: vec!["10.0.0.4/29".into(), "2001:db8::5/64".into()],
        machine: None,
        addresses_stale: false,
        addresses_polled_at_unix_ms: None,
    };
    let table = instances_table(std::slice::from_ref(&i));
    let mut lines = table.lines();
    let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    let _rule = lines.next();
    let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    let col = header.iter().position(|h| *h == "ADDRESSES").unwrap();
    assert_eq!(row[col], "10.0.0.4/29,2001:db8::5/64");
    let d = Deleted::of(i.clone());
    assert_eq!(d.line(), "deleted instance vm3 (released 10.0.0.4)\n");
    let v = serde_json::to_value(&d).unwrap();
    assert_eq!(v["deleted"], true);
    assert_eq!(v["instance"]["network_policy"], "private");
    assert_eq!(v["instance"]["sandbox"], true);
    assert_eq!(v["instance"]["allocation_id"], "alloc-1-vm3");
    assert_eq!(
        v["instance"]["addresses"],
        serde_json::json!(["10.0.0.4/29", "2001:db8::5/64"])
    );
    assert_eq!(
        v["released"],
        serde_json::json!({"pool_id": "p1", "address": "10.0.0.4", "instance_id": "vm3"})
    );
    assert_eq!(v["released_ipv6"], serde_json::Value::Null);
    i.address6 = Some("2001:db8::4".parse().unwrap());
    let d = Deleted::of(i.clone());
    assert_eq!(
        d.line(),
        "deleted instance vm3 (released 10.0.0.4 and 2001:db8::4)\n"
    );
    assert_eq!(
        serde_json::to_value(&d).unwrap()["released_ipv6"],
        serde_json::json!({"pool_id": "p1", "address": "2001:db8::4", "instance_id": "vm3"})
    );
    i.address = None;
    i.address6 = None;
    let d = Deleted::of(i);
    assert_eq!(d.line(), "deleted instance vm3 (it held no lease)\n");
    assert_eq!(
        serde_json::to_value(&d).unwrap()["released"],
        serde_json::Value::Null
    );
}
