//! The binary's behaviour at its edges, without an agent or root: command-line errors in the
//! documented `error: CODE: message` shape with exit status 2, `--help`/`--version` exiting 0,
//! output into a pipe whose reader is gone ending quietly (no panic), and no lab commands (the
//! sandbox and the benchmarks are `vmnet-lab`'s), and `vmnet` handing what is not a client
//! command to `vmnetd`.
#![allow(missing_docs)]

use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Output, Stdio};

fn vmnet(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vmnet"))
        .args(args)
        .env_remove("VMNET_DATABASE_URL")
        .env_remove("VMNET_STATE_DIR")
        .env_remove("VMNET_SOCKET")
        .output()
        .expect("run vmnet")
}

/// Exit status 2, nothing on stdout, stderr starting `error: INVALID_INPUT: ` + `starts` and
/// ending with clap's hint. Returns stderr.
fn usage_error(args: &[&str], starts: &str) -> String {
    let out = vmnet(args);
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(2), "vmnet {args:?}: {stderr}");
    assert!(out.stdout.is_empty(), "vmnet {args:?}");
    let prefix = format!("error: INVALID_INPUT: {starts}");
    assert!(stderr.starts_with(&prefix), "vmnet {args:?}: {stderr}");
    assert_eq!(
        stderr.matches("error:").count(),
        1,
        "one error line: {stderr}"
    );
    assert!(
        stderr.ends_with("For more information, try '--help'.\n"),
        "vmnet {args:?}: {stderr}"
    );
    stderr
}

#[test]
fn argument_errors_use_the_documented_format_and_exit_2() {
    let e = usage_error(&["--bogus"], "unexpected argument '--bogus' found\n");
    assert!(e.contains("\nUsage: vmnet [OPTIONS] <COMMAND>\n"), "{e}");
    usage_error(
        &["--output", "yaml", "pool", "list"],
        "invalid value 'yaml' for '--output <OUTPUT>'",
    );
    usage_error(&["pool", "set", "p1"], "the following required arguments");
    usage_error(&["frobnicate"], "unrecognized subcommand 'frobnicate'");
}

#[test]
fn the_lab_commands_are_not_in_the_product() {
    for cmd in ["up", "down", "bench", "sandbox-helper"] {
        usage_error(&[cmd], &format!("unrecognized subcommand '{cmd}'"));
    }
    let out = vmnet(&["--help"]);
    let help = String::from_utf8(out.stdout).unwrap();
    assert!(
        !help.contains("sandbox") && !help.contains("bench"),
        "{help}"
    );
}

#[test]
fn a_missing_subcommand_is_invalid_input_with_the_help() {
    for args in [&[][..], &["host"]] {
        let out = vmnet(args);
        let stderr = String::from_utf8(out.stderr).unwrap();
        assert_eq!(out.status.code(), Some(2), "vmnet {args:?}: {stderr}");
        assert!(
            stderr.starts_with("error: INVALID_INPUT: a subcommand is required\n"),
            "{stderr}"
        );
        assert!(stderr.contains("Usage: vmnet"), "{stderr}");
    }
}

#[test]
fn help_and_version_exit_0_on_stdout() {
    for args in [&["--help"][..], &["host", "--help"], &["help", "pool"]] {
        let out = vmnet(args);
        assert_eq!(out.status.code(), Some(0), "vmnet {args:?}");
        let stdout = String::from_utf8(out.stdout).unwrap();
        assert!(stdout.contains("Usage: vmnet"), "{stdout}");
        assert!(out.stderr.is_empty(), "vmnet {args:?}");
    }
    let out = vmnet(&["--version"]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        format!("vmnet {}\n", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn vm_put_help_says_that_dash_reads_standard_input() {
    let out = vmnet(&["vm", "put", "--help"]);
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let flat = stdout.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        flat.contains("`-` reads it from standard input"),
        "{stdout}"
    );
}

/// `vmnet … --output json | head -5` where the reader exits first: the read end is closed
/// before the command starts, so its first write meets a pipe without a reader. The process
/// ends by SIGPIPE (as other Unix tools do), not with a "failed printing to stdout" panic.
#[test]
fn a_closed_pipe_on_stdout_ends_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().display().to_string();
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = Command::new(env!("CARGO_BIN_EXE_vmnet"))
        .args(["--state-dir", &state, "--output", "json", "pool", "list"])
        .env_remove("VMNET_DATABASE_URL")
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .expect("run vmnet");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("panicked") && !stderr.contains("Broken pipe"),
        "{stderr}"
    );
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGPIPE),
        "{:?}: {stderr}",
        out.status
    );
}

/// `vmnet` runs the client commands itself and hands the rest to `vmnetd` beside it: alone in a
/// directory it still reaches (or fails to reach) the agent, while `serve` and the IPAM commands
/// fail with `UNAVAILABLE` naming the `vmnetd` it looked for.
#[test]
fn the_client_runs_alone_and_hands_the_rest_to_vmnetd() {
    let dir = tempfile::tempdir().unwrap();
    let lone = dir.path().join("vmnet");
    if std::fs::hard_link(env!("CARGO_BIN_EXE_vmnet"), &lone).is_err() {
        std::fs::copy(env!("CARGO_BIN_EXE_vmnet"), &lone).unwrap();
    }
    let run = |args: &[&str]| {
        let out = Command::new(&lone)
            .args(args)
            .env_remove("VMNET_SOCKET")
            .output()
            .unwrap();
        (out.status.code(), String::from_utf8(out.stderr).unwrap())
    };
    let socket = dir.path().join("none.sock");
    let (code, err) = run(&["--socket", socket.to_str().unwrap(), "vm", "get", "a"]);
    assert_eq!(code, Some(6), "{err}");
    assert!(
        err.starts_with("error: UNAVAILABLE: cannot reach the agent"),
        "{err}"
    );
    for args in [&["serve"][..], &["pool", "list"], &["serve", "--help"]] {
        let (code, err) = run(args);
        assert_eq!(code, Some(6), "{args:?}: {err}");
        let want = format!("cannot run {}", dir.path().join("vmnetd").display());
        assert!(
            err.starts_with(&format!("error: UNAVAILABLE: {want}")),
            "{err}"
        );
    }
    // Beside vmnetd, a handed command is the whole command line's: its own help and flags.
    let out = vmnet(&["serve", "--help"]);
    let help = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success() && help.contains("--socket-group"),
        "{help}"
    );
    assert!(help.contains("Usage: vmnet serve"), "{help}");
}

/// A VM config is read up to the largest body the agent accepts, then refused naming the file:
/// `vm put /dev/zero` ends at once instead of reading until the memory runs out.
#[test]
fn vm_put_of_an_endless_file_is_refused_after_a_bounded_read() {
    let out = vmnet(&["vm", "put", "/dev/zero"]);
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.starts_with(
            "error: INVALID_INPUT: /dev/zero: cannot read: larger than the limit of 65536 bytes"
        ),
        "{stderr}"
    );
}

/// The events filters take a comma list as well as repeated flags, as events.md says.
#[test]
fn events_filters_take_comma_lists() {
    let out = vmnet(&["events", "--kind", "vm_applied,bogus"]);
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("invalid value 'bogus'"), "{stderr}");
    // A good list parses and gets as far as the (missing) agent.
    let out = Command::new(env!("CARGO_BIN_EXE_vmnet"))
        .args(["events", "--kind", "vm_applied,vm_deleted", "--vm", "a,b"])
        .env("VMNET_SOCKET", "/nonexistent/vmnet.sock")
        .output()
        .unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.starts_with("error: UNAVAILABLE: cannot reach the agent"),
        "{stderr}"
    );
}

/// Files the client reads are bounded and checked before any agent is asked: `mesh sync` reads
/// at most the agent's 8 MiB sync limit (`/dev/zero` is refused, not read into memory) and
/// refuses an object that repeats a key, as the agent does; output that cannot be written is an
/// error, not a panic.
#[test]
fn client_input_is_bounded_and_output_errors_are_reported() {
    let out = vmnet(&["mesh", "sync", "/dev/zero"]);
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("larger than the limit of 8388608 bytes"),
        "{stderr}"
    );
    let dir = tempfile::tempdir().unwrap();
    let dup = dir.path().join("dup.json");
    std::fs::write(&dup, r#"{"peers":[{"public_key":"a","public_key":"b"}]}"#).unwrap();
    let out = vmnet(&["mesh", "sync", dup.to_str().unwrap()]);
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("duplicate key \"public_key\""), "{stderr}");
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_vmnet"))
        .args(["completions", "bash"])
        .stdout(Stdio::from(full))
        .output()
        .unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(6), "{stderr}");
    assert!(
        stderr.starts_with("error: UNAVAILABLE: cannot write the output"),
        "{stderr}"
    );
}

/// A VM id is checked by the agent's rule before any request (an id no request line can carry
/// names the id's limit), and an error message never carries a terminal control character (a
/// key of the caller's file here; the same holds for an agent's or a provider's text).
#[test]
fn ids_are_checked_and_error_messages_carry_no_control_characters() {
    let long = "a".repeat(70_000);
    let out = vmnet(&["vm", "get", &long]);
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        &stderr[..200.min(stderr.len())]
    );
    assert!(
        stderr.contains("id is 70000 bytes, at most 64"),
        "{}",
        &stderr[..200.min(stderr.len())]
    );
    assert!(
        stderr.len() < 300,
        "the id is not echoed whole: {} bytes",
        stderr.len()
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("vm.json");
    std::fs::write(
        &file,
        "{\"id\":\"e1\",\"user_id\":170,\"tenant\":1,\"\\u001b]0;pwned\\u0007\":1}",
    )
    .unwrap();
    let out = vmnet(&["vm", "put", file.to_str().unwrap()]);
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("unknown field"), "{stderr}");
    assert!(
        !stderr.chars().any(|c| c.is_control() && c != '\n'),
        "{stderr:?}"
    );
}
