//! Other builds of vmnet's BPF programs, compiled at test time with clang (as the kernel
//! crate's build script compiles the shipped ones): a test can run a build that differs from
//! the one embedded in the binary, as a host running an older vmnet does.

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// The mesh data plane (`crates/vmnet-kernel/bpf/mesh.bpf.c`) compiled with the extra clang
/// arguments `defines` (e.g. `-DOUTER_HOP_LIMIT=63`): an ELF object for
/// `vmnet_kernel::mesh::MeshPlane::load_object`.
///
/// # Panics
/// When clang is missing or the compilation fails.
#[must_use]
pub fn mesh_object(defines: &[&str]) -> Vec<u8> {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../vmnet-kernel/bpf/mesh.bpf.c");
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let out = std::env::temp_dir().join(format!("vmnet-mesh-{}-{n}.o", std::process::id()));
    let arch = std::env::consts::ARCH;
    let status = Command::new("clang")
        .args(["-O2", "-g", "-Wall", "-Werror", "-target", "bpf"])
        .arg(format!("-I/usr/include/{arch}-linux-gnu"))
        .args(defines)
        .arg("-c")
        .arg(&src)
        .arg("-o")
        .arg(&out)
        .status()
        .unwrap_or_else(|e| panic!("clang for {}: {e}", src.display()));
    assert!(
        status.success(),
        "clang {defines:?} {}: {status}",
        src.display()
    );
    let bytes = std::fs::read(&out).unwrap_or_else(|e| panic!("{}: {e}", out.display()));
    let _ = std::fs::remove_file(&out);
    bytes
}
