//! The binary's configuration file and generated documents, without an agent or root:
//! `vmnet config check` on the shipped example and on broken files (file, line and key in the
//! message, the documented exit status), the precedence command line > environment > file >
//! default as `config check` reports it, secrets never printed, `vmnet serve` refusing a bad
//! file before it binds anything, shell completions and manual pages.
#![allow(missing_docs)]

use std::path::Path;
use std::process::{Command, Output};

fn vmnet(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_vmnet"));
    c.args(args);
    for v in [
        "VMNET_DATABASE_URL",
        "VMNET_STATE_DIR",
        "VMNET_SOCKET",
        "VMNET_CONFIG",
    ] {
        c.env_remove(v);
    }
    c.envs(env.iter().copied());
    c.output().expect("run vmnet")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn write(dir: &Path, name: &str, body: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, body).unwrap();
    p.display().to_string()
}

/// The row of `key` in `config check`'s table: (value, from).
fn row(stdout: &str, key: &str) -> (String, String) {
    let line = stdout
        .lines()
        .find(|l| l.split_whitespace().next() == Some(key))
        .unwrap_or_else(|| panic!("no row {key}: {stdout}"));
    let cells: Vec<&str> = line.split_whitespace().collect();
    (cells[1].to_owned(), cells[2..].join(" "))
}

#[test]
fn the_shipped_example_passes_config_check() {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/vmnet.toml");
    let out = vmnet(
        &["config", "check", "--config", example.to_str().unwrap()],
        &[],
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}{stdout}", text(&out.stderr));
    assert!(stdout.contains("vmnet.toml: ok"), "{stdout}");
    let line = std::fs::read_to_string(&example)
        .unwrap()
        .lines()
        .position(|l| l.starts_with("reconcile-interval-secs ="))
        .expect("the example sets reconcile-interval-secs")
        + 1;
    let (v, from) = row(&stdout, "reconcile-interval-secs");
    assert_eq!(v, "10");
    assert!(
        from.ends_with(&format!("examples/vmnet.toml:{line}")),
        "{from}"
    );
    assert_eq!(
        row(&stdout, "wg-port"),
        ("51820".to_owned(), "default".to_owned())
    );
}

#[test]
fn command_line_beats_environment_beats_file_beats_default() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(
        dir.path(),
        "vmnet.toml",
        "state-dir = \"/from/file\"\nname-prefix = \"fil\"\n",
    );
    let check = |args: &[&str], env: &[(&str, &str)]| {
        let mut all = args.to_vec();
        all.extend(["config", "check", "--config", &f]);
        let out = vmnet(&all, env);
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stdout)
    };
    let out = check(&[], &[]);
    assert_eq!(
        row(&out, "state-dir"),
        ("/from/file".to_owned(), format!("{f}:1"))
    );
    assert_eq!(row(&out, "name-prefix").0, "fil");
    assert_eq!(
        row(&out, "socket"),
        ("/run/vmnet/vmnet.sock".to_owned(), "default".to_owned())
    );
    let env = [("VMNET_STATE_DIR", "/from/env")];
    let out = check(&[], &env);
    assert_eq!(
        row(&out, "state-dir"),
        (
            "/from/env".to_owned(),
            "environment VMNET_STATE_DIR".to_owned()
        )
    );
    let out = check(&["--state-dir", "/from/cli"], &env);
    assert_eq!(
        row(&out, "state-dir"),
        ("/from/cli".to_owned(), "command line".to_owned())
    );
    // The file named by the environment.
    let out = vmnet(&["config", "check"], &[("VMNET_CONFIG", &f)]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(row(&text(&out.stdout), "name-prefix").0, "fil");
}

#[test]
fn a_bad_file_is_refused_with_file_line_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(
        dir.path(),
        "vmnet.toml",
        "name-prefix = \"vmn\"\n\nreconcile-intervall-secs = 5\nwg-port = 99999\n",
    );
    let out = vmnet(&["config", "check", "--config", &f], &[]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(out.stdout.is_empty());
    assert!(stderr.starts_with("error: INVALID_INPUT: "), "{stderr}");
    assert!(
        stderr.contains(&format!("{f}:3: unknown key \"reconcile-intervall-secs\"")),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("{f}:4: key \"wg-port\": invalid value '99999'")),
        "{stderr}"
    );
}

/// What `serve` checks before it starts, `config check` checks too: an uplink that is not an
/// interface here (no `--netns`), and a file too large to be a configuration (`/dev/zero` is
/// refused after a bounded read, not read until the memory runs out).
#[test]
fn config_check_refuses_a_missing_uplink_and_an_endless_file() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(dir.path(), "vmnet.toml", "uplink = \"vmnxnonexist0\"\n");
    let out = vmnet(&["config", "check", "--config", &f], &[]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.starts_with("error: INVALID_INPUT: --uplink vmnxnonexist0: no interface"),
        "{stderr}"
    );
    let out = vmnet(&["config", "check", "--config", "/dev/zero"], &[]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("/dev/zero: larger than the limit of 1048576 bytes"),
        "{stderr}"
    );
}

#[test]
fn a_missing_named_file_is_not_found() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("none.toml");
    let missing = missing.to_str().unwrap();
    for out in [
        vmnet(&["config", "check", "--config", missing], &[]),
        vmnet(&["config", "check"], &[("VMNET_CONFIG", missing)]),
        vmnet(&["serve", "--config", missing], &[]),
    ] {
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{stderr}");
        assert!(
            stderr.starts_with("error: NOT_FOUND: configuration file "),
            "{stderr}"
        );
        assert!(stderr.contains(missing), "{stderr}");
    }
}

#[test]
fn serve_refuses_a_bad_file_before_it_binds_anything() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("vmnet.sock");
    let f = write(dir.path(), "vmnet.toml", "bridge = \"br1\"\n");
    let out = vmnet(
        &[
            "serve",
            "--config",
            &f,
            "--socket",
            socket.to_str().unwrap(),
        ],
        &[],
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&f) && stderr.contains("--host-id"),
        "{stderr}"
    );
    assert!(!socket.exists(), "nothing was bound");
}

#[test]
fn secrets_in_urls_are_not_printed() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(
        dir.path(),
        "vmnet.toml",
        "database-url = \"postgres://vmnet:hunter2@db.example.com/vmnet\"\n",
    );
    for args in [
        vec!["config", "check", "--config", &f],
        vec!["--output", "json", "config", "check", "--config", &f],
    ] {
        let out = vmnet(&args, &[]);
        let stdout = text(&out.stdout);
        assert!(out.status.success(), "{}", text(&out.stderr));
        assert!(!stdout.contains("hunter2"), "{stdout}");
        assert!(
            stdout.contains("postgres://vmnet:***@db.example.com/vmnet"),
            "{stdout}"
        );
    }
}

#[test]
fn config_check_prints_json_on_request() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(dir.path(), "vmnet.toml", "log-format = \"json\"\n");
    let out = vmnet(
        &["--output", "json", "config", "check", "--config", &f],
        &[],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["file"], f.as_str());
    let keys = v["keys"].as_array().unwrap();
    let lf = keys.iter().find(|k| k["key"] == "log-format").unwrap();
    assert_eq!(lf["value"], serde_json::json!(["json"]));
    assert_eq!(lf["from"], format!("{f}:1"));
}

#[test]
fn completions_for_each_shell_know_serve() {
    for shell in ["bash", "zsh", "fish"] {
        let out = vmnet(&["completions", shell], &[]);
        let script = text(&out.stdout);
        assert!(out.status.success(), "{shell}: {}", text(&out.stderr));
        assert!(script.len() > 1000, "{shell}: {script}");
        assert!(script.contains("serve"), "{shell}");
        assert!(script.contains("reconcile-interval-secs"), "{shell}");
    }
    let out = vmnet(&["completions", "tcsh"], &[]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn man_pages_are_written_for_vmnet_and_each_subcommand() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("man1");
    let out = vmnet(&["man", "--dir", out_dir.to_str().unwrap()], &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    for page in [
        "vmnet.1",
        "vmnet-serve.1",
        "vmnet-config-check.1",
        "vmnet-vm-put.1",
    ] {
        let p = out_dir.join(page);
        let roff = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{page}: {e}"));
        assert!(roff.contains(".TH "), "{page}: {roff}");
        assert!(text(&out.stdout).contains(page), "listed: {page}");
    }
    let serve = std::fs::read_to_string(out_dir.join("vmnet-serve.1")).unwrap();
    assert!(serve.contains("reconcile\\-interval\\-secs"), "{serve}");
    // Hidden internal flags stay out of the pages.
    assert!(!serve.contains("worker\\-serve"), "{serve}");
    // `man` renders it when installed (Debian's man-db).
    if let Ok(r) = Command::new("man")
        .args(["-l", "-P", "cat"])
        .arg(out_dir.join("vmnet-serve.1"))
        .env("MANWIDTH", "100")
        .output()
    {
        let rendered = text(&r.stdout);
        assert!(r.status.success(), "man -l: {}", text(&r.stderr));
        assert!(rendered.contains("--reconcile-interval-secs"), "{rendered}");
    }
}
