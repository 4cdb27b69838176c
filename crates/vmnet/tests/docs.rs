//! The book in `docs/` against the product, without root: every internal link and anchor
//! resolves, every page is in `SUMMARY.md`, every JSON example is tagged and parses, the API
//! page lists exactly the paths and methods of `openapi.json`, and the configuration page
//! lists exactly the flags of `vmnet serve --help`. (`kernel_docs_examples` sends the JSON
//! examples to a real agent.)
#![allow(missing_docs)]

use std::collections::BTreeSet;
use std::process::Command;

mod docs_support;
use docs_support::{JSON_TAGS, anchors, blocks, links, pages, repo, src};

/// Checks one link from `from` (a file under `base`); returns a problem or `None`.
fn check_link(base: &std::path::Path, from: &str, dest: &str) -> Option<String> {
    if dest.contains("://") || dest.starts_with("mailto:") {
        return None;
    }
    let (file, anchor) = match dest.split_once('#') {
        Some((f, a)) => (f, Some(a)),
        None => (dest, None),
    };
    let target = if file.is_empty() {
        base.join(from)
    } else {
        base.join(file)
    };
    let Ok(text) = std::fs::read_to_string(&target) else {
        return Some(format!("{from}: link {dest}: no file {}", target.display()));
    };
    if let Some(a) = anchor
        && !anchors(&text).contains(a)
    {
        return Some(format!("{from}: link {dest}: no heading with anchor #{a}"));
    }
    None
}

#[test]
fn every_internal_link_resolves() {
    let base = src();
    let mut problems = Vec::new();
    for (page, text) in pages() {
        for dest in links(&text) {
            problems.extend(check_link(&base, &page, &dest));
        }
    }
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    for dest in links(&readme) {
        problems.extend(check_link(&repo(), "README.md", &dest));
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn a_broken_link_or_anchor_is_found() {
    let base = src();
    assert!(check_link(&base, "api.md", "no-such-page.md").is_some());
    assert!(check_link(&base, "api.md", "cli.md#no-such-heading").is_some());
    assert!(check_link(&base, "api.md", "#conventions").is_none());
    assert!(check_link(&base, "api.md", "https://example.com/x").is_none());
}

#[test]
fn every_page_is_in_the_summary() {
    let summary = std::fs::read_to_string(src().join("SUMMARY.md")).unwrap();
    let listed: BTreeSet<String> = links(&summary).into_iter().collect();
    let present: BTreeSet<String> = pages()
        .into_iter()
        .map(|(p, _)| p)
        .filter(|p| p != "SUMMARY.md")
        .collect();
    let missing: Vec<_> = present.difference(&listed).collect();
    assert!(missing.is_empty(), "pages not in SUMMARY.md: {missing:?}");
}

#[test]
fn every_json_example_is_tagged_and_parses() {
    let mut problems = Vec::new();
    for b in blocks() {
        let mut parts = b.info.split(',').map(str::trim);
        if parts.next() != Some("json") {
            continue;
        }
        let tag = parts.next().unwrap_or("");
        if !JSON_TAGS.contains(&tag) || parts.next().is_some() {
            problems.push(format!(
                "{}: ```{} needs one tag of {JSON_TAGS:?}",
                b.page, b.info
            ));
        }
        if let Err(e) = serde_json::from_str::<serde_json::Value>(&b.text) {
            problems.push(format!("{}: ```{}: not JSON: {e}", b.page, b.info));
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn the_api_page_lists_exactly_the_openapi_paths() {
    let spec: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("crates/vmnet-agent/openapi.json")).unwrap(),
    )
    .unwrap();
    let mut want = BTreeSet::new();
    for (path, item) in spec["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            if ["get", "put", "post", "delete", "patch"].contains(&method.as_str()) {
                want.insert(format!("{} {path}", method.to_uppercase()));
            }
        }
    }
    let page = std::fs::read_to_string(src().join("api.md")).unwrap();
    // Rows of the endpoint tables: | `GET` | `/v1/vms` | … |
    let documented: BTreeSet<String> = page
        .lines()
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let method = cells.get(1)?.strip_prefix('`')?.strip_suffix('`')?;
            let path = cells.get(2)?.strip_prefix('`')?.strip_suffix('`')?;
            path.starts_with('/').then(|| format!("{method} {path}"))
        })
        .collect();
    let undocumented: Vec<_> = want.difference(&documented).collect();
    let unknown: Vec<_> = documented.difference(&want).collect();
    assert!(
        undocumented.is_empty() && unknown.is_empty(),
        "in openapi.json, not in api.md: {undocumented:?}; in api.md, not in openapi.json: {unknown:?}"
    );
}

#[test]
fn the_configuration_page_lists_exactly_the_serve_flags() {
    let out = Command::new(env!("CARGO_BIN_EXE_vmnet"))
        .args(["serve", "--help"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    let flag = |l: &str| -> Option<String> {
        let f: String = l
            .trim_start()
            .strip_prefix("--")?
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
            .collect();
        (!f.is_empty()).then(|| format!("--{f}"))
    };
    // Option lines of the help start with six spaces and `--` (`-h, --help` excepted).
    let want: BTreeSet<String> = help
        .lines()
        .filter(|l| l.starts_with("      --"))
        .filter_map(flag)
        .collect();
    let page = std::fs::read_to_string(src().join("configuration.md")).unwrap();
    let documented: BTreeSet<String> = page
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(flag)
        .collect();
    assert!(want.len() > 20, "{want:?}");
    let undocumented: Vec<_> = want.difference(&documented).collect();
    let unknown: Vec<_> = documented.difference(&want).collect();
    assert!(
        undocumented.is_empty() && unknown.is_empty(),
        "in --help, not in configuration.md: {undocumented:?}; in configuration.md, not in --help: {unknown:?}"
    );
}

/// Every configuration file the book shows (```toml) passes `vmnet config check`.
#[test]
fn the_books_configuration_files_pass_config_check() {
    let files: Vec<_> = blocks().into_iter().filter(|b| b.info == "toml").collect();
    assert!(!files.is_empty(), "the book shows a configuration file");
    let dir = tempfile::tempdir().unwrap();
    for (i, b) in files.iter().enumerate() {
        let file = dir.path().join(format!("vmnet{i}.toml"));
        std::fs::write(&file, &b.text).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_vmnet"))
            .args(["config", "check", "--config"])
            .arg(&file)
            .env_remove("VMNET_STATE_DIR")
            .env_remove("VMNET_SOCKET")
            .env_remove("VMNET_DATABASE_URL")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}: vmnet config check: {}",
            b.page,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The agent's unit in the book is `packaging/vmnet.service`, byte for byte: what the docs show
/// is what a host installs.
#[test]
fn the_books_agent_unit_is_the_packaged_one() {
    let unit = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../packaging/vmnet.service"),
    )
    .unwrap();
    let shown: Vec<_> = blocks()
        .into_iter()
        .filter(|b| b.info == "ini,systemd-unit" && b.page.ends_with("install.md"))
        .collect();
    assert_eq!(shown.len(), 1, "install.md shows the agent's unit once");
    assert_eq!(
        shown[0].text, unit,
        "install.md's unit differs from packaging/vmnet.service"
    );
    for key in [
        "Type=notify",
        "NotifyAccess=main",
        "WatchdogSec=",
        "Restart=on-failure",
        "KillMode=process",
        "CapabilityBoundingSet=",
    ] {
        assert!(unit.contains(key), "the unit sets {key}");
    }
}

/// Every systemd unit the book shows (```ini,systemd-unit) passes `systemd-analyze verify`, with
/// its `/usr/local/bin/vmnet` standing for the `vmnet` this suite built: no unknown key, no
/// setting systemd cannot parse.
#[test]
fn the_books_systemd_units_pass_systemd_analyze() {
    let units: Vec<_> = blocks()
        .into_iter()
        .filter(|b| b.info == "ini,systemd-unit")
        .collect();
    assert!(!units.is_empty(), "the book shows the agent's unit");
    let dir = tempfile::tempdir().unwrap();
    for (i, b) in units.iter().enumerate() {
        assert!(
            b.text.contains("/usr/local/bin/vmnet "),
            "{}: runs the installed vmnet",
            b.page
        );
        let file = dir.path().join(format!("vmnet-doc{i}.service"));
        let text = b.text.replace(
            "/usr/local/bin/vmnet ",
            &format!("{} ", env!("CARGO_BIN_EXE_vmnet")),
        );
        std::fs::write(&file, text).unwrap();
        let out = Command::new("systemd-analyze")
            .args(["verify", "--man=no"])
            .arg(&file)
            .output()
            .expect("systemd-analyze (Debian's systemd package)");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && err.trim().is_empty(),
            "{}: systemd-analyze verify: {err}",
            b.page
        );
    }
}
