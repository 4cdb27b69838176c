//! The sandbox for people who try things, end to end with the built binaries: `up` with extra
//! agent flags (`--agent-arg`) prints the agent's pid, log and command line; a VM put after
//! `up` (`vmnet vm put -`, the config on stdin) gets a simulated guest from `vmnet-lab guest
//! attach` that reaches its gateway and the fake internet; flapping either end of the uplink
//! leaves the sandbox's own addresses and routes in place; `down` leaves no agent, relay or
//! namespace behind.

use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use vmnet_testkit::{require_root, sandbox, traffic};

mod sandbox_support;
use sandbox_support::{Guard, lab, vmnet_bin};

const SPEC: &str = r#"{"vms": [{"id": "vm-a", "user_id": 49, "tenant": 1, "mesh_ipv6": "fdaa:1::31",
  "network": {"routes": [{"destination": "0.0.0.0/0", "via": "host"}]}}]}"#;

const PUT: &str = r#"{"id": "vm-try", "user_id": 50, "tenant": 1, "mesh_ipv6": "fdaa:1::32",
  "network": {"routes": [{"destination": "0.0.0.0/0", "via": "host"}]}}"#;

fn ip(ns: &str, args: &[&str]) -> String {
    let out = Command::new("ip")
        .arg("-n")
        .arg(ns)
        .args(args)
        .output()
        .expect("ip");
    assert!(
        out.status.success(),
        "ip -n {ns} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// ICMP echo from namespace `ns` (the lab's own ping: the host may have no `ping`).
fn ping(ns: &str, to: &str) -> bool {
    let to = to.parse().expect("address");
    traffic::ping(ns, to, 3, Duration::from_secs(1)).is_ok_and(|r| r.received > 0)
}

/// What the sandbox keeps on one end of its uplink: `(ip args, text expected in the output)`.
type Expect<'a> = [(&'a [&'a str], &'a str)];

fn all_there(ns: &str, expect: &Expect) -> bool {
    expect
        .iter()
        .all(|(args, want)| ip(ns, args).contains(want))
}

/// Sets `link` in `ns` down: the routes go (the premise), and within 5 s of `up` everything of
/// `expect` is back.
fn flap(ns: &str, link: &str, expect: &Expect, gone: (&[&str], &str)) {
    assert!(all_there(ns, expect), "before the flap: {expect:?}");
    ip(ns, &["link", "set", link, "down"]);
    assert!(
        !ip(ns, gone.0).contains(gone.1),
        "{ns}: {} went with the link",
        gone.1
    );
    ip(ns, &["link", "set", link, "up"]);
    let t = Instant::now();
    while !all_there(ns, expect) {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "{ns}: not back 5 s after {link} came up: {}\n{}",
            ip(ns, &["addr"]),
            ip(ns, &["-6", "route"]) + &ip(ns, &["route"])
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn runs(pid: u64) -> bool {
    sandbox::process_runs(u32::try_from(pid).expect("pid"))
}

#[test]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
fn agent_flags_a_guest_for_a_put_vm_and_an_uplink_flap() {
    require_root();
    let name = sandbox::unique_prefix("st");
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("sandboxes");
    let root_s = root.display().to_string();
    let guard = Guard {
        name: name.clone(),
        root: root.clone(),
    };
    let spec = tmp.path().join("spec.json");
    std::fs::write(&spec, SPEC).expect("spec");
    let spec_s = spec.display().to_string();

    let out = lab(&[
        "--output",
        "json",
        "up",
        "--sandbox",
        &spec_s,
        "--name",
        &name,
        "--root",
        &root_s,
        "--agent-arg=--firewall-audit-secs=5",
        "--agent-arg=--reconcile-interval-secs=3",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let report: Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}\n{stderr}"));
    let failed: Vec<&Value> = report["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .filter(|c| c["ok"] != true)
        .collect();
    assert!(out.status.success(), "up: {failed:#?}\n{stderr}");

    // The agent's pid, log and whole command line, the extra flags last.
    let dir = root.join(&name);
    let pid = report["agent_pid"].as_u64().expect("agent_pid");
    assert_eq!(
        report["agent_log"],
        dir.join("agent.log").display().to_string()
    );
    let command: Vec<&str> = report["agent_command"]
        .as_array()
        .expect("agent_command")
        .iter()
        .map(|a| a.as_str().expect("string"))
        .collect();
    assert_eq!(command[0], vmnet_bin().display().to_string());
    assert_eq!(
        command[command.len() - 2..],
        ["--firewall-audit-secs=5", "--reconcile-interval-secs=3"]
    );
    let running = std::fs::read(format!("/proc/{pid}/cmdline")).expect("agent runs");
    let running: Vec<String> = running
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    assert_eq!(
        running, command,
        "the command line printed is the one running"
    );
    let state: Value =
        serde_json::from_slice(&std::fs::read(dir.join("sandbox.json")).expect("state"))
            .expect("sandbox.json");
    let agent = state["procs"]
        .as_array()
        .expect("procs")
        .iter()
        .find(|p| p["role"] == "agent")
        .expect("agent recorded");
    assert_eq!(agent["pid"], pid);
    assert_eq!(
        agent["command"].as_array().map(Vec::len),
        Some(command.len())
    );

    // A VM put after `up`, its config on stdin, gets a guest that reaches out.
    let socket = dir.join("vmnet.sock");
    let mut put = Command::new(vmnet_bin())
        .args(["vm", "put", "-"])
        .env("VMNET_SOCKET", &socket)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("vmnet vm put -");
    put.stdin
        .take()
        .expect("stdin")
        .write_all(PUT.as_bytes())
        .expect("write the config");
    let put = put.wait_with_output().expect("vm put");
    assert!(
        put.status.success(),
        "vm put -: {}",
        String::from_utf8_lossy(&put.stderr)
    );
    let out = lab(&[
        "--output",
        "json",
        "guest",
        "attach",
        "--sandbox",
        "--name",
        &name,
        "--root",
        &root_s,
        "vm-try",
    ]);
    assert!(
        out.status.success(),
        "guest attach: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let attached: Value = serde_json::from_slice(&out.stdout).expect("attach json");
    let guest = format!("{name}g0032");
    assert_eq!(attached["guest_netns"], guest);
    assert_eq!(
        attached["hint"],
        format!("ip netns exec {guest} ping -c 1 172.16.0.1")
    );
    let relay = attached["relay_pid"].as_u64().expect("relay_pid");
    assert!(runs(relay));
    assert!(ping(&guest, "172.16.0.1"), "the guest reaches its gateway");
    assert!(
        ping(&guest, "198.51.100.10"),
        "the guest reaches the fake internet"
    );
    let again = lab(&[
        "guest",
        "attach",
        "--sandbox",
        "--name",
        &name,
        "--root",
        &root_s,
        "vm-try",
    ]);
    assert_eq!(again.status.code(), Some(4), "a second attach: CONFLICT");

    // Either end of the uplink flapped: the sandbox's own addresses and routes come back.
    let host = format!("{name}host");
    let inet = format!("{name}inet");
    let host_expect: &Expect = &[
        (
            &["-6", "addr", "show", "dev", "uplink"],
            "2001:db8:0:1::2/64",
        ),
        (&["route", "show", "default"], "via 203.0.113.1 dev uplink"),
        (
            &["-6", "route", "show", "default"],
            "via 2001:db8:0:1::1 dev uplink",
        ),
    ];
    flap(
        &host,
        "uplink",
        host_expect,
        (&["route", "show", "default"], "via"),
    );
    let inet_expect: &Expect = &[
        (
            &["-6", "addr", "show", "dev", "sbhost"],
            "2001:db8:0:1::1/64",
        ),
        (
            &["-6", "route", "show", "fdaa::/16"],
            "via 2001:db8:0:1::2 dev sbhost",
        ),
    ];
    flap(
        &inet,
        "sbhost",
        inet_expect,
        (&["-6", "route", "show", "fdaa::/16"], "via"),
    );
    assert!(
        ping(&guest, "198.51.100.10"),
        "out through the flapped uplink"
    );

    // `down` stops the agent it was given flags for, the relay and the keepers, and deletes
    // every namespace, the attached guest's too.
    let down = lab(&["down", "--sandbox", "--name", &name, "--root", &root_s]);
    assert!(
        down.status.success(),
        "{}",
        String::from_utf8_lossy(&down.stderr)
    );
    assert!(
        down.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&down.stderr)
    );
    assert!(!runs(pid), "agent {pid} stopped");
    assert!(!runs(relay), "relay {relay} stopped");
    assert_eq!(sandbox::leftovers(&name), Vec::<String>::new());
    assert!(!Path::new(&dir).exists());
    drop(guard);
}

#[test]
fn up_refuses_agent_flags_it_sets_itself() {
    let out = lab(&[
        "up",
        "--sandbox",
        "--name",
        "stnone",
        "--agent-arg=--socket=/tmp/other.sock",
    ]);
    assert_eq!(out.status.code(), Some(2), "INVALID_INPUT");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(
            "--agent-arg \"--socket=/tmp/other.sock\": `up` sets --socket on its agents itself"
        ),
        "{stderr}"
    );
}
