//! The command-line edge shared by the `vmnet` binary (what a host runs) and the `vmnet-lab`
//! binary (sandbox and benchmarks): the `--output` format, how an error is printed and which exit
//! status it ends with, and the process set-up both do first thing in `main`.
//!
//! Errors print once, as `error: CODE: message` on stderr, and the process exits with the code's
//! documented exit status ([`vmnet_model::ErrorCode::exit_code`]).

use std::process::ExitCode;

use clap::ValueEnum;
use vmnet_model::{Error, ErrorCode};

/// How results are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum Output {
    /// A human table (the default).
    #[default]
    Table,
    /// JSON, one document per command.
    Json,
}

/// Restores the default `SIGPIPE` disposition (terminate), which the Rust runtime sets to
/// ignore: a short-lived client command (`vmnet … --output json | head -5`) then ends quietly
/// when the reader goes away, as other Unix tools do, instead of panicking in `println!` on
/// `EPIPE`. Call it first thing in `main`, before any thread exists; a long-running command
/// then calls [`ignore_sigpipe`].
pub fn restore_sigpipe() {
    // SAFETY: called first thing in `main`, while the process has one thread and no signal
    // handlers of its own; `SIG_DFL` is a valid disposition for `SIGPIPE` and the call touches
    // no memory.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Ignores `SIGPIPE` again, for a command that runs for long and talks to peers that may
/// vanish (the agent's API clients, the pool helper, the metadata worker, wireguard-go; the
/// lab's agents and helpers): it must outlive them, so a write to a peer that hung up is an
/// error for that peer (`EPIPE`), never the end of the process. Call it on the main thread
/// before any other thread exists, so every thread and every child inherits it.
pub fn ignore_sigpipe() {
    // SAFETY: called on the main thread before the runtime (or any other thread) starts;
    // `SIG_IGN` is a valid disposition for `SIGPIPE` and the call touches no memory.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
}

/// Raises the soft limit of open files (`RLIMIT_NOFILE`) to the hard limit. The agent (and a
/// bench running its driver) keeps descriptors per VM — the metadata listener and the nf_tables
/// generation socket of each VM netns — so 1,000 VMs take over 2,000, past the soft limit of
/// 1,024 a service manager usually sets. A failure leaves the limit as it was (logged later by
/// whatever runs out).
pub fn raise_nofile_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE)
        && soft < hard
    {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}

/// Reports a command-line parsing error in the documented shape: `--help` and `--version`
/// print as clap prints them and exit 0; anything else prints
/// `error: INVALID_INPUT: <clap's message>` followed by clap's usage and `--help` hint on
/// stderr (a missing subcommand: `error: INVALID_INPUT: a subcommand is required` and the
/// help), and exits with INVALID_INPUT's exit status (2).
#[must_use]
pub fn usage_error(e: &clap::Error) -> Status {
    use clap::error::ErrorKind;
    if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
        // Help that cannot be written (a full disk) is an error like any other output's.
        return match e
            .print()
            .and_then(|()| std::io::Write::flush(&mut std::io::stdout()))
        {
            Ok(()) => Status::SUCCESS,
            Err(err) => report(&Error::unavailable(format!(
                "cannot write the output: {err}"
            ))),
        };
    }
    let rendered = e.render().to_string();
    to_stderr(&usage_text(e.kind(), &rendered));
    exit_status(ErrorCode::InvalidInput)
}

/// The text [`usage_error`] prints for a parse error of `kind` that clap rendered as `rendered`.
fn usage_text(kind: clap::error::ErrorKind, rendered: &str) -> String {
    let text = if kind == clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
        // `vmnet` or `vmnet host` alone: clap renders the help; say what is missing first.
        format!("a subcommand is required\n\n{rendered}")
    } else {
        rendered
            .strip_prefix("error: ")
            .unwrap_or(rendered)
            .to_owned()
    };
    let newline = if text.ends_with('\n') { "" } else { "\n" };
    format!("error: {}: {text}{newline}", ErrorCode::InvalidInput)
}

/// Prints `error: CODE: message` on stderr and returns the code's exit status.
#[must_use]
pub fn report(e: &Error) -> Status {
    to_stderr(&format!("error: {}\n", printable(&e.to_string())));
    exit_status(e.code)
}

/// `text` with its control characters but the line end escaped (`\u{1b}`, `\r`): an error
/// message may carry text from elsewhere (an agent's answer, a provider's, a file's key), which
/// must not move the terminal's cursor or set its title. Line ends stay: some messages quote a
/// log's last lines.
#[must_use]
pub fn printable(text: &str) -> String {
    let escaped = |c: char| c.is_control() && c != '\n';
    if !text.chars().any(escaped) {
        return text.to_owned();
    }
    text.chars()
        .map(|c| {
            if escaped(c) {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// Writes `args` to standard output: a command's output that cannot be written (a full disk,
/// a closed descriptor) is an error the command reports, not a panic.
///
/// # Errors
/// `UNAVAILABLE` naming the cause.
pub fn out(args: std::fmt::Arguments<'_>) -> Result<(), Error> {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_fmt(args)
        .and_then(|()| stdout.flush())
        .map_err(|e| Error::unavailable(format!("cannot write the output: {e}")))
}

/// [`out`] with a newline: `outln!("{x}")?` where `println!` would panic on a write error.
#[macro_export]
macro_rules! outln {
    () => {
        $crate::out(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::out(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// Writes `text` to stderr in one write, so lines of clients sharing a terminal or a log do not
/// interleave (`eprint!` writes each formatted piece on its own).
pub fn to_stderr(text: &str) {
    use std::io::Write as _;
    // Nothing useful is left to do when stderr is gone.
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}

/// Reads `r` to its end, at most `limit` bytes: a longer input is an
/// [`std::io::ErrorKind::FileTooLarge`] error, and nothing past `limit + 1` bytes is read (a
/// file such as `/dev/zero` cannot fill the memory).
///
/// # Errors
/// The read's own error, or `FileTooLarge`.
pub fn read_at_most(r: impl std::io::Read, limit: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read as _;
    let mut buf = Vec::new();
    r.take(limit.saturating_add(1)).read_to_end(&mut buf)?;
    if buf.len() as u64 > limit {
        return Err(std::io::Error::new(
            std::io::ErrorKind::FileTooLarge,
            format!("larger than the limit of {limit} bytes"),
        ));
    }
    Ok(buf)
}

/// A process exit status: [`ExitCode`]'s value, readable (`vmnet` ends through C's `exit`
/// with it, see its `main`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Status(pub u8);

impl Status {
    /// Success: 0.
    pub const SUCCESS: Self = Self(0);
    /// A failure without a more precise status: 1.
    pub const FAILURE: Self = Self(1);
}

impl From<Status> for ExitCode {
    fn from(s: Status) -> Self {
        Self::from(s.0)
    }
}

/// The process exit status of an error code ([`ErrorCode::exit_code`]).
#[must_use]
pub fn exit_status(code: ErrorCode) -> Status {
    if code == ErrorCode::Internal {
        Status::FAILURE
    } else {
        Status(code.exit_code().try_into().unwrap_or(1))
    }
}

/// The process exit status of a command's result: success, or the error reported.
#[must_use]
pub fn finish(result: Result<(), Error>) -> Status {
    match result {
        Ok(()) => Status::SUCCESS,
        Err(e) => report(&e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::error::ErrorKind;

    #[test]
    fn a_read_is_bounded_at_its_limit() {
        assert_eq!(read_at_most(&b"abc"[..], 3).unwrap(), b"abc");
        let e = read_at_most(std::io::repeat(0), 3).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::FileTooLarge);
        assert_eq!(e.to_string(), "larger than the limit of 3 bytes");
    }

    #[test]
    fn usage_text_has_one_error_prefix_and_ends_with_a_newline() {
        assert_eq!(
            usage_text(
                ErrorKind::UnknownArgument,
                "error: unexpected argument '--x'\n"
            ),
            "error: INVALID_INPUT: unexpected argument '--x'\n"
        );
        assert_eq!(
            usage_text(ErrorKind::InvalidValue, "bad value"),
            "error: INVALID_INPUT: bad value\n"
        );
        assert_eq!(
            usage_text(
                ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand,
                "Usage: vmnet <COMMAND>\n"
            ),
            "error: INVALID_INPUT: a subcommand is required\n\nUsage: vmnet <COMMAND>\n"
        );
    }

    #[test]
    fn control_characters_in_a_message_are_escaped() {
        assert_eq!(printable("vm x not found"), "vm x not found");
        assert_eq!(
            printable("vm \u{1b}]0;pwned\u{7} not found\r\nlog line"),
            "vm \\u{1b}]0;pwned\\u{7} not found\\r\nlog line"
        );
    }

    #[test]
    fn exit_statuses_follow_the_documented_codes() {
        assert_eq!(exit_status(ErrorCode::InvalidInput), Status(2));
        assert_eq!(exit_status(ErrorCode::NotFound), Status(3));
        assert_eq!(exit_status(ErrorCode::Conflict), Status(4));
        assert_eq!(exit_status(ErrorCode::Unavailable), Status(6));
        assert_eq!(exit_status(ErrorCode::Internal), Status::FAILURE);
        assert_eq!(finish(Ok(())), Status::SUCCESS);
    }
}
