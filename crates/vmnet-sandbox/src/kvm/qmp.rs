//! A QEMU Machine Protocol client: qemu's `-qmp unix:PATH,server=on,wait=off` socket, JSON
//! objects one a line each way. After the greeting, `qmp_capabilities` leaves negotiation;
//! each command gets one `return` or `error` answer, and asynchronous `event` lines in between
//! are skipped.

use std::io::{BufRead, BufReader, ErrorKind, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// An open, negotiated QMP connection.
pub struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

fn io_err(what: String) -> std::io::Error {
    std::io::Error::other(what)
}

impl Qmp {
    /// Connects to `path` (retrying while qemu has not made the socket yet, up to `timeout`),
    /// reads the greeting and negotiates.
    ///
    /// # Errors
    /// The socket's error after `timeout`, or a greeting or negotiation that is not QMP's.
    pub fn connect(path: &Path, timeout: Duration) -> std::io::Result<Self> {
        let start = Instant::now();
        let s = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if start.elapsed() > timeout => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        s.set_write_timeout(Some(Duration::from_secs(30)))?;
        let mut q = Self {
            reader: BufReader::new(s.try_clone()?),
            writer: s,
        };
        let greeting = q.line()?;
        if greeting.get("QMP").is_none() {
            return Err(io_err(format!("not a QMP greeting: {greeting}")));
        }
        q.execute("qmp_capabilities", None)?;
        Ok(q)
    }

    fn line(&mut self) -> std::io::Result<Value> {
        let mut l = String::new();
        if self.reader.read_line(&mut l)? == 0 {
            return Err(std::io::Error::new(
                ErrorKind::UnexpectedEof,
                "qemu closed the QMP socket",
            ));
        }
        serde_json::from_str(&l).map_err(|e| io_err(format!("QMP answer {l:?}: {e}")))
    }

    /// Runs `command` with `arguments`: its `return` value.
    ///
    /// # Errors
    /// qemu's `error` (class and description), or the socket's.
    pub fn execute(&mut self, command: &str, arguments: Option<Value>) -> std::io::Result<Value> {
        let mut req = json!({ "execute": command });
        if let Some(a) = arguments {
            req["arguments"] = a;
        }
        self.writer.write_all(format!("{req}\n").as_bytes())?;
        loop {
            let v = self.line()?;
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                return Err(io_err(format!(
                    "{command}: {} {}",
                    e["class"].as_str().unwrap_or("?"),
                    e["desc"].as_str().unwrap_or("")
                )));
            }
            // An event: skipped.
        }
    }

    /// Polls `query` every `every` until `done` accepts its answer's `field` (a string), up
    /// to `timeout`: that value.
    ///
    /// # Errors
    /// `TimedOut` with the last value, or a command's error.
    pub fn wait_for(
        &mut self,
        query: &str,
        field: &str,
        done: impl Fn(&str) -> bool,
        every: Duration,
        timeout: Duration,
    ) -> std::io::Result<String> {
        let start = Instant::now();
        loop {
            let v = self.execute(query, None)?;
            let s = v[field].as_str().unwrap_or("").to_owned();
            if done(&s) {
                return Ok(s);
            }
            if start.elapsed() > timeout {
                return Err(std::io::Error::new(
                    ErrorKind::TimedOut,
                    format!("{query}: still {s:?} after {timeout:?}"),
                ));
            }
            std::thread::sleep(every);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader, Write};
    use std::os::unix::net::UnixListener;
    use std::time::Duration;

    use super::Qmp;

    /// A fake qemu: the greeting, then per command an event and the answer (`query-status`
    /// says `inmigrate` twice, then `paused`; `cont` is refused).
    #[test]
    fn negotiates_skips_events_and_reports_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qmp.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let qemu = std::thread::spawn(move || {
            let (s, _) = listener.accept().unwrap();
            let mut w = s.try_clone().unwrap();
            writeln!(w, r#"{{"QMP": {{"version": {{}}, "capabilities": []}}}}"#).unwrap();
            let mut asked = 0;
            for line in BufReader::new(s).lines() {
                let v: serde_json::Value = serde_json::from_str(&line.unwrap()).unwrap();
                writeln!(w, r#"{{"event": "RESUME", "timestamp": {{}}}}"#).unwrap();
                match v["execute"].as_str().unwrap() {
                    "qmp_capabilities" => writeln!(w, r#"{{"return": {{}}}}"#),
                    "query-status" => {
                        asked += 1;
                        let st = if asked < 3 { "inmigrate" } else { "paused" };
                        writeln!(w, r#"{{"return": {{"status": "{st}"}}}}"#)
                    }
                    _ => writeln!(
                        w,
                        r#"{{"error": {{"class": "GenericError", "desc": "no"}}}}"#
                    ),
                }
                .unwrap();
            }
        });
        let mut q = Qmp::connect(&path, Duration::from_secs(2)).unwrap();
        let st = q
            .wait_for(
                "query-status",
                "status",
                |s| s != "inmigrate",
                Duration::from_millis(1),
                Duration::from_secs(2),
            )
            .unwrap();
        assert_eq!(st, "paused");
        let e = q.execute("cont", None).unwrap_err();
        assert_eq!(e.to_string(), "cont: GenericError no");
        drop(q);
        qemu.join().unwrap();
    }
}
