//! `scripts/package.sh` (no root): the `vmnet` package holds the three binaries, the systemd unit
//! running the packaged `vmnet`, the default configuration as a conffile, manual pages and
//! completions, and declares what vmnet needs at run time; the binaries as unpacked work
//! together (`vmnet` hands `config check` of the packaged file to the `vmnetd` beside it). The
//! `vmnet-guest` package holds the guest agent and its unit. The suite's debug binaries are
//! packaged (`--debug --no-build`).
#![allow(missing_docs)]

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().expect("run");
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn the_packages_hold_what_a_host_and_a_guest_install() {
    // target/debug/vmnet → target
    let target = Path::new(env!("CARGO_BIN_EXE_vmnet"))
        .parent()
        .and_then(Path::parent)
        .unwrap();
    if !target.join("debug/vmnet-guest").is_file()
        || !target.join("debug/vmnet-pool-helper").is_file()
    {
        panic!("build every binary first (cargo build --workspace --bins; scripts/test.sh does)");
    }
    let out = tempfile::tempdir().unwrap();
    let printed = run(Command::new(repo().join("scripts/package.sh"))
        .args(["--debug", "--no-build", "--out"])
        .arg(out.path())
        .env("CARGO_TARGET_DIR", target));
    let debs: Vec<&str> = printed.lines().collect();
    assert_eq!(debs.len(), 2, "{printed}");
    let (host, guest) = (debs[0], debs[1]);
    assert!(host.ends_with("/vmnet_0.1.0_amd64.deb"), "{host}");
    assert!(guest.ends_with("/vmnet-guest_0.1.0_amd64.deb"), "{guest}");

    let field = |deb: &str, f: &str| run(Command::new("dpkg-deb").args(["-f", deb, f]));
    assert_eq!(field(host, "Package").trim(), "vmnet");
    let depends = field(host, "Depends");
    for d in ["libnftables1", "nftables", "iproute2", "adduser"] {
        assert!(depends.contains(d), "Depends: {depends}");
    }
    let files = run(Command::new("dpkg-deb").args(["-c", host]));
    for f in [
        "./usr/bin/vmnet",
        "./usr/bin/vmnetd",
        "./usr/bin/vmnet-pool-helper",
        "./lib/systemd/system/vmnet.service",
        "./etc/vmnet/vmnet.toml",
        "./usr/share/man/man1/vmnet.1.gz",
        "./usr/share/man/man1/vmnet-serve.1.gz",
        "./usr/share/bash-completion/completions/vmnet",
        "./usr/share/zsh/vendor-completions/_vmnet",
        "./usr/share/fish/vendor_completions.d/vmnet.fish",
        "./usr/share/doc/vmnet/copyright",
    ] {
        assert!(
            files.lines().any(|l| l.ends_with(&format!(" {f}"))),
            "{f} missing from {files}"
        );
    }
    let info = run(Command::new("dpkg-deb").args(["-I", host, "conffiles"]));
    assert_eq!(info.trim(), "/etc/vmnet/vmnet.toml");

    let root = tempfile::tempdir().unwrap();
    run(Command::new("dpkg-deb").args(["-x", host]).arg(root.path()));
    let unit =
        std::fs::read_to_string(root.path().join("lib/systemd/system/vmnet.service")).unwrap();
    assert!(
        unit.contains("\nExecStart=/usr/bin/vmnet serve\n"),
        "{unit}"
    );
    assert!(unit.contains("\nType=notify\n"), "{unit}");
    let check = run(Command::new(root.path().join("usr/bin/vmnet"))
        .args(["config", "check", "--config"])
        .arg(root.path().join("etc/vmnet/vmnet.toml"))
        .env_remove("VMNET_SOCKET")
        .env_remove("VMNET_STATE_DIR")
        .env_remove("VMNET_DATABASE_URL"));
    assert!(check.contains("reconcile-interval-secs"), "{check}");

    let files = run(Command::new("dpkg-deb").args(["-c", guest]));
    for f in [
        "./usr/bin/vmnet-guest",
        "./lib/systemd/system/vmnet-guest.service",
    ] {
        assert!(
            files.lines().any(|l| l.ends_with(&format!(" {f}"))),
            "{f}: {files}"
        );
    }
}
