//! `vmnet-lab up --sandbox --guests kvm examples/ns-kvm.json` end to end (root, `/dev/kvm`): two real
//! Linux guests booted by qemu in their VMs' namespaces on the taps the agent made; networkd puts
//! the image's guest address on, `vmnet-guest` the mesh address and host routes from the
//! metadata service; NAT, the MSS clamp, IPv6 via host, public addresses, the mesh between the
//! guests, a large download and the public limit (iperf3 in the guest) are checked from inside
//! them, and a mesh address change and a host route change by `PUT` are applied in the running
//! guest, watched from inside it (`ip monitor` shows only the changed objects, an IPv4 ping
//! every 10 ms loses nothing), as is a restart of `vmnet-guest` (nothing changes). Wake on
//! packet: `vm-gateway`'s qemu is saved to a file and quit, a client in the fake internet
//! connects to its public address, and on the `vm_wake` event qemu restores the guest on the same
//! tap; the held SYN is delivered to the tap and the connection served (the figures, SYN
//! retransmissions among them, are printed). Then `down` stops
//! the guests by pid and leaves no namespace. The guest image is built by
//! `scripts/guest-image.sh` on first use and cached. `scripts/test.sh` skips this test (and counts
//! it skipped) on a machine without `/dev/kvm`.

use serde_json::Value;
use vmnet_testkit::{require_root, sandbox};

mod sandbox_support;
use sandbox_support::{Guard, lab};

#[test]
#[ignore = "needs root: builds network namespaces and boots qemu guests (scripts/test.sh runs it)"]
fn kvm_guests_in_the_namespace_sandbox() {
    require_root();
    assert!(
        std::path::Path::new("/dev/kvm").exists(),
        "this test needs /dev/kvm (scripts/test.sh skips it without)"
    );
    let spec = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/ns-kvm.json");
    let name = sandbox::unique_prefix("kn");
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("sandboxes");
    let root_s = root.display().to_string();
    let guard = Guard {
        name: name.clone(),
        root: root.clone(),
    };
    let out = lab(&[
        "--output",
        "json",
        "up",
        "--sandbox",
        "--guests",
        "kvm",
        spec,
        "--name",
        &name,
        "--root",
        &root_s,
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "vmnet-lab up failed: {stderr}\n{stdout}"
    );
    let v: Value = serde_json::from_str(&stdout).expect("JSON report");
    let checks = v["checks"].as_array().expect("checks");
    assert!(checks.iter().all(|c| c["ok"] == true), "{checks:#?}");
    let seen = |vm: &str, name: &str| {
        checks
            .iter()
            .find(|c| c["vm"] == vm && c["check"] == name)
            .unwrap_or_else(|| panic!("no check {name:?} of {vm}: {checks:#?}"))["seen"]
            .as_str()
            .expect("seen")
            .to_owned()
    };
    let g = "vm-gateway";
    assert_eq!(seen(g, "booted: guest address on eth0"), "172.16.0.2/30");
    assert_eq!(
        seen(g, "booted: vmnet-guest put the mesh address on eth0"),
        "fdaa:1::7/128"
    );
    assert_eq!(seen(g, "host routes from metadata"), "default, fdaa::/16");
    assert_eq!(seen(g, "ipv4 tcp echo"), "from 203.0.113.57");
    assert_eq!(seen(g, "ipv4 mss clamp"), "syn mss 1340");
    assert_eq!(seen(g, "ipv6 tcp echo"), "from 2001:db8:0:1::57");
    assert_eq!(seen(g, "public ipv4 tcp from internet"), "from 203.0.113.1");
    assert_eq!(seen(g, "mesh -> vm-isolated"), "from fdaa:1::7");
    assert_eq!(
        seen(
            g,
            "large download through the mss clamp (iperf3 in the guest)"
        ),
        "4 MiB received"
    );
    let i = "vm-isolated";
    assert_eq!(seen(i, "ipv4 tcp echo"), "no reach");
    assert_eq!(seen(i, "mesh -> vm-gateway"), "from fdaa:1::8");
    assert_eq!(
        seen(i, "mesh address change by PUT, in the running guest"),
        "fdaa:1::8008/128"
    );
    assert_eq!(
        seen(i, "mesh -> vm-isolated at its old address, from vm-gateway"),
        "no reach"
    );
    assert_eq!(seen(i, "mesh address changed back by PUT"), "fdaa:1::8/128");
    // Each change is watched from inside the guest: only what changed changes, no ping is
    // lost (all checks are ok above; here they must exist).
    for what in [
        "the mesh address change",
        "the mesh address change back",
        "the host route added",
        "the host route removed",
        "a restart of vmnet-guest",
    ] {
        for check in ["ipv4 ping every 10 ms across", "ip monitor across"] {
            let _ = seen(i, &format!("{check} {what}"));
        }
    }
    assert_eq!(
        seen(i, "ip monitor across the mesh address change"),
        "only fdaa:1::8, fdaa:1::8008"
    );
    assert_eq!(
        seen(i, "vmnet-guest restarted with unchanged metadata: drop-in"),
        "not rewritten"
    );
    // Wake on packet: vm-gateway's qemu saved and quit, a connection from the fake internet,
    // qemu restored on the vm_wake event; the held SYN delivered and the connection served (its
    // figures, the SYN retransmissions among them, are printed).
    let woke = seen(
        g,
        "wake: the first SYN sent while qemu was down reaches the restored guest",
    );
    eprintln!("wake with a restored guest: {woke}");
    for l in stderr
        .lines()
        .filter(|l| l.contains("wake with a restored guest took"))
    {
        eprintln!("{l}");
    }
    assert!(woke.ends_with("; served"), "{woke}");
    // The guests run on after `up` (the sandbox stays up) and `down` stops them by pid.
    let pids: Vec<u32> = v["vms"]
        .as_array()
        .expect("vms")
        .iter()
        .map(|r| {
            r["guest_ns"].as_str().expect("guest_ns")["qemu ".len()..]
                .parse()
                .expect("qemu pid")
        })
        .collect();
    assert_eq!(pids.len(), 2);
    assert!(
        pids.iter()
            .all(|p| std::path::Path::new(&format!("/proc/{p}")).exists()),
        "the guests stay up with the sandbox"
    );
    let down = lab(&["down", "--sandbox", "--name", &name, "--root", &root_s]);
    assert!(
        down.status.success(),
        "{}",
        String::from_utf8_lossy(&down.stderr)
    );
    // Gone, or a zombie that init reaps in a moment.
    let running = |p: &u32| {
        std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|s| {
            s.rsplit_once(") ")
                .is_some_and(|(_, r)| !r.starts_with('Z'))
        })
    };
    assert!(!pids.iter().any(running), "qemu left running after down");
    assert!(
        vmnet_sandbox::netns::list(&name).is_empty(),
        "namespaces left behind"
    );
    drop(guard);
}
