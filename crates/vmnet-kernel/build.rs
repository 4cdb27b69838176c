//! Compiles each BPF program `bpf/<stem>.bpf.c` with clang into `$OUT_DIR/<stem>.o` (the tap
//! guard, the mesh data plane, the packet-activity recorder, and any program added later). Needs Debian's `clang` and
//! `libbpf-dev` (`scripts/install-deps.sh` installs them).

use std::path::{Path, PathBuf};
use std::process::Command;

fn build_one(src: &Path, out: &Path, include: &str) {
    let status = Command::new("clang")
        .args([
            "-O2", "-g", "-Wall", "-Werror", "-target", "bpf", include, "-c",
        ])
        .arg(src)
        .arg("-o")
        .arg(out)
        .status();
    let name = src.display();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("clang failed to compile {name} ({s}); is libbpf-dev installed?"),
        Err(e) => panic!(
            "cannot run clang ({e}) for {name}: the BPF programs need Debian's clang and \
             libbpf-dev (run scripts/install-deps.sh)"
        ),
    }
}

fn main() {
    println!("cargo:rerun-if-changed=bpf");
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let include = format!("-I/usr/include/{arch}-linux-gnu");
    let mut sources: Vec<(PathBuf, String)> = std::fs::read_dir("bpf")
        .expect("list bpf/")
        .filter_map(|e| {
            let path = e.expect("a bpf/ entry").path();
            let stem = path
                .file_name()?
                .to_str()?
                .strip_suffix(".bpf.c")?
                .to_owned();
            Some((path, stem))
        })
        .collect();
    sources.sort();
    for (src, stem) in &sources {
        println!("cargo:rerun-if-changed={}", src.display());
        build_one(src, &out_dir.join(format!("{stem}.o")), &include);
    }
}
