//! The vmnet package on a real host (root, `/dev/kvm`): `scripts/package.sh` packs the suite's
//! debug binaries (`--debug --no-build`, as the `package` test does: a release build would add
//! minutes of compiling to the suite), and `vmnet-lab package-vm` boots a fresh Debian 12 VM under
//! qemu from the image of `scripts/guest-image.sh --host` (built on first use and cached), installs
//! the package there with `apt-get` and checks it under systemd: `systemctl start` returns once the
//! agent is ready, a VM put through the packaged CLI is applied, Debian's Prometheus scrapes the
//! metrics listener, `kill -9`, a stopped agent (the watchdog) and `apt-get install --reinstall`
//! each restart the agent while a guest's ping through the VM's tap loses nothing, and the events
//! and the journal show what happened. `scripts/test.sh` skips this test (and counts it
//! skipped) on a machine without `/dev/kvm`.

use std::path::Path;
use std::process::Command;

#[test]
#[ignore = "needs root: builds a network namespace and boots a qemu VM (scripts/test.sh runs it)"]
fn kvm_package_on_a_fresh_debian_vm() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test needs root (it creates a network namespace and boots qemu)"
    );
    assert!(
        Path::new("/dev/kvm").exists(),
        "this test needs /dev/kvm (scripts/test.sh skips it without)"
    );
    // target/debug/vmnet-lab → target
    let lab = Path::new(env!("CARGO_BIN_EXE_vmnet-lab"));
    let target = lab.parent().and_then(Path::parent).unwrap();
    for b in ["vmnet", "vmnetd", "vmnet-pool-helper", "vmnet-guest"] {
        assert!(
            target.join("debug").join(b).is_file(),
            "build every binary first (cargo build --workspace --bins; scripts/test.sh does)"
        );
    }
    let out = tempfile::tempdir().unwrap();
    let packed = Command::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../scripts/package.sh"
    ))
    .args(["--debug", "--no-build", "--out"])
    .arg(out.path())
    .env("CARGO_TARGET_DIR", target)
    .output()
    .expect("run scripts/package.sh");
    assert!(
        packed.status.success(),
        "scripts/package.sh: {}",
        String::from_utf8_lossy(&packed.stderr)
    );
    let stdout = String::from_utf8_lossy(&packed.stdout);
    let deb = stdout
        .lines()
        .find(|l| l.contains("/vmnet_"))
        .unwrap_or_else(|| panic!("no vmnet package in {stdout}"));

    // From the repository, so `scripts/guest-image.sh --host` is this tree's (the target
    // directory may belong to another checkout).
    let run = Command::new(lab)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
        .args(["--output", "json", "package-vm", deb])
        .output()
        .expect("run vmnet-lab package-vm");
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    let v: serde_json::Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("package-vm printed no report ({e}): {stderr}\n{stdout}"));
    let checks = v["checks"].as_array().expect("checks");
    for c in checks {
        eprintln!(
            "{:<4} {} | {} | {}",
            if c["ok"] == true { "ok" } else { "FAIL" },
            c["name"].as_str().unwrap_or(""),
            c["expected"].as_str().unwrap_or(""),
            c["seen"].as_str().unwrap_or("")
        );
    }
    eprintln!(
        "package-vm: {:.0} s (boot {:.0} s, {})",
        v["wall_secs"].as_f64().unwrap_or(0.0),
        v["boot_secs"].as_f64().unwrap_or(0.0),
        v["accel"].as_str().unwrap_or("")
    );
    assert!(
        run.status.success() && checks.iter().all(|c| c["ok"] == true),
        "package-vm failed: {stderr}"
    );
    // Every step ran (a step that cannot run ends the list early).
    for name in [
        "systemctl start vmnet returns only once the agent is ready",
        "vmnet vm put vm.json: the VM's namespace, veth pair and tap",
        "Prometheus scrapes --metrics-listen: query sum(vmnet_vms{state=\"applied\"})",
        "promtool check metrics on the scrape",
        "kill -9 of the agent: guest → 192.0.2.1 ping every 50 ms through the tap",
        "SIGSTOP of the agent (watchdog): systemd restarts it",
        "apt-get install --reinstall (an upgrade): the VM's netns and tap",
        "vmnet events --follow: the drift repair",
        "journalctl -u vmnet -o json: the VM id and the operation as fields",
    ] {
        assert!(
            checks.iter().any(|c| c["name"] == name),
            "no check {name:?}: {checks:#?}"
        );
    }
}
