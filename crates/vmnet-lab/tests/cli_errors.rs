//! The lab binary at its edges: command-line errors in the documented `error: CODE: message`
//! shape with exit status 2 (the same code as `vmnet`'s, shared in `vmnet-cli`),
//! `--help`/`--version` exiting 0, `vmnet-lab bench nft`'s bounds and its clean stop on
//! SIGINT/SIGTERM (root), and a missing `vmnet` binary named in the error.
#![allow(missing_docs)]

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const LAB: &str = env!("CARGO_BIN_EXE_vmnet-lab");

fn lab(args: &[&str]) -> Output {
    Command::new(LAB)
        .args(args)
        .env_remove("VMNET_BIN")
        .output()
        .expect("run vmnet-lab")
}

/// Exit status 2, nothing on stdout, stderr starting `error: INVALID_INPUT: ` + `starts` and
/// ending with clap's hint.
fn usage_error(args: &[&str], starts: &str) {
    let out = lab(args);
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(2), "vmnet-lab {args:?}: {stderr}");
    assert!(out.stdout.is_empty(), "vmnet-lab {args:?}");
    let prefix = format!("error: INVALID_INPUT: {starts}");
    assert!(stderr.starts_with(&prefix), "vmnet-lab {args:?}: {stderr}");
    assert_eq!(stderr.matches("error:").count(), 1, "{stderr}");
    assert!(
        stderr.ends_with("For more information, try '--help'.\n"),
        "vmnet-lab {args:?}: {stderr}"
    );
}

#[test]
fn argument_errors_use_the_documented_format_and_exit_2() {
    usage_error(&["--bogus"], "unexpected argument '--bogus' found\n");
    usage_error(&["serve"], "unrecognized subcommand 'serve'");
    usage_error(&["up", "--name"], "a value is required for '--name <NAME>'");
    // `bench nft` is bounded: refused before anything runs (no root needed).
    usage_error(
        &["bench", "nft", "--reps", "0"],
        "invalid value '0' for '--reps <REPS>': 0 is not in 1..=10000",
    );
    usage_error(
        &["bench", "nft", "--sizes", "10,20001"],
        "invalid value '20001' for '--sizes <SIZES>': 20001 is not in 1..=20000",
    );
    let out = lab(&[]);
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.starts_with("error: INVALID_INPUT: a subcommand is required\n"),
        "{stderr}"
    );
}

#[test]
fn help_and_version_exit_0_on_stdout() {
    let out = lab(&["--help"]);
    assert_eq!(out.status.code(), Some(0));
    let help = String::from_utf8(out.stdout).unwrap();
    assert!(help.contains("Usage: vmnet-lab"), "{help}");
    for cmd in ["up", "down", "bench"] {
        assert!(help.contains(&format!("\n  {cmd} ")), "{cmd}: {help}");
    }
    assert!(!help.contains("sandbox-helper"), "hidden: {help}");
    let out = lab(&["--version"]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        format!("vmnet-lab {}\n", env!("CARGO_PKG_VERSION"))
    );
}

/// `VMNET_BIN` (or `--vmnet PATH`) naming no file: `up` refuses with UNAVAILABLE (exit 6),
/// naming the path, before it builds anything.
#[test]
#[ignore = "needs root: `up --sandbox` checks for root first (scripts/test.sh runs it)"]
fn a_missing_vmnet_binary_is_named() {
    vmnet_testkit::require_root();
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no-vmnet");
    let root = tmp.path().join("root");
    let name = vmnet_testkit::sandbox::unique_prefix("mv");
    let out = Command::new(LAB)
        .args(["up", "--sandbox", "--name", &name, "--root"])
        .arg(&root)
        .env("VMNET_BIN", &missing)
        .output()
        .expect("run vmnet-lab");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(6), "{stderr}");
    assert!(
        stderr.contains(&format!("the vmnet binary {}", missing.display())),
        "{stderr}"
    );
    assert!(vmnet_testkit::sandbox::owned(&name).is_empty());
}

/// Deletes the named namespace when dropped (what a killed bench would leave).
struct NetnsCleanup(String);

impl Drop for NetnsCleanup {
    fn drop(&mut self) {
        let _ = vmnet_testkit::netns::delete(&self.0);
    }
}

/// `vmnet-lab bench nft` stopped by SIGINT or SIGTERM mid-run: it ends with UNAVAILABLE
/// (exit 6) and deletes its namespace `vmbn<pid>k<K>` instead of dying and leaving it.
#[test]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
fn bench_nft_stops_on_sigint_and_sigterm_and_deletes_its_namespace() {
    vmnet_testkit::require_root();
    for (signal, k) in [(libc::SIGINT, "4999"), (libc::SIGTERM, "4998")] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_vmnet-lab"))
            .args(["bench", "nft", "--sizes", k, "--reps", "10000"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run vmnet-lab bench nft");
        let ns = format!("vmbn{}k{k}", child.id());
        let _cleanup = NetnsCleanup(ns.clone());
        let deadline = Instant::now() + Duration::from_secs(30);
        while !vmnet_testkit::netns::exists(&ns) {
            if Instant::now() > deadline || child.try_wait().unwrap().is_some() {
                let _ = child.kill();
                let out = child.wait_with_output().unwrap();
                panic!(
                    "{ns} never appeared: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(300));
        let pid = i32::try_from(child.id()).unwrap();
        // SAFETY: `pid` is the child this test spawned and has not reaped yet.
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
        let deadline = Instant::now() + Duration::from_secs(20);
        while child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("signal {signal}: the bench did not stop");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(6), "signal {signal}: {stderr}");
        assert_eq!(
            stderr, "error: UNAVAILABLE: bench nft: stopped by SIGINT/SIGTERM\n",
            "signal {signal}"
        );
        assert!(out.stdout.is_empty());
        assert!(!vmnet_testkit::netns::exists(&ns), "{ns} is deleted");
    }
}
