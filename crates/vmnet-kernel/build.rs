//! Compiles every BPF program `bpf/<stem>.bpf.c` with clang into `$OUT_DIR/<stem>.o` (the tap
//! guard, the packet-activity recorder, and whatever joins them). Needs Debian's `clang` and
//! `libbpf-dev` (`scripts/install-deps.sh` installs them).

use std::path::{Path, PathBuf};
use std::process::Command;

fn compile(src: &Path, out: &Path, multiarch: &str) {
    let shown = src.display();
    let status = Command::new("clang")
        .args([
            "-O2", "-g", "-Wall", "-Werror", "-target", "bpf", multiarch, "-c",
        ])
        .arg(src)
        .arg("-o")
        .arg(out)
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("clang failed to compile {shown} ({s}); is libbpf-dev installed?"),
        Err(e) => panic!(
            "cannot run clang ({e}) for {shown}: the BPF programs need Debian's clang and \
             libbpf-dev (run scripts/install-deps.sh)"
        ),
    }
}

fn main() {
    println!("cargo:rerun-if-changed=bpf");
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let multiarch = format!("-I/usr/include/{arch}-linux-gnu");
    let mut sources: Vec<PathBuf> = std::fs::read_dir("bpf")
        .expect("read bpf/")
        .map(|e| e.expect("bpf/ entry").path())
        .filter(|p| p.to_str().is_some_and(|s| s.ends_with(".bpf.c")))
        .collect();
    sources.sort();
    for src in &sources {
        println!("cargo:rerun-if-changed={}", src.display());
        let name = src
            .file_name()
            .and_then(|n| n.to_str())
            .expect("utf-8 name");
        let stem = name.strip_suffix(".bpf.c").expect("filtered on the suffix");
        compile(src, &out_dir.join(format!("{stem}.o")), &multiarch);
    }
}
