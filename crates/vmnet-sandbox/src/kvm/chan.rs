//! The command channel into a real guest: the virtio-serial port `vmnet.cmd`, which qemu exposes
//! on the host as a unix socket and the image's `vmnet-cmd` service serves (see
//! `scripts/guest-image.sh`).
//!
//! Protocol, one line each way: the request `ID TIMEOUT_SECS BASE64(script)`; the answer
//! `ID STATUS BASE64(output)` (stdout and stderr together; status 124 when the guest's
//! `timeout` stopped it). Requests run one at a time. Answers to an older ID (a request that timed
//! out here) are skipped.

use std::io::{BufRead, BufReader, ErrorKind, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;

/// What a command run in the guest gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ran {
    /// Its exit status (`124`: stopped by the guest's timeout).
    pub status: i32,
    /// Its standard output and error, together.
    pub output: String,
}

/// An open channel to one guest.
pub struct Channel {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    next: u64,
}

impl Channel {
    /// Connects to qemu's socket at `path` (qemu listens from its start; the guest side answers
    /// only once `vmnet-cmd` runs: see [`Self::wait_ready`]).
    ///
    /// # Errors
    /// The socket error.
    pub fn connect(path: &Path) -> std::io::Result<Self> {
        let s = UnixStream::connect(path)?;
        Ok(Self {
            reader: BufReader::new(s.try_clone()?),
            writer: s,
            next: 1,
        })
    }

    /// Runs `script` (bash) in the guest, waiting up to `timeout` (the guest stops it after
    /// that too).
    ///
    /// # Errors
    /// `TimedOut` when no answer came, other socket errors as they are.
    pub fn run(&mut self, script: &str, timeout: Duration) -> std::io::Result<Ran> {
        let id = self.next;
        self.next += 1;
        let secs = timeout.as_secs().max(1);
        let line = format!("{id} {secs} {}\n", B64.encode(script.as_bytes()));
        let deadline = Instant::now() + timeout + Duration::from_secs(3);
        self.writer.set_write_timeout(Some(timeout))?;
        self.writer.write_all(line.as_bytes())?;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(std::io::Error::new(ErrorKind::TimedOut, "no answer"));
            }
            self.reader.get_ref().set_read_timeout(Some(left))?;
            let mut answer = String::new();
            match self.reader.read_line(&mut answer) {
                Ok(0) => return Err(std::io::Error::new(ErrorKind::UnexpectedEof, "closed")),
                Ok(_) => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return Err(std::io::Error::new(ErrorKind::TimedOut, "no answer"));
                }
                Err(e) => return Err(e),
            }
            let mut parts = answer.trim_end().splitn(3, ' ');
            let (Some(got), Some(status)) = (parts.next(), parts.next()) else {
                continue;
            };
            if got.parse::<u64>().ok() != Some(id) {
                continue;
            }
            let output = B64.decode(parts.next().unwrap_or("")).unwrap_or_default();
            return Ok(Ran {
                status: status.parse().unwrap_or(-1),
                output: String::from_utf8_lossy(&output).into_owned(),
            });
        }
    }

    /// Asks `true` every second until the guest answers or `timeout` passes; the time it took.
    ///
    /// # Errors
    /// `TimedOut` after `timeout`.
    pub fn wait_ready(&mut self, timeout: Duration) -> std::io::Result<Duration> {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if crate::state::stopping() {
                return Err(std::io::Error::new(ErrorKind::Interrupted, "interrupted"));
            }
            match self.run("true", Duration::from_secs(1)) {
                Ok(r) if r.status == 0 => return Ok(start.elapsed()),
                Ok(_) | Err(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        }
        Err(std::io::Error::new(
            ErrorKind::TimedOut,
            format!("the guest's command channel did not answer within {timeout:?}"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader, Write};
    use std::os::unix::net::UnixListener;
    use std::time::Duration;

    use base64::Engine as _;
    use base64::engine::general_purpose::STANDARD as B64;

    use super::Channel;

    /// A fake guest side: answers each request with `ID STATUS BASE64(output)`, first sending
    /// an answer to a stale ID; the script `exit 3` gives status 3, anything else echoes it.
    #[test]
    fn runs_commands_and_skips_stale_answers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cmd.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let guest = std::thread::spawn(move || {
            let (s, _) = listener.accept().unwrap();
            let mut w = s.try_clone().unwrap();
            for line in BufReader::new(s).lines() {
                let line = line.unwrap();
                let mut p = line.splitn(3, ' ');
                let (id, secs, cmd) = (p.next().unwrap(), p.next().unwrap(), p.next().unwrap());
                assert!(secs.parse::<u64>().unwrap() >= 1);
                let script = String::from_utf8(B64.decode(cmd).unwrap()).unwrap();
                let status = if script == "exit 3" { 3 } else { 0 };
                let out = B64.encode(format!("ran: {script}\n"));
                writeln!(w, "0 0 {}", B64.encode("stale")).unwrap();
                writeln!(w, "{id} {status} {out}").unwrap();
            }
        });
        let mut ch = Channel::connect(&path).unwrap();
        let r = ch.run("ip -br a", Duration::from_secs(2)).unwrap();
        assert_eq!((r.status, r.output.as_str()), (0, "ran: ip -br a\n"));
        let r = ch.run("exit 3", Duration::from_secs(2)).unwrap();
        assert_eq!(r.status, 3);
        drop(ch);
        guest.join().unwrap();
    }

    #[test]
    fn a_guest_that_does_not_answer_times_out() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cmd.sock");
        let _listener = UnixListener::bind(&path).unwrap();
        let mut ch = Channel::connect(&path).unwrap();
        let e = ch.run("true", Duration::from_secs(1)).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
    }
}
