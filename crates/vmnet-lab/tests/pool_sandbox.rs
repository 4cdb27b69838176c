//! `vmnet-lab up --sandbox examples/pool.json` end to end (root): the spec's /29 walk-through —
//! five instances get .2–.6, their seeds carry those addresses, the sixth fails with
//! CAPACITY_UNAVAILABLE — plus reachability by policy, every spoof attempt, the drift gap and
//! the teardown, expected and seen, all through the real agent.

use std::os::unix::process::CommandExt;
use std::process::Command;

#[test]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
fn pool_sandbox_walk_through() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test needs root (it creates network namespaces)"
    );
    let spec = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/pool.json");
    let name = format!("pw{:06x}", std::process::id() & 0xff_ffff);
    let out = Command::new(env!("CARGO_BIN_EXE_vmnet-lab"))
        .args(["--output", "json", "up", "--sandbox", spec, "--name", &name])
        .output()
        .expect("run vmnet-lab");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "vmnet-lab up failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(&stdout).expect("JSON report");
    let leases: Vec<&str> = v["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["lease"].as_str().unwrap())
        .collect();
    assert_eq!(
        &leases[..5],
        ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5", "10.0.0.6"]
    );
    assert!(
        leases[5].starts_with("CAPACITY_UNAVAILABLE"),
        "{}",
        leases[5]
    );
    let seeds: Vec<&str> = v["instances"].as_array().unwrap()[..5]
        .iter()
        .map(|i| i["seed_address"].as_str().unwrap())
        .collect();
    assert_eq!(
        seeds,
        [
            "10.0.0.2/29,fd00:10::2/64",
            "10.0.0.3/29,fd00:10::3/64",
            "10.0.0.4/29,fd00:10::4/64",
            "10.0.0.5/29,fd00:10::5/64",
            "10.0.0.6/29,fd00:10::6/64"
        ]
    );
    // Dual-stack: the IPv6 range leases in order beside the /29.
    let leases6: Vec<&str> = v["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["lease6"].as_str().unwrap())
        .collect();
    assert_eq!(
        leases6,
        [
            "fd00:10::2",
            "fd00:10::3",
            "fd00:10::4",
            "fd00:10::5",
            "fd00:10::6",
            "-"
        ]
    );
    let checks = v["checks"].as_array().unwrap();
    assert!(checks.len() >= 30, "{checks:?}");
    assert!(checks.iter().all(|c| c["ok"] == true), "{checks:#?}");
    assert!(
        checks
            .iter()
            .any(|c| c["name"].as_str().unwrap().contains("forged ARP") && c["seen"] == "dropped")
    );
    // The drift gap through the real agent: held, flushed, the guard alone; then its audit.
    let check = |name: &str| {
        checks
            .iter()
            .find(|c| c["name"].as_str().unwrap().contains(name))
            .unwrap_or_else(|| panic!("no check {name:?}: {checks:#?}"))
    };
    assert_eq!(
        check("gap, at the bridge: web-1 → web-2: foreign IPv4 source")["seen"],
        "dropped"
    );
    for spoof in [
        "web-1 → web-2: foreign IPv6 source in the range",
        "web-1 → web-2: another guest's IPv6 lease as source",
        "web-1 → web-2: router advertisement from a guest's IPv6 lease",
        "gap, at the bridge: web-1 → web-2: another guest's IPv6 lease as source",
    ] {
        assert_eq!(check(spoof)["seen"], "dropped", "{spoof}");
    }
    assert_eq!(check("web-1 → web-2 over IPv6")["seen"], "passes");
    assert_eq!(check("→ ipv6 gateway fd00:10::1")["seen"], "passes");
    assert_eq!(check("nothing reaches a guest")["seen"], "dropped");
    assert_eq!(check("gap: the audit")["seen"], "repaired");
    assert_eq!(
        check("teardown: instances deleted through the API")["seen"],
        "0 taps, 0 elements"
    );
    let left = Command::new("ip").args(["netns", "list"]).output().unwrap();
    assert!(
        !String::from_utf8_lossy(&left.stdout).contains(&name),
        "namespaces left behind"
    );
}

/// A sandbox of the same name exists (here a bare testkit sandbox): refused with CONFLICT
/// (exit 4) and the host-mode hint, the name said once, and the existing sandbox untouched.
#[test]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
fn pool_sandbox_refuses_an_existing_name() {
    vmnet_testkit::require_root();
    let spec = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/pool.json");
    let name = vmnet_testkit::sandbox::unique_prefix("pc");
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().display().to_string();
    let sb = vmnet_testkit::Sandbox::with_prefix(&name).expect("sandbox");
    let out = Command::new(env!("CARGO_BIN_EXE_vmnet-lab"))
        .args(["up", "--sandbox", spec, "--name", &name, "--root", &root])
        .output()
        .expect("run vmnet-lab");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{err}");
    assert!(err.contains("CONFLICT"), "{err}");
    assert!(
        err.contains(&format!(
            "run `vmnet-lab down --sandbox --name {name}` first"
        )),
        "{err}"
    );
    assert_eq!(err.matches(&format!("sandbox {name}")).count(), 1, "{err}");
    assert_eq!(
        vmnet_testkit::sandbox::owned(&name),
        vec![sb.host(), sb.inet()]
    );
}

/// An interrupted `up` (SIGINT while the agent runs) stops the agent and removes the sandbox.
#[test]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
fn pool_sandbox_interrupted_leaves_nothing() {
    vmnet_testkit::require_root();
    let spec = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/pool.json");
    let name = vmnet_testkit::sandbox::unique_prefix("pi");
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().display().to_string();
    let child = Command::new(env!("CARGO_BIN_EXE_vmnet-lab"))
        .args(["up", "--sandbox", spec, "--name", &name, "--root", &root])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run vmnet-lab");
    // Wait until the agent runs inside the sandbox (its namespace exists and it has a child).
    let start = std::time::Instant::now();
    let agent_running = || {
        let out = Command::new("pgrep")
            .args(["-P", &child.id().to_string(), "-f", "serve --netns"])
            .output()
            .unwrap();
        out.status.success()
    };
    while !agent_running() {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(30),
            "the agent never started"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // While it is being built, `down` and another `up` of the name are refused.
    for args in [
        vec!["down", "--sandbox", "--name", &name, "--root", &root],
        vec!["up", "--sandbox", spec, "--name", &name, "--root", &root],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_vmnet-lab"))
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(4), "{args:?}: {err}");
        assert!(
            err.contains("being made by `vmnet-lab up`"),
            "{args:?}: {err}"
        );
    }
    // Into the checks (the agent runs, instances are being made or checked).
    std::thread::sleep(std::time::Duration::from_secs(3));
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).unwrap();
    let signalled = std::time::Instant::now();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(6), "UNAVAILABLE: {err}");
    assert!(err.contains("interrupted"), "{err}");
    assert!(
        signalled.elapsed() < std::time::Duration::from_secs(8),
        "the interrupt took {:?} to act",
        signalled.elapsed()
    );
    assert!(
        vmnet_testkit::sandbox::owned(&name).is_empty(),
        "namespaces left: {:?}",
        vmnet_testkit::sandbox::owned(&name)
    );
    let agents = Command::new("pgrep")
        .args(["-f", &format!("--name-prefix {name}")])
        .output()
        .unwrap();
    assert!(
        !agents.status.success(),
        "an agent of the sandbox still runs: {}",
        String::from_utf8_lossy(&agents.stdout)
    );
}

/// SIGINT right after start (before anything could be built, and while it is): nothing left
/// behind, in both modes.
#[test]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
fn an_early_interrupt_leaves_nothing() {
    vmnet_testkit::require_root();
    for (spec, tag) in [("examples/pool.json", "pe"), ("examples/host.json", "ne")] {
        for delay_ms in [5, 40, 60, 80, 300] {
            let spec = format!("{}/../../{spec}", env!("CARGO_MANIFEST_DIR"));
            let name = vmnet_testkit::sandbox::unique_prefix(tag);
            let tmp = tempfile::tempdir().expect("tempdir");
            let root = tmp.path().display().to_string();
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_vmnet-lab"));
            cmd.args(["up", "--sandbox", &spec, "--name", &name, "--root", &root])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped());
            // SIGINT at its default in the child, whatever this process inherited: a suite
            // started in the background (`nohup`, `&` in a script) ignores it, and an `up`
            // signalled before it installs its handler would then run to the end.
            // SAFETY: between fork and exec only `signal`, which is async-signal-safe.
            unsafe {
                cmd.pre_exec(|| {
                    libc::signal(libc::SIGINT, libc::SIG_DFL);
                    Ok(())
                });
            }
            let child = cmd.spawn().expect("run vmnet-lab");
            std::thread::sleep(std::time::Duration::from_millis(delay_ms));
            let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
            nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).unwrap();
            let out = child.wait_with_output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            // Exit 6 (UNAVAILABLE, "interrupted"), or killed by the signal before `up` installed
            // its handlers — which it does before it builds anything.
            let code = out.status.code();
            assert!(
                code == Some(6) || code.is_none(),
                "{spec} at {delay_ms} ms: {:?}: {err}",
                out.status
            );
            if code == Some(6) {
                assert!(
                    err.contains(&format!("interrupted; sandbox {name} removed")),
                    "{spec} at {delay_ms} ms: {err}"
                );
            }
            assert!(
                vmnet_testkit::sandbox::owned(&name).is_empty(),
                "{spec} at {delay_ms} ms: namespaces left: {:?}",
                vmnet_testkit::sandbox::owned(&name)
            );
            assert!(
                !tmp.path().join(&name).exists(),
                "{spec} at {delay_ms} ms: state directory left"
            );
            let procs = Command::new("pgrep").args(["-af", &name]).output().unwrap();
            assert!(
                !procs.status.success(),
                "{spec} at {delay_ms} ms: processes left: {}",
                String::from_utf8_lossy(&procs.stdout)
            );
        }
    }
}
