//! The source check of the mesh's VM-side program (root required), run by the kernel on frames
//! (`BPF_PROG_TEST_RUN`) against a lab host's real maps: vmnet's build drops a VM's packet with
//! another mesh address as its source, to a mesh address and to outside the mesh, and counts
//! it; the build without the check (`MeshPlane::load_without_source_check`, only for the cost
//! bench) passes the same frames, so the bench's comparison measures the check. The honest
//! frame passes both. The spoof with the real guest and tap is the fleet job's hostile block.

use std::net::Ipv6Addr;

use vmnet_kernel::mesh::{MeshPlane, Side};
use vmnet_testkit::mesh_lab::{MeshLab, VM_MTU};

const PASS: i32 = -1;
const DROP: i32 = 2;

/// An Ethernet frame with a minimal IPv6/UDP packet from `src` to `dst`.
fn frame(src: Ipv6Addr, dst: Ipv6Addr) -> Vec<u8> {
    let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x06, 0, 0xac, 0x10, 0, 2, 0x86, 0xdd];
    let mut ip = vec![0u8; 48];
    ip[0] = 0x60;
    ip[5] = 8; // payload length
    ip[6] = 17; // UDP
    ip[7] = 64;
    ip[8..24].copy_from_slice(&src.octets());
    ip[24..40].copy_from_slice(&dst.octets());
    ip[44..46].copy_from_slice(&8u16.to_be_bytes());
    f.extend_from_slice(&ip);
    f
}

#[test]
#[ignore = "needs root: builds network namespaces, loads BPF programs"]
fn the_vm_side_program_drops_another_mesh_source_unless_built_without_the_check() {
    vmnet_testkit::require_root();
    let lab = MeshLab::new(1).expect("lab");
    let mesh = |vm| Ipv6Addr::new(0xfdaa, 1, 0, 0, 0, 0, 0, vm);
    let a = lab.add_vm(0, 1, 1, mesh(1), VM_MTU).expect("a");
    let b = lab.add_vm(0, 2, 1, mesh(2), VM_MTU).expect("b");
    for vm in [&a, &b] {
        lab.publish(vm).expect("publish");
    }
    let host = &lab.hosts[0];
    let unchecked = MeshPlane::load_without_source_check(Some(&host.net.ns), host.plane.pin_root())
        .expect("the build without the check");
    let verdict = |plane: &MeshPlane, f: &[u8]| {
        plane
            .test_run(Side::FromVm, &a.veth, f, 1)
            .expect("test run")
            .verdict
    };
    let spoofs = || host.plane.drops().expect("drops")["spoofed_source"];
    let outside = Ipv6Addr::new(0x2001, 0xdb8, 0x5c, 0, 0, 0, 0, 1);
    let honest = frame(a.mesh, b.mesh);
    let as_b = frame(b.mesh, b.mesh);
    let as_b_outside = frame(b.mesh, outside);

    assert_eq!(verdict(&host.plane, &honest), PASS, "honest, vmnet's build");
    assert_eq!(
        verdict(&unchecked, &honest),
        PASS,
        "honest, without the check"
    );
    let before = spoofs();
    assert_eq!(
        verdict(&host.plane, &as_b),
        DROP,
        "as b to b, vmnet's build"
    );
    assert_eq!(
        verdict(&host.plane, &as_b_outside),
        DROP,
        "as b to outside, vmnet's build"
    );
    assert_eq!(spoofs(), before + 2, "both spoofs counted");
    assert_eq!(
        verdict(&unchecked, &as_b),
        PASS,
        "as b to b, without the check"
    );
    assert_eq!(
        verdict(&unchecked, &as_b_outside),
        PASS,
        "as b to outside, without the check"
    );
    assert_eq!(spoofs(), before + 2, "nothing counted without the check");
}
