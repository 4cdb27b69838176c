//! `vmnet-lab up --sandbox --guests kvm examples/pool-kvm.json` end to end (root, `/dev/kvm`): three
//! real Linux guests booted by qemu on the taps the agent made, with the qemu arguments of
//! `GET /v1/instances/{id}/nics` and the agent's NoCloud seed; real cloud-init configures the
//! lease, the default route and the nameservers; reachability by policy and the spoof attempts
//! of a real guest are checked from inside the guests. The guest image is built by
//! `scripts/guest-image.sh` on first use and cached (`/var/cache/vmnet-guest`).
//! `scripts/test.sh` skips this test (and counts it skipped) on a machine without `/dev/kvm`.

use std::process::Command;

#[test]
#[ignore = "needs root: builds network namespaces and boots qemu guests (scripts/test.sh runs it)"]
fn kvm_guests_in_the_pool_sandbox() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test needs root (it creates network namespaces)"
    );
    assert!(
        std::path::Path::new("/dev/kvm").exists(),
        "this test needs /dev/kvm (scripts/test.sh skips it without)"
    );
    let spec = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/pool-kvm.json");
    let name = format!("kq{:06x}", std::process::id() & 0xff_ffff);
    let out = Command::new(env!("CARGO_BIN_EXE_vmnet-lab"))
        .args([
            "--output",
            "json",
            "up",
            "--sandbox",
            "--guests",
            "kvm",
            spec,
        ])
        .args(["--name", &name])
        .output()
        .expect("run vmnet-lab");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "vmnet-lab up failed: {stderr}\n{stdout}"
    );
    let v: serde_json::Value = serde_json::from_str(&stdout).expect("JSON report");
    let checks = v["checks"].as_array().unwrap();
    assert!(checks.iter().all(|c| c["ok"] == true), "{checks:#?}");
    let seen = |name: &str| {
        checks
            .iter()
            .find(|c| c["name"].as_str().unwrap().contains(name))
            .unwrap_or_else(|| panic!("no check {name:?}: {checks:#?}"))["seen"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    assert_eq!(seen("web-1: booted, cloud-init finished"), "status: done");
    assert_eq!(
        seen("web-2: cloud-init put the lease on eth0"),
        "10.0.0.3/29"
    );
    assert_eq!(seen("jail-1: default route"), "via 10.0.0.1");
    // Dual-stack (examples/pool-kvm.json adds fd00:10::/64): cloud-init brings up both.
    assert_eq!(
        seen("web-2: cloud-init put the IPv6 lease on eth0"),
        "fd00:10::3/64"
    );
    assert_eq!(seen("web-1: IPv6 default route"), "via fd00:10::1");
    assert_eq!(seen("web-1 (public) → ipv6 gateway fd00:10::1"), "passes");
    assert_eq!(seen("jail-1 (none) → ipv6 gateway"), "dropped");
    assert_eq!(seen("web-1 → fd00:10::3 over IPv6"), "passes");
    assert_eq!(seen("web-1: nameservers"), "10.0.0.1");
    assert_eq!(seen("jail-1 (none) → gateway"), "dropped");
    assert_eq!(seen("web-1 (public) → internet"), "passes");
    assert_eq!(seen("web-1 → web-2, from the guest"), "passes");
    assert_eq!(seen("honest UDP from its own address"), "arrives");
    assert_eq!(seen("foreign address"), "dropped");
    assert_eq!(seen("forged ARP reply"), "dropped");
    assert_eq!(seen("honest ARP reply"), "arrives");
    assert_eq!(seen("DHCP server"), "dropped");
    assert_eq!(seen("router advertisement"), "dropped");
    assert_eq!(
        seen("teardown: instances deleted through the API"),
        "0 taps, 0 elements"
    );
    assert!(
        vmnet_sandbox::netns::list(&name).is_empty(),
        "namespaces left behind"
    );
}
