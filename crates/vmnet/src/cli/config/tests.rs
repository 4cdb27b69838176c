use std::io::Write as _;

use super::*;
use crate::full::Command;

fn file(text: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f
}

fn parse_text(text: &str) -> Result<ConfigFile, Error> {
    parse(Path::new("/etc/vmnet/vmnet.toml"), text, &serve_command())
}

fn invalid(text: &str) -> String {
    let e = parse_text(text).unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidInput, "{e}");
    e.message
}

/// `vmnet serve` parsed with `args` after `--config FILE`.
fn serve(
    f: &tempfile::NamedTempFile,
    args: &[&str],
) -> Result<crate::cli::serve::ServeArgs, String> {
    let mut argv: Vec<OsString> = ["vmnet", "serve", "--config"].map(OsString::from).to_vec();
    argv.push(f.path().into());
    argv.extend(args.iter().map(OsString::from));
    match parse_cli(&argv) {
        Ok(Cli {
            command: Command::Serve(a),
            ..
        }) => Ok(*a),
        Ok(_) => panic!("not serve"),
        Err(ParseFailure::Usage(e)) => Err(format!("usage: {e}")),
        Err(ParseFailure::Config(e)) => Err(e.to_string()),
    }
}

#[test]
fn every_visible_serve_flag_is_a_key_and_nothing_else() {
    let serve = serve_command();
    let names: Vec<String> = keys(&serve).into_iter().map(|k| k.name).collect();
    for want in [
        "reconcile-interval-secs",
        "log-format",
        "database-url",
        "state-dir",
        "socket",
        "socket-group",
        "mesh",
        "wg-port",
    ] {
        assert!(names.iter().any(|n| n == want), "{want} missing: {names:?}");
    }
    for not in [
        "config",
        "output",
        "help",
        "version",
        "pool-helper-serve",
        "worker-serve",
    ] {
        assert!(!names.iter().any(|n| n == not), "{not} is a key: {names:?}");
    }
    let visible = serve
        .get_arguments()
        .filter(|a| !a.is_hide_set())
        .filter_map(clap::Arg::get_long)
        .filter(|l| !NOT_KEYS.contains(l))
        .count();
    assert_eq!(names.len(), visible);
}

#[test]
fn an_unknown_key_names_the_file_the_line_and_the_key() {
    let m = invalid("# the agent\nname-prefix = \"vmn\"\n\nreconcile-intervall-secs = 5\n");
    assert!(
        m.contains("/etc/vmnet/vmnet.toml:4: unknown key \"reconcile-intervall-secs\""),
        "{m}"
    );
}

#[test]
fn a_key_with_underscores_is_refused_with_its_flag_spelling() {
    let m = invalid("wg_port = 51821\n");
    assert!(m.contains(":1: unknown key \"wg_port\""), "{m}");
    assert!(m.contains("\"wg-port\""), "{m}");
}

#[test]
fn a_table_is_an_unknown_key() {
    let m = invalid("mesh = true\n[mesh-settings]\nport = 1\n");
    assert!(m.contains(":2: unknown key \"mesh-settings\""), "{m}");
}

#[test]
fn every_problem_is_reported_at_once() {
    let m = invalid("a = 1\nwg-port = 70000\nmesh = \"yes\"\nprivate-mtu = 1.5\n");
    assert!(m.contains(":1: unknown key \"a\""), "{m}");
    assert!(
        m.contains(":2: key \"wg-port\": invalid value '70000'"),
        "{m}"
    );
    assert!(
        m.contains(":3: key \"mesh\": expects true or false, not a string"),
        "{m}"
    );
    assert!(
        m.contains(":4: key \"private-mtu\": expects a string or an integer, not a float"),
        "{m}"
    );
}

#[test]
fn values_go_through_the_flags_own_parsers() {
    let m = invalid("reconcile-interval-secs = 0\n");
    assert!(
        m.contains(":1: key \"reconcile-interval-secs\": invalid value '0'"),
        "{m}"
    );
    let m = invalid("transit-cidr = \"10.0.0.0/33\"\n");
    assert!(
        m.contains("key \"transit-cidr\": invalid value '10.0.0.0/33'"),
        "{m}"
    );
    let m = invalid("log-format = \"xml\"\n");
    assert!(m.contains("key \"log-format\": invalid value 'xml'"), "{m}");
    assert!(
        m.contains("text") && m.contains("json"),
        "lists the choices: {m}"
    );
    let m = invalid("name-prefix = [\"a\", \"b\"]\n");
    assert!(
        m.contains("key \"name-prefix\": expects a string or an integer, not an array"),
        "{m}"
    );
}

#[test]
fn text_that_is_not_toml_names_the_line() {
    let m = invalid("mesh = true\nwg-port = \n");
    assert!(
        m.starts_with("/etc/vmnet/vmnet.toml:2: not valid TOML"),
        "{m}"
    );
    let m = invalid("mesh = true\nmesh = false\n");
    assert!(
        m.contains("/etc/vmnet/vmnet.toml:2: not valid TOML"),
        "a repeated key: {m}"
    );
}

#[test]
fn values_become_flags() {
    let f = parse_text("wg-port = 0x1f90\nmesh = true\nno-metadata = false\nuplink = \"eth0\"\n")
        .unwrap();
    let args: Vec<_> = f.settings.iter().flat_map(|s| s.args.clone()).collect();
    assert_eq!(args, ["--wg-port=8080", "--mesh", "--uplink=eth0"]);
    let lines: Vec<_> = f
        .settings
        .iter()
        .map(|s| (s.key.as_str(), s.line))
        .collect();
    assert_eq!(
        lines,
        [
            ("wg-port", 1),
            ("mesh", 2),
            ("no-metadata", 3),
            ("uplink", 4)
        ]
    );
}

#[test]
fn the_file_gives_what_the_command_line_does_not() {
    let f = file("reconcile-interval-secs = 3\nname-prefix = \"cfg\"\nno-metadata = true\n");
    let a = serve(&f, &[]).unwrap();
    assert_eq!(a.reconcile_interval_secs, 3);
    assert_eq!(a.name_prefix, "cfg");
    assert!(a.no_metadata);
    let a = serve(&f, &["--name-prefix", "cli", "--reconcile-interval-secs=7"]).unwrap();
    assert_eq!(a.name_prefix, "cli", "the command line wins");
    assert_eq!(a.reconcile_interval_secs, 7);
    assert!(a.no_metadata, "the file's other keys still apply");
}

#[test]
fn without_the_file_the_defaults_hold() {
    let f = file("# nothing set\n");
    let a = serve(&f, &[]).unwrap();
    assert_eq!(a.name_prefix, "vmn");
    assert_eq!(a.reconcile_interval_secs, 10);
}

#[test]
fn the_files_settings_obey_the_flags_rules() {
    let f = file("bridge = \"br1\"\n");
    let e = serve(&f, &[]).unwrap_err();
    assert!(e.starts_with("INVALID_INPUT: "), "{e}");
    assert!(e.contains(&f.path().display().to_string()), "{e}");
    assert!(e.contains("--host-id"), "{e}");
    let a = serve(&f, &["--host-id", "h1"]).unwrap();
    assert_eq!(a.bridge, "br1");
}

#[test]
fn a_named_file_must_exist_the_default_need_not() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("vmnet.toml");
    let e = read(&missing, true, &serve_command()).unwrap_err();
    assert_eq!(e.code, ErrorCode::NotFound);
    assert!(e.message.contains(&missing.display().to_string()), "{e}");
    assert!(read(&missing, false, &serve_command()).unwrap().is_none());
}

#[test]
fn url_passwords_are_not_shown() {
    assert_eq!(
        redact("postgres://vmnet:hunter2@db.example.com/vmnet"),
        "postgres://vmnet:***@db.example.com/vmnet"
    );
    let r = redact("postgres://db.example.com/vmnet?user=vmnet&password=hunter2");
    assert!(!r.contains("hunter2") && r.contains("user=vmnet"), "{r}");
    assert_eq!(
        redact("sqlite:///var/lib/vmnet/vmnet.db"),
        "sqlite:///var/lib/vmnet/vmnet.db"
    );
    assert_eq!(redact("/var/lib/vmnet"), "/var/lib/vmnet");
}
