//! Compiles the tap guard's BPF program (`bpf/tap_guard.bpf.c`) with clang into `$OUT_DIR`.
//! Needs Debian's `clang` and `libbpf-dev` (`scripts/install-deps.sh` installs them).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let src = "bpf/tap_guard.bpf.c";
    println!("cargo:rerun-if-changed={src}");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("tap_guard.o");
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let multiarch = format!("-I/usr/include/{arch}-linux-gnu");
    let status = Command::new("clang")
        .args([
            "-O2", "-g", "-Wall", "-Werror", "-target", "bpf", &multiarch, "-c", src, "-o",
        ])
        .arg(&out)
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("clang failed to compile {src} ({s}); is libbpf-dev installed?"),
        Err(e) => panic!(
            "cannot run clang ({e}): the tap guard's BPF program needs Debian's clang and \
             libbpf-dev (run scripts/install-deps.sh)"
        ),
    }
}
