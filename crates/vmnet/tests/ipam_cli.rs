//! The IPAM CLI end to end: the spec's /29 walk-through through the built binary, on a SQLite
//! file under a temporary --state-dir and on PostgreSQL, plus error output and exit codes.
#![allow(missing_docs)]

use std::process::{Command, Output};

fn vmnet(db_args: &[String], args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vmnet"))
        .args(db_args)
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
    assert!(out.stdout.is_empty());
}

/// `--network-policy` and `--sandbox` reach the store and come back in `instance show` (JSON
/// and table); an unknown policy is INVALID_INPUT naming network_policy. Uses (and returns) the
/// free address 10.0.0.4.
fn policy_and_sandbox(db: &[String]) {
    fails(
        db,
        &[
            "instance",
            "create",
            "vm7",
            "--pool",
            "p1",
            "--network-policy",
            "open",
        ],
        2,
        "error: INVALID_INPUT: network_policy \"open\" is not one of public, private, none\n",
    );
    ok(
        db,
        &[
            "instance",
            "create",
            "vm7",
            "--pool",
            "p1",
            "--network-policy",
            "private",
            "--sandbox",
        ],
    );
    let json = ok(db, &["--output", "json", "instance", "show", "vm7"]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["network_policy"], "private");
    assert_eq!(v["sandbox"], true);
    let alloc = v["allocation_id"].as_str().unwrap().to_owned();
    assert!(
        alloc.starts_with("alloc-") && alloc.ends_with("-vm7"),
        "{alloc}"
    );
    let table = ok(db, &["instance", "show", "vm7"]);
    let mut lines = table.lines();
    let head: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    let _rule = lines.next();
    let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    let col = |name: &str| row[head.iter().position(|h| *h == name).unwrap()];
    assert_eq!(
        (col("POLICY"), col("SANDBOX"), col("ALLOCATION")),
        ("private", "true", alloc.as_str())
    );
    ok(db, &["instance", "delete", "vm7"]);
}

fn walk_through(db: &[String]) {
    let set = ok(
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
    assert_eq!(
        set,
        "POOL  CIDR         GATEWAY   FIRST     LAST      DNS\n----  -----------  --------  --------  --------  ---\np1    10.0.0.0/29  10.0.0.1  10.0.0.2  10.0.0.6  -\n"
    );
    ok(
        db,
        &["host", "add", "h1", "--vcpus", "8", "--memory-mib", "8192"],
    );
    for i in 1..=5 {
        let json = ok(
            db,
            &[
                "--output",
                "json",
                "instance",
                "create",
                &format!("vm{i}"),
                "--pool",
                "p1",
            ],
        );
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v["address"], format!("10.0.0.{}", i + 1));
        assert_eq!(v["host_id"], "h1");
    }
    fails(
        db,
        &["instance", "create", "vm6", "--pool", "p1"],
        5,
        "error: CAPACITY_UNAVAILABLE: Pool p1 has no free IP address\n",
    );
    assert_eq!(
        ok(db, &["instance", "delete", "vm3"]),
        "deleted instance vm3 (released 10.0.0.4)\n"
    );
    let json = ok(
        db,
        &[
            "--output", "json", "instance", "create", "vm6", "--pool", "p1",
        ],
    );
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["address"], "10.0.0.4");
    // The same create again (a retry) answers the instance; the pool is full, nothing is leased.
    let again = ok(
        db,
        &[
            "--output", "json", "instance", "create", "vm6", "--pool", "p1",
        ],
    );
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&again).unwrap(),
        v
    );
    let leases = ok(db, &["lease", "list", "p1"]);
    assert_eq!(
        leases,
        "ADDRESS   INSTANCE\n--------  --------\n10.0.0.2  vm1\n10.0.0.3  vm2\n10.0.0.4  vm6\n10.0.0.5  vm4\n10.0.0.6  vm5\n"
    );
    let json = ok(db, &["--output", "json", "pool", "show", "p1"]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["leases"], 5);
    assert_eq!(v["range"]["first_host"], "10.0.0.2");
    fails(
        db,
        &[
            "pool",
            "set",
            "p2",
            "--cidr",
            "10.0.0.1/24",
            "--gateway",
            "10.0.0.1",
        ],
        2,
        "error: INVALID_INPUT: pool p2: cidr 10.0.0.1/24 has host bits set (the network is 10.0.0.0/24)\n",
    );
    fails(
        db,
        &["instance", "show", "nope"],
        3,
        "error: NOT_FOUND: instance nope not found\n",
    );
    fails(
        db,
        &["instance", "create", "vm1", "--pool", "p1", "--vcpus", "2"],
        4,
        "error: CONFLICT: instance vm1 already exists with vcpus 1 (this request: 2)\n",
    );
    fails(
        db,
        &["instance", "create", "$(reboot)", "--pool", "p1"],
        2,
        "error: INVALID_INPUT: instance_id \"$(reboot)\" may only contain A-Z a-z 0-9 . _ - and must start with a letter or digit\n",
    );
    let json = ok(db, &["--output", "json", "instance", "delete", "vm6"]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["deleted"], true);
    assert_eq!(v["instance"]["network_policy"], "public");
    assert_eq!(v["instance"]["sandbox"], false);
    policy_and_sandbox(db);
    assert_eq!(
        v["released"],
        serde_json::json!({"pool_id": "p1", "address": "10.0.0.4", "instance_id": "vm6"})
    );
    fails(
        db,
        &[
            "pool",
            "set",
            "p3",
            "--cidr",
            "010.5.0.0/24",
            "--gateway",
            "10.5.0.1",
        ],
        2,
        "error: INVALID_INPUT: pool p3: cidr \"010.5.0.0/24\" is not an IPv4 CIDR such as 10.0.0.0/24\n",
    );
}

#[test]
fn walk_through_on_sqlite_under_state_dir() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let db = vec!["--state-dir".to_owned(), state.display().to_string()];
    walk_through(&db);
    assert!(
        state.join("vmnet.db").is_file(),
        "the default database lives under --state-dir"
    );
}

#[test]
fn walk_through_on_postgres() {
    let url = vmnet_testkit::postgres::PgCluster::shared()
        .fresh_database_url()
        .unwrap();
    walk_through(&["--database-url".to_owned(), url]);
}

#[test]
fn bad_database_url_is_invalid_input() {
    fails(
        &["--database-url".to_owned(), "mysql://x".to_owned()],
        &["pool", "list"],
        2,
        "error: INVALID_INPUT: database_url \"mysql://x\" must start with sqlite:// or postgres://\n",
    );
}

/// `host report --instance` without `--address` would change nothing yet say "updated": it is
/// a usage error naming `--address`, refused before the database is opened.
#[test]
fn host_report_with_an_instance_needs_an_address() {
    let dir = tempfile::tempdir().unwrap();
    let db = vec!["--state-dir".to_owned(), dir.path().display().to_string()];
    let out = vmnet(&db, &["host", "report", "h1", "--instance", "vm1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(out.stdout.is_empty());
    assert!(
        stderr.starts_with(
            "error: INVALID_INPUT: the following required arguments were not provided:\n  --address <CIDR>\n"
        ),
        "{stderr}"
    );
    assert!(
        !dir.path().join("vmnet.db").exists(),
        "refused before the database is opened"
    );
}

/// `pool set --provider` and `instance create --server-id | --node --vmid`: the pool's settings
/// (never a secret) and the machine come back in JSON; the flags of the other kind are refused.
#[test]
fn provider_pools_through_the_cli() {
    let dir = tempfile::tempdir().unwrap();
    let db = vec!["--state-dir".to_owned(), dir.path().display().to_string()];
    let out = ok(
        &db,
        &[
            "--output",
            "json",
            "pool",
            "set",
            "hz",
            "--provider",
            "hetzner-cloud",
            "--credentials-env",
            "HCLOUD_TOKEN",
            "--poll-interval-secs",
            "60",
        ],
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["kind"], "provider");
    assert_eq!(
        v["provider"],
        serde_json::json!({"pool_id": "hz", "provider": "hetzner-cloud",
            "api_url": "https://api.hetzner.cloud/v1", "credentials": {"env": "HCLOUD_TOKEN"},
            "poll_interval_secs": 60})
    );
    let table = ok(&db, &["pool", "list"]);
    assert!(
        table.contains("hetzner-cloud https://api.hetzner.cloud/v1 env HCLOUD_TOKEN every 60s"),
        "{table}"
    );
    fails(
        &db,
        &["pool", "set", "hz", "--provider", "hetzner-cloud"],
        2,
        "error: INVALID_INPUT: pool hz: --provider needs --credentials-file PATH or --credentials-env NAME\n",
    );
    let out = vmnet(
        &db,
        &[
            "pool",
            "set",
            "hz",
            "--provider",
            "hetzner-cloud",
            "--cidr",
            "10.0.0.0/29",
        ],
    );
    assert_eq!(out.status.code(), Some(2), "--cidr and --provider conflict");
    let out = ok(
        &db,
        &[
            "--output",
            "json",
            "instance",
            "create",
            "web-1",
            "--pool",
            "hz",
            "--server-id",
            "42",
        ],
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["machine"], serde_json::json!({"server_id": 42}));
    assert_eq!(v["host_id"], serde_json::Value::Null);
    assert_eq!(v["addresses"], serde_json::json!([]));
    let table = ok(&db, &["instance", "show", "web-1"]);
    assert!(table.contains("server 42"), "{table}");
    fails(
        &db,
        &[
            "instance", "create", "db-1", "--pool", "hz", "--node", "pve1", "--vmid", "100",
        ],
        2,
        "error: INVALID_INPUT: instance db-1: machine.node is not used by a hetzner-cloud pool\n",
    );
}
