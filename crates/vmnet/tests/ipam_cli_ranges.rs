//! `vmnet pool range add|remove|list` end to end through the built binary (which hands IPAM
//! commands to vmnetd), dual-stack: the /29 walk-through with an IPv6 range of 5 addresses, and
//! `pool show`, `lease list` and `instance delete` showing both families. SQLite and PostgreSQL.
#![allow(missing_docs)]

use std::process::{Command, Output};

fn vmnet(db: &[String], args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vmnet"))
        .args(db)
        .args(args)
        .output()
        .expect("run vmnet")
}

fn ok(db: &[String], args: &[&str]) -> String {
    let out = vmnet(db, args);
    assert!(
        out.status.success(),
        "vmnet {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn fails(db: &[String], args: &[&str], exit: i32, stderr: &str) {
    let out = vmnet(db, args);
    assert_eq!(out.status.code(), Some(exit), "vmnet {args:?}");
    assert_eq!(String::from_utf8_lossy(&out.stderr), stderr);
}

fn json(db: &[String], args: &[&str]) -> serde_json::Value {
    let mut all = vec!["--output", "json"];
    all.extend_from_slice(args);
    serde_json::from_str(&ok(db, &all)).unwrap()
}

fn dual_stack(db: &[String]) {
    ok(
        db,
        &[
            "pool",
            "set",
            "p1",
            "--cidr",
            "10.0.0.0/29",
            "--gateway",
            "10.0.0.1",
        ],
    );
    let added = ok(
        db,
        &[
            "pool",
            "range",
            "add",
            "p1",
            "--cidr",
            "2001:db8::/64",
            "--gateway",
            "2001:db8::1",
            "--last-host",
            "2001:db8::6",
        ],
    );
    assert_eq!(
        added,
        "POOL  FAMILY  CIDR           GATEWAY      FIRST        LAST\n\
         ----  ------  -------------  -----------  -----------  -----------\n\
         p1    ipv6    2001:db8::/64  2001:db8::1  2001:db8::2  2001:db8::6\n"
    );
    let list = json(db, &["pool", "range", "list", "p1"]);
    let cidrs: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["cidr"].as_str().unwrap())
        .collect();
    assert_eq!(cidrs, ["10.0.0.0/29", "2001:db8::/64"]);
    ok(
        db,
        &["host", "add", "h1", "--vcpus", "8", "--memory-mib", "8192"],
    );
    for i in 1..=5 {
        let v = json(
            db,
            &["instance", "create", &format!("vm{i}"), "--pool", "p1"],
        );
        assert_eq!(v["address"], format!("10.0.0.{}", i + 1));
        assert_eq!(v["address6"], format!("2001:db8::{}", i + 1));
    }
    fails(
        db,
        &["instance", "create", "vm6", "--pool", "p1"],
        5,
        "error: CAPACITY_UNAVAILABLE: Pool p1 has no free IP address\n",
    );
    assert_eq!(
        ok(db, &["instance", "delete", "vm3"]),
        "deleted instance vm3 (released 10.0.0.4 and 2001:db8::4)\n"
    );
    let leases = ok(db, &["lease", "list", "p1"]);
    assert_eq!(
        leases
            .lines()
            .skip(2)
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
            .collect::<Vec<_>>(),
        [
            "10.0.0.2 vm1",
            "10.0.0.3 vm2",
            "10.0.0.5 vm4",
            "10.0.0.6 vm5",
            "2001:db8::2 vm1",
            "2001:db8::3 vm2",
            "2001:db8::5 vm4",
            "2001:db8::6 vm5"
        ]
    );
    let show = ok(db, &["pool", "show", "p1"]);
    let mut lines = show.lines();
    let head: Vec<&str> = lines
        .next()
        .unwrap()
        .split("  ")
        .filter(|c| !c.is_empty())
        .map(str::trim)
        .collect();
    let _rule = lines.next();
    let row: Vec<&str> = lines
        .next()
        .unwrap()
        .split("  ")
        .filter(|c| !c.is_empty())
        .map(str::trim)
        .collect();
    let col = |name: &str| row[head.iter().position(|h| *h == name).unwrap()];
    assert_eq!(
        (col("LEASES"), col("MORE RANGES"), col("IPV6 LEASES")),
        ("4", "2001:db8::/64", "4")
    );
    fails(
        db,
        &["pool", "range", "remove", "p1", "2001:db8::/64"],
        4,
        "error: CONFLICT: pool p1: range 2001:db8::/64 holds 4 leases; delete their instances first\n",
    );
    fails(
        db,
        &[
            "pool",
            "range",
            "add",
            "p1",
            "--cidr",
            "fe80::/64",
            "--gateway",
            "fe80::1",
        ],
        2,
        "error: INVALID_INPUT: pool p1: cidr fe80::/64 lies in fe80::/10 (link-local), which cannot hold guest addresses\n",
    );
    for i in [1, 2, 4, 5] {
        ok(db, &["instance", "delete", &format!("vm{i}")]);
    }
    assert_eq!(
        ok(db, &["pool", "range", "remove", "p1", "2001:db8::/64"]),
        "removed range 2001:db8::/64 of pool p1\n"
    );
}

#[test]
fn pool_ranges_dual_stack_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    dual_stack(&["--state-dir".to_owned(), dir.path().display().to_string()]);
}

#[test]
fn pool_ranges_dual_stack_on_postgres() {
    let url = vmnet_testkit::postgres::PgCluster::shared()
        .fresh_database_url()
        .unwrap();
    dual_stack(&["--database-url".to_owned(), url]);
}
