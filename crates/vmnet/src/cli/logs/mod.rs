//! The agent's log (docs: troubleshooting.md, "Logs"): `--log-format text|json` on stderr, and
//! under systemd the journal's own fields.
//!
//! # Design
//! - `text`: one human line per event, `LEVEL target: message key=value …`, with a timestamp.
//!   When stderr is the journal (systemd sets `JOURNAL_STREAM` to the device and inode of the
//!   stream it gave the service, and they match stderr's), each event goes to the journal over
//!   its native protocol instead ([`journal::Journal`]): `MESSAGE` is the same line without the
//!   level and timestamp (journald keeps both), and every field of the event (`vm`, `op`, …)
//!   is a journal field of its own (`VM`, `OP`, …), so `journalctl -u vmnet -o json` shows them
//!   and `journalctl -u vmnet VM=web-1` selects by them. If the journal's socket does not answer
//!   the lines go to stderr as text, without the timestamp journald adds.
//! - `json`: one JSON object per line on stderr (`timestamp`, `level`, `target`, `message` and
//!   the event's fields at the top level), for log shippers; also under systemd, where the
//!   journal holds each object as the `MESSAGE` of one entry.
//!
//! `RUST_LOG` sets the level in both (`info` by default).
//!
//! # Limitations
//! The journal layer records the fields of events, not of spans (the agent logs no spans).

mod journal;

use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// `--log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human lines (journal fields under systemd).
    Text,
    /// One JSON object per line.
    Json,
}

impl std::fmt::Display for LogFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Text => "text",
            Self::Json => "json",
        })
    }
}

fn filter() -> EnvFilter {
    EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"))
}

/// Installs the log of the unprivileged worker (`--worker-serve`): JSON or text lines on the
/// stderr it shares with the agent. Never the journal's socket: the worker's system call
/// filter allows none.
pub fn init_worker(format: LogFormat) {
    let _ = match format {
        LogFormat::Json => tracing_subscriber::fmt()
            .json()
            .flatten_event(true)
            .with_env_filter(filter())
            .with_writer(std::io::stderr)
            .try_init(),
        LogFormat::Text => tracing_subscriber::fmt()
            .with_env_filter(filter())
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .try_init(),
    };
}

/// Installs the agent's log for `format` (once; a second call changes nothing).
pub fn init(format: LogFormat) {
    let stderr_is_journal = journal::stderr_is_journal();
    let _ = match format {
        LogFormat::Json => tracing_subscriber::fmt()
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .with_env_filter(filter())
            .with_writer(std::io::stderr)
            .try_init()
            .map_err(|_| ()),
        LogFormat::Text if stderr_is_journal => match journal::Journal::open() {
            Ok(j) => tracing_subscriber::registry()
                .with(filter())
                .with(j)
                .try_init()
                .map_err(|_| ()),
            // No native socket: text on the stream, journald stamps each line itself.
            Err(_) => tracing_subscriber::fmt()
                .without_time()
                .with_ansi(false)
                .with_env_filter(filter())
                .with_writer(std::io::stderr)
                .try_init()
                .map_err(|_| ()),
        },
        LogFormat::Text => tracing_subscriber::fmt()
            .with_env_filter(filter())
            .with_writer(std::io::stderr)
            // Colour only on a terminal: logs written to files (sandboxes, services) stay plain.
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init()
            .map_err(|_| ()),
    };
}
