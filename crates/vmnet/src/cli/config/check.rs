//! `vmnet config check`: parse a configuration file, check every value as `vmnet serve` would
//! (the same parsers, the same cross-flag rules, the same checks `serve` makes before it
//! touches anything), and print what `serve` would use and where each value comes from. It
//! starts nothing, binds nothing, opens no store and changes nothing in the kernel.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches};
use serde::Serialize;
use vmnet_model::Error;

use super::{
    CONFIG_ENV, ConfigFile, DEFAULT_PATH, Key, config_path, keys, read, redact, serve_command,
    with_file,
};
use crate::full::{Cli, Command};
use crate::{Global, Output};

/// `vmnet config …`.
#[derive(Debug, clap::Subcommand)]
pub enum ConfigCmd {
    /// Check a configuration file as `vmnet serve` would, and print what it would use.
    Check(CheckArgs),
}

/// Arguments of `vmnet config check`.
#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// The configuration file (the default one is checked when it exists).
    #[arg(long, env = CONFIG_ENV, value_name = "PATH", default_value = DEFAULT_PATH)]
    pub config: PathBuf,
}

/// One key as `serve` would use it.
#[derive(Debug, Serialize)]
struct Row {
    key: String,
    /// The values (secrets in URLs replaced by `***`); empty when unset.
    value: Vec<String>,
    /// `command line`, `environment VAR`, `FILE:LINE`, `default` or `unset`.
    from: String,
}

/// What `config check` prints with `--output json`.
#[derive(Debug, Serialize)]
struct Report {
    /// The file read, if any.
    file: Option<String>,
    keys: Vec<Row>,
}

/// Runs `vmnet config check`.
///
/// # Errors
/// As `vmnet serve` would fail on the same file, flags and environment before starting:
/// `INVALID_INPUT` naming the file, line and key, or the flag; `NOT_FOUND` for a missing
/// `--config` file.
pub fn check(g: &Global, cmd: &ConfigCmd) -> Result<(), Error> {
    let ConfigCmd::Check(_) = cmd;
    let serve = serve_command();
    let root = Cli::command()
        .try_get_matches_from(std::env::args_os())
        .map_err(|e| Error::invalid(super::clap_message(&e)))?;
    let (path, explicit) = root
        .subcommand_matches("config")
        .and_then(|c| c.subcommand_matches("check"))
        .map_or_else(|| (PathBuf::from(DEFAULT_PATH), false), config_path);
    let file = read(&path, explicit, &serve)?;
    // `vmnet serve` with the global flags this command was given: the same line `serve` parses.
    let mut argv: Vec<OsString> = vec!["vmnet".into()];
    argv.extend(given_globals(&root));
    argv.push("serve".into());
    let parse = |argv: &[OsString]| {
        Cli::command()
            .try_get_matches_from(argv)
            .map_err(|e| match &file {
                Some(f) => with_file(&e, &f.path),
                None => Error::invalid(super::clap_message(&e)),
            })
    };
    let mut m = parse(&argv)?;
    let mut from_file = Vec::new();
    if let Some(f) = &file
        && let Some(("serve", sm)) = m.subcommand()
    {
        for s in f.not_given(sm, &m) {
            argv.extend(s.args.iter().map(OsString::from));
            from_file.push(s.clone());
        }
        m = parse(&argv)?;
    }
    let cli = Cli::from_arg_matches(&m).map_err(|e| Error::invalid(super::clap_message(&e)))?;
    let Command::Serve(serve_args) = &cli.command else {
        return Err(Error::internal(
            "config check: parsed as another command than serve",
        ));
    };
    // The checks `serve` makes before it touches anything; the uplink only where this command
    // runs in the agent's namespace (no `--netns`: `serve` checks it once inside).
    let checked = crate::cli::serve::preflight(&cli.global, serve_args)?;
    if serve_args.netns.is_none() {
        crate::cli::serve::check_uplink(checked.settings.uplink.as_deref())?;
    }
    let Some(("serve", sm)) = m.subcommand() else {
        return Err(Error::internal("config check: no serve matches"));
    };
    let rows: Vec<Row> = keys(&serve)
        .iter()
        .map(|k| row(k, sm, &m, file.as_ref(), &from_file))
        .collect();
    let shown = file.as_ref().map(|f| f.path.display().to_string());
    if g.output == Output::Json {
        let report = Report {
            file: shown,
            keys: rows,
        };
        let text = serde_json::to_string_pretty(&report)
            .map_err(|e| Error::internal(format!("config check: {e}")))?;
        println!("{text}");
        return Ok(());
    }
    match &shown {
        Some(p) => println!("{p}: ok"),
        None => println!(
            "{}: no such file; the flags, environment and built-in defaults: ok",
            path.display()
        ),
    }
    let cells: Vec<Vec<String>> = rows
        .into_iter()
        .map(|r| {
            let v = if r.value.is_empty() {
                "-".to_owned()
            } else {
                r.value.join(", ")
            };
            vec![r.key, v, r.from]
        })
        .collect();
    print!(
        "{}",
        vmnet_agent::table::render(&["KEY", "VALUE", "FROM"], &cells)
    );
    Ok(())
}

/// The global flags `root` was given on the command line, as `--flag=value`.
fn given_globals(root: &ArgMatches) -> Vec<OsString> {
    let cmd = Cli::command();
    let mut out = Vec::new();
    for a in cmd.get_arguments().filter(|a| a.is_global_set()) {
        let id = a.get_id().as_str();
        let (Some(long), Some(ValueSource::CommandLine)) = (a.get_long(), root.value_source(id))
        else {
            continue;
        };
        for v in root.get_raw(id).into_iter().flatten() {
            let mut s = OsString::from(format!("--{long}="));
            s.push(v);
            out.push(s);
        }
    }
    out
}

/// One key's value as `serve` would use it and where it comes from.
fn row(
    k: &Key,
    sm: &ArgMatches,
    root: &ArgMatches,
    file: Option<&ConfigFile>,
    from_file: &[super::Setting],
) -> Row {
    let m = if sm.try_contains_id(&k.id).is_ok() {
        sm
    } else {
        root
    };
    let value: Vec<String> = m
        .get_raw(&k.id)
        .into_iter()
        .flatten()
        .map(|v| redact(&v.to_string_lossy()))
        .collect();
    let from = match (from_file.iter().find(|s| s.id == k.id), file) {
        (Some(s), Some(f)) => format!("{}:{}", f.path.display(), s.line),
        _ => match m.value_source(&k.id) {
            Some(ValueSource::EnvVariable) => {
                format!("environment {}", k.env.as_deref().unwrap_or("?"))
            }
            Some(ValueSource::CommandLine) => "command line".to_owned(),
            Some(ValueSource::DefaultValue) => "default".to_owned(),
            _ => "unset".to_owned(),
        },
    };
    Row {
        key: k.name.clone(),
        value,
        from,
    }
}
