//! The agent's configuration file, `/etc/vmnet/vmnet.toml` (docs: configuration.md).
//!
//! # Design
//! The file holds flags of `vmnet serve`, one top-level key per flag, named as the long flag
//! without its `--` (`reconcile-interval-secs = 10`). The keys are not listed anywhere: they are
//! read from clap's definition of `serve` ([`keys`]), so a flag added to `ServeArgs` is a key
//! the moment it exists. A key's value is typed as TOML: a boolean for a switch (`mesh = true`),
//! a string or an integer for a flag with a value, an array of those for a flag that repeats.
//!
//! The file never decides a value itself: each setting whose flag neither the command line nor
//! the environment gave becomes that flag again (`--key=value`) appended to the command line,
//! and clap parses the whole line once more ([`parse_cli`]). Every value is therefore checked by
//! the very parser and cross-flag rules (`requires`) the command line goes through, and the
//! precedence is command line > environment > file > built-in default by construction.
//!
//! # Limitations
//! A switch set to `true` in the file cannot be turned off on the command line (a switch has no
//! `--no-…` form); take it out of the file, or point `--config` at another file.

mod check;
pub use check::{ConfigCmd, check};

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, CommandFactory, FromArgMatches};
use vmnet_model::{Error, ErrorCode};

use crate::full::Cli;

/// Where `vmnet serve` looks for its configuration file when neither `--config` nor
/// [`CONFIG_ENV`] names one; a missing file there is no error.
pub const DEFAULT_PATH: &str = "/etc/vmnet/vmnet.toml";

/// The environment variable naming the configuration file.
pub const CONFIG_ENV: &str = "VMNET_CONFIG";

/// The largest configuration file read.
pub const CONFIG_LIMIT: u64 = 1024 * 1024;

/// Long flags of `serve` that are not keys of the file: the file's own path, the client
/// commands' output format, and clap's help and version.
const NOT_KEYS: &[&str] = &["config", "output", "help", "version"];

/// What a key's value is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A switch (`--mesh`): a TOML boolean.
    Switch,
    /// One value: a TOML string or integer.
    One,
    /// A flag that repeats: a TOML array of strings or integers (or a single one).
    Many,
}

/// One key of the file: a long flag of `vmnet serve`.
#[derive(Debug, Clone)]
pub struct Key {
    /// The key, the long flag without `--`.
    pub name: String,
    /// clap's id of the argument.
    pub id: String,
    /// What its value is.
    pub kind: Kind,
    /// The environment variable that sets it, if any.
    pub env: Option<String>,
}

/// `serve` as clap defines it, global flags included.
#[must_use]
pub fn serve_command() -> clap::Command {
    let mut root = Cli::command();
    root.build();
    root.find_subcommand("serve")
        .cloned()
        .expect("vmnet has a serve command")
}

/// Every key of the file: each visible long flag of `serve` except [`NOT_KEYS`].
#[must_use]
pub fn keys(serve: &clap::Command) -> Vec<Key> {
    serve
        .get_arguments()
        .filter(|a| !a.is_hide_set())
        .filter_map(|a| {
            let long = a.get_long()?;
            if NOT_KEYS.contains(&long) {
                return None;
            }
            let kind = match a.get_action() {
                ArgAction::SetTrue => Kind::Switch,
                ArgAction::Append => Kind::Many,
                ArgAction::Set if a.get_num_args().is_some_and(|n| n.max_values() > 1) => {
                    Kind::Many
                }
                ArgAction::Set => Kind::One,
                // Counters and the like take no value a file could give.
                _ => return None,
            };
            Some(Key {
                name: long.to_owned(),
                id: a.get_id().to_string(),
                kind,
                env: a.get_env().map(|e| e.to_string_lossy().into_owned()),
            })
        })
        .collect()
}

/// One setting of the file, checked against its flag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setting {
    /// The key (the long flag without `--`).
    pub key: String,
    /// clap's id of the flag.
    pub id: String,
    /// The line of the file it is on (1-based).
    pub line: usize,
    /// The flags it stands for: `--key=value` once per value, `--key` for a switch set to
    /// `true`, nothing for one set to `false`.
    pub args: Vec<String>,
}

/// A parsed, checked configuration file.
#[derive(Debug, Clone)]
pub struct ConfigFile {
    /// Where it was read from.
    pub path: PathBuf,
    /// Its settings, in the order of the file.
    pub settings: Vec<Setting>,
}

/// Reads and checks the file at `path`. With `explicit` (named by `--config` or
/// [`CONFIG_ENV`]) a missing file is an error; otherwise it is `None`.
///
/// # Errors
/// `NOT_FOUND` for a missing explicit file; `INVALID_INPUT` naming the file (and the line and
/// key) for a file over [`CONFIG_LIMIT`] bytes, that is not TOML, an unknown key or a bad value; `UNAVAILABLE` when it
/// cannot be read.
pub fn read(
    path: &Path,
    explicit: bool,
    serve: &clap::Command,
) -> Result<Option<ConfigFile>, Error> {
    let read = std::fs::File::open(path).and_then(|f| vmnet_cli::read_at_most(f, CONFIG_LIMIT));
    let text = match read {
        Ok(bytes) => String::from_utf8(bytes).map_err(|e| {
            Error::invalid(format!(
                "configuration file {}: not UTF-8 (byte {})",
                path.display(),
                e.utf8_error().valid_up_to()
            ))
        })?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !explicit => return Ok(None),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::new(
                ErrorCode::NotFound,
                format!(
                    "configuration file {}: no such file (--config or {CONFIG_ENV})",
                    path.display()
                ),
            ));
        }
        Err(e) if e.kind() == std::io::ErrorKind::FileTooLarge => {
            return Err(Error::invalid(format!(
                "configuration file {}: {e}",
                path.display()
            )));
        }
        Err(e) => {
            return Err(Error::unavailable(format!(
                "configuration file {}: cannot read it: {e}",
                path.display()
            )));
        }
    };
    parse(path, &text, serve).map(Some)
}

/// Parses the text of a configuration file and checks every key and value against `serve`'s
/// flags, each value through the flag's own parser.
///
/// # Errors
/// `INVALID_INPUT` listing every problem as `FILE:LINE: …` with the key.
pub fn parse(path: &Path, text: &str, serve: &clap::Command) -> Result<ConfigFile, Error> {
    let shown = path.display();
    let table = toml::de::DeTable::parse(text).map_err(|e| {
        let at = e
            .span()
            .map(|s| format!(":{}", line_of(text, s.start)))
            .unwrap_or_default();
        Error::invalid(format!(
            "{shown}{at}: not valid TOML: {}",
            e.message().trim_end()
        ))
    })?;
    let keys = keys(serve);
    let mut entries: Vec<_> = table.get_ref().iter().collect();
    entries.sort_by_key(|(k, _)| k.span().start);
    let mut settings = Vec::new();
    let mut problems = Vec::new();
    for (k, v) in entries {
        let name = k.get_ref().as_ref();
        let line = line_of(text, k.span().start);
        let Some(key) = keys.iter().find(|key| key.name == name) else {
            problems.push(format!(
                "{shown}:{line}: unknown key \"{name}\"{}",
                hint(name, &keys)
            ));
            continue;
        };
        match setting(key, v.get_ref(), serve) {
            Ok(args) => settings.push(Setting {
                key: key.name.clone(),
                id: key.id.clone(),
                line,
                args,
            }),
            Err(why) => problems.push(format!("{shown}:{line}: key \"{name}\": {why}")),
        }
    }
    if problems.is_empty() {
        Ok(ConfigFile {
            path: path.to_owned(),
            settings,
        })
    } else {
        Err(Error::invalid(problems.join("; ")))
    }
}

/// The line (1-based) of byte `offset` of `text`.
fn line_of(text: &str, offset: usize) -> usize {
    text.get(..offset)
        .map_or(0, |t| t.bytes().filter(|b| *b == b'\n').count())
        + 1
}

/// A hint for an unknown key: the key spelt with `-`, or the file's shape.
fn hint(name: &str, keys: &[Key]) -> String {
    let dashed = name.replace('_', "-");
    if dashed != name && keys.iter().any(|k| k.name == dashed) {
        format!(" (keys are spelt as the flags: \"{dashed}\")")
    } else {
        " (keys are the long flags of `vmnet serve` without `--`)".to_owned()
    }
}

/// The flags one value of the file stands for, each value checked by the flag's parser.
fn setting(
    key: &Key,
    value: &toml::de::DeValue<'_>,
    serve: &clap::Command,
) -> Result<Vec<String>, String> {
    use toml::de::DeValue;
    let flag = format!("--{}", key.name);
    let values = match (key.kind, value) {
        (Kind::Switch, DeValue::Boolean(true)) => return Ok(vec![flag]),
        (Kind::Switch, DeValue::Boolean(false)) => return Ok(Vec::new()),
        (Kind::Switch, other) => {
            return Err(format!("expects true or false, not {}", type_name(other)));
        }
        (Kind::Many, DeValue::Array(items)) => items
            .iter()
            .map(|i| scalar(i.get_ref()))
            .collect::<Result<Vec<_>, _>>()?,
        (_, other) => vec![scalar(other)?],
    };
    let arg = serve
        .get_arguments()
        .find(|a| a.get_id() == key.id.as_str())
        .ok_or_else(|| format!("{flag} is not a flag of vmnet serve"))?;
    // The flag alone, with its own parser: `serve`'s cross-flag rules come with the whole line.
    let mut probe = clap::Arg::new(arg.get_id().clone())
        .long(key.name.clone())
        .action(arg.get_action().clone())
        .value_parser(arg.get_value_parser().clone());
    if let Some(n) = arg.get_num_args() {
        probe = probe.num_args(n);
    }
    if let Some(names) = arg.get_value_names() {
        probe = probe.value_names(names.to_vec());
    }
    let line: Vec<String> = values.iter().map(|v| format!("{flag}={v}")).collect();
    clap::Command::new("vmnet serve")
        .no_binary_name(true)
        .arg(probe)
        .try_get_matches_from(&line)
        .map_err(|e| {
            values
                .iter()
                .fold(clap_message(&e), |m, v| redact_in(&m, v))
        })?;
    Ok(values.into_iter().map(|v| format!("{flag}={v}")).collect())
}

/// A string or an integer as the text of a flag's value.
fn scalar(value: &toml::de::DeValue<'_>) -> Result<String, String> {
    use toml::de::DeValue;
    match value {
        DeValue::String(s) => Ok(s.to_string()),
        DeValue::Integer(i) => i128::from_str_radix(i.as_str(), i.radix())
            .map(|n| n.to_string())
            .map_err(|_| format!("integer {i} is out of range")),
        other => Err(format!(
            "expects a string or an integer, not {}",
            type_name(other)
        )),
    }
}

fn type_name(value: &toml::de::DeValue<'_>) -> &'static str {
    use toml::de::DeValue;
    match value {
        DeValue::String(_) => "a string",
        DeValue::Integer(_) => "an integer",
        DeValue::Float(_) => "a float",
        DeValue::Boolean(_) => "a boolean",
        DeValue::Datetime(_) => "a date-time",
        DeValue::Array(_) => "an array",
        DeValue::Table(_) => "a table",
    }
}

/// clap's message for a parse error, on one line and without its `error: ` prefix, usage or
/// hints.
fn clap_message(e: &clap::Error) -> String {
    let rendered = e.render().to_string();
    let body = rendered.strip_prefix("error: ").unwrap_or(&rendered);
    let body = body.split("\n\nUsage:").next().unwrap_or(body);
    let body = body
        .split("\n\nFor more information")
        .next()
        .unwrap_or(body);
    body.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Whether `m` (or `root`, for a global flag) holds a value for `id` the command line or the
/// environment gave.
fn given(id: &str, m: &ArgMatches, root: &ArgMatches) -> bool {
    [m, root].iter().any(|m| {
        matches!(
            m.try_contains_id(id).ok().and_then(|_| m.value_source(id)),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        )
    })
}

impl ConfigFile {
    /// The settings whose flags neither the command line nor the environment gave, in `m`
    /// (`serve`'s matches) and `root` (the top level's, for the global flags).
    #[must_use]
    pub fn not_given<'a>(&'a self, m: &ArgMatches, root: &ArgMatches) -> Vec<&'a Setting> {
        self.settings
            .iter()
            .filter(|s| !given(&s.id, m, root))
            .collect()
    }
}

/// Why the command line could not be parsed.
#[derive(Debug)]
pub enum ParseFailure {
    /// The command line itself (clap's error, printed with its usage).
    Usage(clap::Error),
    /// The configuration file, or the command line with its settings.
    Config(Error),
}

impl From<clap::Error> for ParseFailure {
    fn from(e: clap::Error) -> Self {
        Self::Usage(e)
    }
}

/// The configuration file `serve` (or `config check`) reads: `--config` / [`CONFIG_ENV`], or
/// [`DEFAULT_PATH`]; and whether it was named.
fn config_path(m: &ArgMatches) -> (PathBuf, bool) {
    let path = m
        .try_get_one::<PathBuf>("config")
        .ok()
        .flatten()
        .cloned()
        .unwrap_or_else(|| PathBuf::from(DEFAULT_PATH));
    let named = matches!(
        m.value_source("config"),
        Some(ValueSource::CommandLine | ValueSource::EnvVariable)
    );
    (path, named)
}

/// Parses the command line; for `vmnet serve`, with the settings of its configuration file
/// that the command line and the environment did not give.
///
/// # Errors
/// [`ParseFailure::Usage`] for the command line itself; [`ParseFailure::Config`] for the
/// file, or for a flag the file's settings break a rule with (clap's message, naming the file).
pub(crate) fn parse_cli(argv: &[OsString]) -> Result<Cli, ParseFailure> {
    let mut root = Cli::command().try_get_matches_from(argv)?;
    if let Some(("serve", m)) = root.subcommand()
        && !internal(m)
    {
        let (path, explicit) = config_path(m);
        if let Some(file) = read(&path, explicit, &serve_command()).map_err(ParseFailure::Config)? {
            let extra: Vec<OsString> = file
                .not_given(m, &root)
                .iter()
                .flat_map(|s| s.args.iter().map(OsString::from))
                .collect();
            if !extra.is_empty() {
                let mut full = argv.to_vec();
                full.extend(extra);
                root = Cli::command()
                    .try_get_matches_from(&full)
                    .map_err(|e| ParseFailure::Config(with_file(&e, &file.path)))?;
            }
        }
    }
    Ok(Cli::from_arg_matches_mut(&mut root)?)
}

/// Whether `serve` runs in an internal role (a hidden flag such as `--worker-serve` given by
/// the agent that started it): the agent read the file already, and passes what the helper
/// needs; the unprivileged worker may not even be able to read it.
fn internal(m: &ArgMatches) -> bool {
    serve_command()
        .get_arguments()
        .filter(|a| a.is_hide_set())
        .any(|a| m.value_source(a.get_id().as_str()) == Some(ValueSource::CommandLine))
}

/// A clap error for the command line with a file's settings, naming the file.
fn with_file(e: &clap::Error, path: &Path) -> Error {
    Error::invalid(format!(
        "{} (with the settings of {}): {}",
        "vmnet serve",
        path.display(),
        clap_message(e)
    ))
}

/// `value` with the password of a URL in it (`postgres://user:PASSWORD@host/db`, or a
/// `password=` query parameter) replaced by `***`: values are printed, secrets are not.
#[must_use]
pub fn redact(value: &str) -> String {
    let Ok(mut url) = url::Url::parse(value) else {
        return value.to_owned();
    };
    let mut changed = false;
    if url.password().is_some() {
        let _ = url.set_password(Some("***"));
        changed = true;
    }
    let secret = |k: &str| {
        let k = k.to_ascii_lowercase();
        ["password", "passwd", "secret", "token"]
            .iter()
            .any(|s| k.contains(s))
    };
    if url.query_pairs().any(|(k, _)| secret(&k)) {
        let pairs: Vec<(String, String)> = url
            .query_pairs()
            .map(|(k, v)| {
                let v = if secret(&k) {
                    "***".to_owned()
                } else {
                    v.into_owned()
                };
                (k.into_owned(), v)
            })
            .collect();
        url.query_pairs_mut().clear().extend_pairs(pairs);
        changed = true;
    }
    if changed {
        url.to_string()
    } else {
        value.to_owned()
    }
}

/// `message` with `value` replaced by its [`redact`]ed form.
fn redact_in(message: &str, value: &str) -> String {
    let r = redact(value);
    if r == value {
        message.to_owned()
    } else {
        message.replace(value, &r)
    }
}

#[cfg(test)]
mod tests;
