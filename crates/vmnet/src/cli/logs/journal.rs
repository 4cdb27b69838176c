//! Events to the systemd journal over its native protocol
//! (<https://systemd.io/JOURNAL_NATIVE_PROTOCOL/>), each field of an event a journal field.
//!
//! # Design
//! `tracing-journald` sends the same protocol, but its `MESSAGE` is the event's message alone:
//! `journalctl -u vmnet` would print "kernel state changed behind the agent's back; repaired"
//! without the VM or what changed, which the text log on stderr shows. Here `MESSAGE` is the
//! text line (`target: message key=value …`) and the fields are journal fields besides, so the
//! journal reads as the text log and selects and exports by field.
//!
//! # Limitations
//! An entry too large for one datagram (the socket's send buffer, about 200 KiB), or one the
//! socket refuses, is written to stderr as the text line instead (journald stores it from the
//! service's stream, without the separate fields).

use std::fmt::Write as _;
use std::io::Write as _;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::Context;

/// journald's socket for the native protocol.
const SOCKET: &str = "/run/systemd/journal/socket";

/// Journal fields an event's own field must not overwrite; such a field is written as `F_NAME`.
const RESERVED: &[&str] = &[
    "MESSAGE",
    "PRIORITY",
    "SYSLOG_IDENTIFIER",
    "CODE_FILE",
    "CODE_LINE",
    "TRACING_TARGET",
];

/// Whether stderr is the stream systemd connected to the journal: `JOURNAL_STREAM` holds its
/// `DEVICE:INODE`, and stderr's are the same (a service whose stderr was redirected elsewhere
/// inherits the variable but not the stream).
#[must_use]
pub fn stderr_is_journal() -> bool {
    let Some(v) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Some((dev, ino)) = v.to_str().and_then(|s| s.split_once(':')) else {
        return false;
    };
    let (Ok(dev), Ok(ino)) = (dev.parse::<u64>(), ino.parse::<u64>()) else {
        return false;
    };
    let stderr = std::os::fd::AsFd::as_fd(&std::io::stderr())
        .try_clone_to_owned()
        .map(std::fs::File::from);
    stderr
        .and_then(|f| f.metadata())
        .is_ok_and(|m| m.dev() == dev && m.ino() == ino)
}

/// A `tracing` layer writing each event to the journal.
#[derive(Debug)]
pub struct Journal {
    socket: UnixDatagram,
    path: PathBuf,
    identifier: String,
}

impl Journal {
    /// Connects to journald's socket; fails when nothing answers there.
    ///
    /// # Errors
    /// The socket's error.
    pub fn open() -> std::io::Result<Self> {
        Self::at(Path::new(SOCKET), "vmnet")
    }

    /// A journal at `path` (a test's stand-in for journald), entries marked `identifier`.
    ///
    /// # Errors
    /// The socket's error: an empty datagram, which journald ignores, is sent to check it.
    pub fn at(path: &Path, identifier: &str) -> std::io::Result<Self> {
        let socket = UnixDatagram::unbound()?;
        socket.send_to(&[], path)?;
        Ok(Self {
            socket,
            path: path.to_owned(),
            identifier: identifier.to_owned(),
        })
    }
}

/// The fields of one event: its message and the others in order, as text (and whether the
/// text line quotes it: a string value, as `tracing-subscriber`'s text log does).
#[derive(Default)]
struct Fields {
    message: String,
    others: Vec<(&'static str, String, bool)>,
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message = value.to_owned();
        } else {
            self.others.push((field.name(), value.to_owned(), true));
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let text = format!("{value:?}");
        if field.name() == "message" {
            self.message = text;
        } else {
            self.others.push((field.name(), text, false));
        }
    }
}

/// The syslog priority of a level.
fn priority(level: Level) -> u8 {
    match level {
        Level::ERROR => 3,
        Level::WARN => 4,
        Level::INFO => 6,
        Level::DEBUG | Level::TRACE => 7,
    }
}

/// A field name as the journal takes it: upper case letters, digits and `_`, not starting with
/// `_` or a digit, at most 64 bytes; a reserved name gets an `F_` prefix.
fn journal_name(name: &str) -> String {
    let mut n: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect();
    let n_trim = n.trim_start_matches(|c: char| c == '_' || c.is_ascii_digit());
    if n_trim.len() != n.len() || n_trim.is_empty() || RESERVED.contains(&n_trim) {
        n = format!("F_{}", n.trim_start_matches('_'));
    }
    n.truncate(64);
    n
}

/// Appends `name=value` in the native protocol (the length-prefixed form for a value with a
/// newline).
fn put(buf: &mut Vec<u8>, name: &str, value: &[u8]) {
    buf.extend_from_slice(name.as_bytes());
    if value.contains(&b'\n') {
        buf.push(b'\n');
        buf.extend_from_slice(&(value.len() as u64).to_le_bytes());
    } else {
        buf.push(b'=');
    }
    buf.extend_from_slice(value);
    buf.push(b'\n');
}

/// The text line of an event, as `MESSAGE`: `target: message key=value …`.
fn line(target: &str, f: &Fields) -> String {
    let mut out = format!("{target}: {}", f.message);
    for (k, v, quoted) in &f.others {
        let _ = if *quoted {
            write!(out, " {k}={v:?}")
        } else {
            write!(out, " {k}={v}")
        };
    }
    out
}

/// One journal entry for `event`: the datagram and its text line.
fn entry(identifier: &str, event: &Event<'_>) -> (Vec<u8>, String) {
    let meta = event.metadata();
    let mut f = Fields::default();
    event.record(&mut f);
    let text = line(meta.target(), &f);
    let mut buf = Vec::with_capacity(256);
    put(
        &mut buf,
        "PRIORITY",
        priority(*meta.level()).to_string().as_bytes(),
    );
    put(&mut buf, "SYSLOG_IDENTIFIER", identifier.as_bytes());
    put(&mut buf, "MESSAGE", text.as_bytes());
    put(&mut buf, "TRACING_TARGET", meta.target().as_bytes());
    if let Some(file) = meta.file() {
        put(&mut buf, "CODE_FILE", file.as_bytes());
    }
    if let Some(l) = meta.line() {
        put(&mut buf, "CODE_LINE", l.to_string().as_bytes());
    }
    for (k, v, _) in &f.others {
        put(&mut buf, &journal_name(k), v.as_bytes());
    }
    (buf, text)
}

impl<S: Subscriber> tracing_subscriber::Layer<S> for Journal {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let (buf, text) = entry(&self.identifier, event);
        if self.socket.send_to(&buf, &self.path).is_err() {
            // Too large or refused: the stream keeps it, as a line.
            let _ = writeln!(std::io::stderr(), "{} {text}", event.metadata().level());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::layer::SubscriberExt;

    #[test]
    fn names_are_made_journal_names() {
        assert_eq!(journal_name("vm"), "VM");
        assert_eq!(journal_name("repairs_in_window"), "REPAIRS_IN_WINDOW");
        assert_eq!(journal_name("a.b"), "A_B");
        assert_eq!(journal_name("priority"), "F_PRIORITY");
        assert_eq!(journal_name("_x"), "F_X");
        assert_eq!(journal_name("1x"), "F_1X");
    }

    #[test]
    fn a_value_with_a_newline_is_length_prefixed() {
        let mut buf = Vec::new();
        put(&mut buf, "A", b"one");
        put(&mut buf, "B", b"x\ny");
        let mut want = b"A=one\nB\n".to_vec();
        want.extend_from_slice(&3u64.to_le_bytes());
        want.extend_from_slice(b"x\ny\n");
        assert_eq!(buf, want);
    }

    /// The layer against a stand-in journal socket: the entry carries the text line as
    /// MESSAGE and each field as its own journal field.
    #[test]
    fn an_event_becomes_an_entry_with_its_fields() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.sock");
        let journald = UnixDatagram::bind(&path).unwrap();
        let layer = Journal::at(&path, "vmnet").unwrap();
        let mut buf = [0u8; 4096];
        // The check datagram.
        assert_eq!(journald.recv(&mut buf).unwrap(), 0);
        let subscriber = tracing_subscriber::registry().with(layer);
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(target: "vmnet_agent::agent", vm = %"web-1", op = "create", changes = ?["a b"], "vm applied");
        });
        let n = journald.recv(&mut buf).unwrap();
        let text = String::from_utf8_lossy(&buf[..n]).into_owned();
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines.contains(&"PRIORITY=4"), "{text}");
        assert!(lines.contains(&"SYSLOG_IDENTIFIER=vmnet"), "{text}");
        assert!(lines.contains(&"VM=web-1"), "{text}");
        assert!(lines.contains(&"OP=create"), "{text}");
        assert!(
            lines.contains(&"TRACING_TARGET=vmnet_agent::agent"),
            "{text}"
        );
        assert!(
            lines.contains(
                &r#"MESSAGE=vmnet_agent::agent: vm applied vm=web-1 op="create" changes=["a b"]"#
            ),
            "{text}"
        );
    }

    #[test]
    fn no_journal_socket_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        assert!(Journal::at(&dir.path().join("none"), "vmnet").is_err());
    }
}
