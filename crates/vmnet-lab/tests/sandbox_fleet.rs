//! The fleet sandbox end to end: the built `vmnet-lab` binary runs
//! `up --sandbox examples/fleet.json` (three hosts, each its own agent on its own database in
//! one PostgreSQL cluster, simulated guests, real packets), every check must pass, then
//! `down --sandbox` must leave nothing behind: no namespace of the fleet or its hosts, no
//! process, no state or cluster directory.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_json::Value;
use vmnet_testkit::{fleet, require_root, sandbox};

mod sandbox_support;
use sandbox_support::{client, lab};

fn fleet_spec() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/fleet.json")
}

/// Removes the fleet even when the test fails half-way.
struct Guard {
    name: String,
    root: PathBuf,
}

impl Drop for Guard {
    fn drop(&mut self) {
        let root = self.root.display().to_string();
        let _ = lab(&["down", "--sandbox", "--name", &self.name, "--root", &root]);
        let _ = fleet::cleanup(&self.name);
    }
}

fn processes(marker: &str) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc")
        .expect("proc")
        .filter_map(Result::ok)
    {
        if let Ok(cmd) = std::fs::read(e.path().join("cmdline")) {
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if cmd.contains(marker) {
                out.push(cmd);
            }
        }
    }
    out
}

fn vm_ids(socket: &str) -> BTreeSet<String> {
    let out = client(socket, &["--output", "json", "vm", "list"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("json");
    v.as_array()
        .expect("a list of VMs")
        .iter()
        .map(|x| x["config"]["id"].as_str().expect("id").to_owned())
        .collect()
}

#[test]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
fn up_builds_the_fleet_every_check_passes_and_down_removes_everything() {
    require_root();
    // A 1-letter tag: 9 bytes, so each host prefix (one more digit) fits in 10.
    let name = sandbox::unique_prefix("y");
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("sandboxes");
    let root_s = root.display().to_string();
    let _guard = Guard {
        name: name.clone(),
        root: root.clone(),
    };
    let spec = fleet_spec().display().to_string();
    let up = |extra: &[&str]| {
        let mut args = vec!["up", "--sandbox", &spec, "--name", &name, "--root", &root_s];
        args.splice(0..0, extra.iter().copied());
        lab(&args)
    };

    let out = up(&["--output", "json"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "up failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    let report: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));

    // Three hosts, each with its own namespace, agent prefix, database and socket; each agent
    // holds only its own host's VMs.
    let hosts = report["hosts"].as_array().expect("hosts");
    assert_eq!(hosts.len(), 3, "{hosts:#?}");
    let want_vms: [&[&str]; 3] = [&["db-1", "web-1"], &["app-2", "web-2"], &["web-3"]];
    for (i, (h, want)) in hosts.iter().zip(want_vms).enumerate() {
        let prefix = format!("{name}{}", i + 1);
        assert_eq!(h["agent_prefix"], prefix);
        assert_eq!(h["netns"], format!("{prefix}host"));
        assert_eq!(h["database"], prefix);
        let socket = h["socket"].as_str().expect("socket");
        let ids = vm_ids(socket);
        let want: BTreeSet<String> = want.iter().map(|s| (*s).to_owned()).collect();
        assert_eq!(ids, want, "host {}", h["name"]);
        let failed: Vec<&Value> = h["checks"]
            .as_array()
            .expect("checks")
            .iter()
            .filter(|c| c["ok"] != true)
            .collect();
        assert!(failed.is_empty(), "failed guest checks: {failed:#?}");
    }
    assert_eq!(hosts[1]["net"]["public_neighbors"], "proxy");
    // A VM's IPv4 leaves through its own host's uplink (NAT to that address).
    let nat = |h: &Value, vm: &str| {
        h["checks"]
            .as_array()
            .expect("checks")
            .iter()
            .find(|c| c["vm"] == vm && c["check"] == "ipv4 tcp echo")
            .map(|c| c["seen"].clone())
    };
    // web-1 and web-2 have public addresses (host-1 routed, host-2 proxy): they leave from them.
    assert_eq!(nat(&hosts[0], "web-1"), Some("from 203.0.113.70".into()));
    assert_eq!(nat(&hosts[1], "web-2"), Some("from 203.0.113.85".into()));
    assert_eq!(nat(&hosts[2], "web-3"), Some("from 192.0.2.26".into()));

    // The checks across hosts: every one passed, and each host reached the internet and every
    // other host's private IPv4 and IPv6 address.
    let checks = report["checks"].as_array().expect("checks");
    let failed: Vec<&Value> = checks.iter().filter(|c| c["ok"] != true).collect();
    assert!(failed.is_empty(), "failed fleet checks: {failed:#?}");
    let has = |host: &str, check: &str| {
        checks
            .iter()
            .any(|c| c["host"] == host && c["check"] == check && c["ok"] == true)
    };
    for h in ["host-1", "host-2", "host-3"] {
        assert!(has(h, "internet ipv4") && has(h, "internet ipv6"), "{h}");
        for k in ["host-1", "host-2", "host-3"].iter().filter(|k| **k != h) {
            assert!(has(h, &format!("private ipv4 -> {k}")), "{h} -> {k}");
            assert!(has(h, &format!("private ipv6 -> {k}")), "{h} -> {k}");
        }
    }
    assert!(has("host-2", "public 203.0.113.80/28"));
    // The mesh: every host's mesh address answers across the other hosts' WireGuard interface.
    for (i, h) in ["host-1", "host-2", "host-3"].iter().enumerate() {
        for (j, k) in ["host-1", "host-2", "host-3"]
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
        {
            let check = format!(
                "mesh address of {k} (fdaa::{}) across {name}{}wg",
                j + 1,
                i + 1
            );
            assert!(has(h, &check), "{h}: {check}: {checks:#?}");
        }
    }
    // VM to VM across hosts over the mesh's data plane: within tenant 2 (web-2 and app-2 on
    // host-2, web-3 on host-3) answered from the source's mesh address; across tenants dropped.
    for (h, c) in [
        (
            "host-3",
            "vm web-3 -> web-2 on host-2 (mesh, tenant 2 -> 2)",
        ),
        (
            "host-3",
            "vm web-3 -> app-2 on host-2 (mesh, tenant 2 -> 2)",
        ),
        (
            "host-2",
            "vm app-2 -> web-3 on host-3 (mesh, tenant 2 -> 2)",
        ),
        (
            "host-1",
            "vm web-1 -> web-2 on host-2 (mesh, tenant 1 -> 2)",
        ),
        ("host-2", "vm web-2 -> db-1 on host-1 (mesh, tenant 2 -> 1)"),
    ] {
        assert!(has(h, c), "{h}: {c}: {checks:#?}");
    }
    let seen = |h: &str, c: &str| {
        checks
            .iter()
            .find(|x| x["host"] == h && x["check"] == c)
            .map(|x| x["seen"].as_str().unwrap_or_default().to_owned())
    };
    assert_eq!(
        seen(
            "host-3",
            "vm web-3 -> web-2 on host-2 (mesh, tenant 2 -> 2)"
        )
        .as_deref(),
        Some("from fdaa:3::7")
    );
    assert_eq!(
        seen(
            "host-1",
            "vm web-1 -> web-2 on host-2 (mesh, tenant 1 -> 2)"
        )
        .as_deref(),
        Some("no reach")
    );
    let wg: Vec<String> = (1..=3)
        .map(|i| format!("wireguard-go -f {name}{i}wg"))
        .collect();
    for w in &wg {
        assert_eq!(processes(w).len(), 1, "{w}");
    }
    // VM to VM through public addresses across hosts, each seen from the other's public address.
    for (h, c) in [
        ("host-1", "public web-1 -> web-2 ipv4"),
        ("host-1", "public web-1 -> web-2 ipv6"),
        ("host-2", "public web-2 -> web-1 ipv4"),
        ("host-2", "public web-2 -> web-1 ipv6"),
    ] {
        assert!(has(h, c), "{h}: {c}");
    }

    // The sandbox stays up: echo, three agents, five relays, four uplink keepers (the fake
    // internet's and each host's); the PostgreSQL server; every namespace starts with the fleet
    // name. A second `up` is refused.
    let dir = root.join(&name);
    let marker = format!("{}/", dir.display());
    assert_eq!(processes(&marker).len(), 13, "{:#?}", processes(&marker));
    let pg = report["postgres"]
        .as_str()
        .expect("postgres dir")
        .to_owned();
    let pg_marker = format!("{pg}/");
    assert_eq!(
        processes(&pg_marker).len(),
        1,
        "{:#?}",
        processes(&pg_marker)
    );
    let spaces = fleet::owned(&name);
    assert_eq!(spaces.len(), 3 + 2 + 5 * 2, "{spaces:?}");
    let again = up(&[]);
    assert_eq!(
        again.status.code(),
        Some(4),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );

    // A host of the fleet is no sandbox of its own: `down` and `up` of its name are refused and
    // leave its namespaces alone.
    let host1 = format!("{name}1");
    for args in [
        vec!["down", "--sandbox", "--name", &host1, "--root", &root_s],
        vec!["up", "--sandbox", "--name", &host1, "--root", &root_s],
    ] {
        let out = lab(&args);
        assert_eq!(out.status.code(), Some(4), "{args:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("is a host of the fleet sandbox"),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert_eq!(
        fleet::owned(&name),
        spaces,
        "the fleet's namespaces are untouched"
    );

    let down = lab(&["down", "--sandbox", "--name", &name, "--root", &root_s]);
    assert!(
        down.status.success(),
        "{}",
        String::from_utf8_lossy(&down.stderr)
    );
    let said = String::from_utf8_lossy(&down.stdout);
    assert!(said.contains("stopped postgres (pid "), "{said}");
    // The hosts' wireguard-go (they outlive their agents by design) are stopped too.
    for w in &wg {
        assert_eq!(processes(w), Vec::<String>::new(), "{w}");
    }
    assert!(
        said.contains(&format!("wireguard-go {name}1wg (pid ")),
        "{said}"
    );
    assert_eq!(fleet::leftovers(&name), Vec::<String>::new());
    assert_eq!(processes(&marker), Vec::<String>::new());
    assert_eq!(processes(&pg_marker), Vec::<String>::new());
    assert!(!dir.exists());
    assert!(!Path::new(&pg).exists());
}
