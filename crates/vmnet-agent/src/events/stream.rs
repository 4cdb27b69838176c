//! `GET /v1/events`: the query's filters, and the NDJSON body that replays the kept events and
//! follows the bus.
//!
//! # Design
//! - The query is checked whole before anything is streamed ([`Filter::parse`]): `vm=ID` and
//!   `kind=K` (each repeatable or a comma list; an unknown kind or a malformed VM id is
//!   `INVALID_INPUT` naming the parameter), `follow=true|false`, `since=SEQ`, `run=ID`; any
//!   other parameter is refused by name. A position the bus cannot resume from (another run's,
//!   or events no longer kept) is `CONFLICT` before anything is streamed ([`super::bus`]).
//! - The `lagged` line carries the run too: with `last_seq` it is where to resume.
//! - `follow=false` answers the kept events that match (the ring, [`super::bus::RING_EVENTS`])
//!   and ends. `follow=true` answers the kept events above `since` (none without `since`), then
//!   every new one as it is published, until the client goes or the agent stops.
//! - A following stream has a forwarder task between the bus and the response: it filters,
//!   encodes and queues each event for the connection without ever waiting. When its queue
//!   ([`QUEUE_EVENTS`] beyond the replay) is full (the client stopped reading, so the socket
//!   and the queue filled up) or the bus ran past it, the stream is cut: what was queued is
//!   still delivered, then a last line `{"kind":"lagged","missed":N,"last_seq":S,…}` (`S`, the
//!   last event delivered, is where to resume with `since=S`), then the response ends. A
//!   client that does not read even that loses its connection [`CUT_GRACE`] later
//!   ([`ConnCut`]). Nothing of this reaches the producers: the bus never waits.
//! - A following response says `Connection: close`: the connection carries one stream and is
//!   not reused, so cutting it loses nothing else.

use std::collections::BTreeSet;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::body::{Body, Bytes};
use tokio::sync::broadcast::error::{RecvError, TryRecvError};
use tokio::sync::{Notify, broadcast, mpsc};
use vmnet_model::Error;
use vmnet_model::vm::validate_vm_id;

use super::bus::{Events, Position, RING_EVENTS, RUN_ID_DIGITS, rfc3339};
use super::{Event, KINDS};

/// How many events a following stream queues for its connection beyond the replay before it
/// counts its reader as stalled and cuts it.
pub const QUEUE_EVENTS: usize = 256;

/// How long a cut stream's connection stays open for its reader to take the last line.
pub const CUT_GRACE: Duration = Duration::from_secs(2);

/// The content type of the stream: newline-delimited JSON.
pub const NDJSON: &str = "application/x-ndjson";

/// Closes one API connection when notified: the server puts one in every request of a
/// connection ([`crate::server::serve`]); a cut stream fires it.
#[derive(Debug, Clone, Default)]
pub struct ConnCut(pub Arc<Notify>);

/// What a client asked of the stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    /// Only events about these VMs (none: every event, including host events).
    pub vms: BTreeSet<String>,
    /// Only events of these kinds (none: every kind).
    pub kinds: BTreeSet<&'static str>,
    /// Keep streaming new events.
    pub follow: bool,
    /// Only events with a sequence number above this.
    pub since: Option<u64>,
    /// The run `since` belongs to (a position of another run is refused).
    pub run: Option<String>,
}

fn once(seen: &mut bool, name: &str) -> Result<(), Error> {
    if std::mem::replace(seen, true) {
        return Err(Error::invalid(format!(
            "query parameter {name:?} is given twice"
        )));
    }
    Ok(())
}

impl Filter {
    /// Parses the query of `GET /v1/events` (see the module docs).
    ///
    /// # Errors
    /// `INVALID_INPUT` naming the parameter and the bad value.
    pub fn parse(query: Option<&str>) -> Result<Self, Error> {
        let mut f = Self::default();
        let (mut follow_seen, mut since_seen, mut run_seen) = (false, false, false);
        for (k, v) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
            match k.as_ref() {
                "vm" => {
                    for id in v.split(',') {
                        validate_vm_id(id)
                            .map_err(|e| Error::invalid(format!("query parameter vm: {e}")))?;
                        f.vms.insert(id.to_owned());
                    }
                }
                "kind" => {
                    for k in v.split(',') {
                        let known = KINDS.iter().find(|n| **n == k).ok_or_else(|| {
                            Error::invalid(format!(
                                "query parameter kind: {k:?} is not an event kind (one of {})",
                                KINDS.join(", ")
                            ))
                        })?;
                        f.kinds.insert(known);
                    }
                }
                "follow" => {
                    once(&mut follow_seen, "follow")?;
                    f.follow = match v.as_ref() {
                        "true" => true,
                        "false" => false,
                        other => {
                            return Err(Error::invalid(format!(
                                "query parameter follow: {other:?} must be true or false"
                            )));
                        }
                    };
                }
                "since" => {
                    once(&mut since_seen, "since")?;
                    f.since = Some(v.parse().map_err(|_| {
                        Error::invalid(format!(
                            "query parameter since: {v:?} is not a sequence number (0 or more)"
                        ))
                    })?);
                }
                "run" => {
                    once(&mut run_seen, "run")?;
                    if v.len() != RUN_ID_DIGITS
                        || !v.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
                    {
                        return Err(Error::invalid(format!(
                            "query parameter run: {v:?} is not a run id ({RUN_ID_DIGITS} lowercase hex digits, the run of an event)"
                        )));
                    }
                    f.run = Some(v.into_owned());
                }
                other => {
                    return Err(Error::invalid(format!(
                        "query parameter {other:?} is unknown: /v1/events takes vm, kind, follow, since and run"
                    )));
                }
            }
        }
        Ok(f)
    }

    /// Where the client asked the stream to start.
    #[must_use]
    pub fn position(&self) -> Position<'_> {
        Position {
            since: self.since,
            run: self.run.as_deref(),
        }
    }

    /// Whether `e` passes the VM and kind filters.
    #[must_use]
    pub fn matches(&self, e: &Event) -> bool {
        (self.vms.is_empty() || e.vm.as_ref().is_some_and(|v| self.vms.contains(v)))
            && (self.kinds.is_empty() || self.kinds.contains(e.body.kind()))
    }
}

/// One event as one line of the stream.
fn line(e: &Event) -> Bytes {
    let mut v = serde_json::to_vec(e).unwrap_or_else(|_| b"{}".to_vec());
    v.push(b'\n');
    Bytes::from(v)
}

/// The last line of a cut stream.
fn lagged_line(run: &str, missed: u64, last_seq: Option<u64>) -> Bytes {
    let v = serde_json::json!({
        "kind": "lagged",
        "run": run,
        "time": rfc3339(SystemTime::now()),
        "missed": missed,
        "last_seq": last_seq,
    });
    Bytes::from(format!("{v}\n"))
}

/// The response body for `filter` over `bus`; `cut` closes the connection of a stalled reader.
///
/// # Errors
/// `CONFLICT` when the filter's position cannot be resumed ([`super::bus`]).
pub fn body(bus: &Events, filter: Filter, cut: Option<ConnCut>) -> Result<Body, Error> {
    if !filter.follow {
        let text: Vec<u8> = bus
            .recent(filter.position())?
            .iter()
            .filter(|e| filter.matches(e))
            .flat_map(|e| line(e))
            .collect();
        return Ok(Body::from(text));
    }
    let (past, rx) = bus.subscribe(filter.position())?;
    let past = if filter.since.is_some() {
        past
    } else {
        Vec::new()
    };
    let (tx, queue) = mpsc::channel(RING_EVENTS + QUEUE_EVENTS);
    let last: Arc<Mutex<Option<Bytes>>> = Arc::default();
    tokio::spawn(forward(
        bus.clone(),
        filter,
        (past, rx),
        tx,
        Arc::clone(&last),
        cut,
    ));
    let stream = futures::stream::unfold(Some((queue, last)), |state| async move {
        let (mut queue, last) = state?;
        match queue.recv().await {
            Some(b) => Some((Ok::<_, Infallible>(b), Some((queue, last)))),
            // The forwarder ended: its last line, if it left one, then the end.
            None => {
                let l = last.lock().ok()?.take()?;
                Some((Ok(l), None))
            }
        }
    });
    Ok(Body::from_stream(stream))
}

/// Moves `past` and then every event of `rx` that passes `filter` into `tx`, never waiting for
/// room; on a full queue or a lag, leaves the `lagged` line in `last` and ends (see the module
/// docs).
async fn forward(
    bus: Events,
    filter: Filter,
    (past, mut rx): (Vec<Arc<Event>>, broadcast::Receiver<Arc<Event>>),
    tx: mpsc::Sender<Bytes>,
    last: Arc<Mutex<Option<Bytes>>>,
    cut: Option<ConnCut>,
) {
    let mut last_seq = None;
    // The queue holds the whole ring: the replay always fits.
    for e in past.iter().filter(|e| filter.matches(e)) {
        if tx.try_send(line(e)).is_err() {
            return;
        }
        last_seq = Some(e.seq);
    }
    let missed = loop {
        let got = tokio::select! {
            r = rx.recv() => r,
            () = tx.closed() => return,
            () = bus.closed() => return,
        };
        match got {
            Ok(e) if filter.matches(&e) => match tx.try_send(line(&e)) {
                Ok(()) => last_seq = Some(e.seq),
                Err(mpsc::error::TrySendError::Full(_)) => {
                    // This one and what else waits for it now.
                    let mut n = 1u64;
                    loop {
                        match rx.try_recv() {
                            Ok(e) => n += u64::from(filter.matches(&e)),
                            Err(TryRecvError::Lagged(k)) => n += k,
                            Err(_) => break,
                        }
                    }
                    break n;
                }
                Err(mpsc::error::TrySendError::Closed(_)) => return,
            },
            Ok(_) => {}
            Err(RecvError::Lagged(n)) => break n,
            Err(RecvError::Closed) => return,
        }
    };
    tracing::warn!(
        missed,
        last_seq,
        "event stream: its reader fell behind; ended it"
    );
    if let Ok(mut l) = last.lock() {
        *l = Some(lagged_line(&bus.run().id, missed, last_seq));
    }
    drop(tx);
    drop(rx);
    if let Some(c) = cut {
        tokio::time::sleep(CUT_GRACE).await;
        c.0.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::{EventBody, Subject};
    use futures::StreamExt as _;
    use vmnet_model::ErrorCode;

    fn parse(q: &str) -> Result<Filter, Error> {
        Filter::parse(Some(q))
    }

    #[test]
    fn filters_parse_repeated_and_comma_lists() {
        let f = parse(
            "vm=a&vm=b,c&kind=vm_applied,vm_deleted&follow=true&since=5&run=0123456789abcdef",
        )
        .unwrap();
        assert_eq!(f.vms.len(), 3);
        assert_eq!(f.kinds.len(), 2);
        assert!(f.follow);
        assert_eq!(f.since, Some(5));
        assert_eq!(f.run.as_deref(), Some("0123456789abcdef"));
        assert_eq!(Filter::parse(None).unwrap(), Filter::default());
    }

    #[test]
    fn bad_filters_are_refused_naming_the_parameter() {
        for (q, needle) in [
            (
                "kind=nope",
                "query parameter kind: \"nope\" is not an event kind",
            ),
            ("vm=a/b", "query parameter vm"),
            ("vm=", "query parameter vm"),
            ("follow=yes", "query parameter follow"),
            ("follow=true&follow=false", "\"follow\" is given twice"),
            ("since=-1", "query parameter since"),
            ("run=0123", "query parameter run: \"0123\" is not a run id"),
            ("run=0123456789ABCDEF", "query parameter run"),
            (
                "run=0123456789abcdef&run=0123456789abcdef",
                "\"run\" is given twice",
            ),
            ("tenant=1", "query parameter \"tenant\" is unknown"),
        ] {
            let e = parse(q).unwrap_err();
            assert_eq!(e.code, ErrorCode::InvalidInput, "{q}");
            assert!(e.message.contains(needle), "{q}: {}", e.message);
        }
    }

    async fn lines(body: Body) -> Vec<serde_json::Value> {
        let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
        String::from_utf8(bytes.to_vec())
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    #[tokio::test]
    async fn a_reader_that_stops_is_cut_with_a_last_lagged_line() {
        let bus = Events::new();
        let f = Filter {
            follow: true,
            ..Filter::default()
        };
        let body = body(&bus, f, None).unwrap();
        // Nobody reads the body while far more than the queue is published.
        let n = RING_EVENTS + QUEUE_EVENTS + 100;
        for i in 0..n {
            bus.publish(Subject::vm(&format!("v{i}"), 1), EventBody::VmDeleted {});
            tokio::task::yield_now().await;
        }
        let got = lines(body).await;
        let (last, events) = got.split_last().unwrap();
        assert_eq!(events.len(), RING_EVENTS + QUEUE_EVENTS);
        assert_eq!(last["kind"], "lagged");
        assert_eq!(last["run"].as_str(), Some(bus.run().id.as_str()));
        assert_eq!(last["last_seq"], events.last().unwrap()["seq"]);
        assert!(last["missed"].as_u64().unwrap() >= 1, "{last}");
    }

    #[tokio::test]
    async fn follow_with_since_replays_then_follows_and_close_ends_it() {
        let bus = Events::new();
        bus.publish(Subject::vm("a", 1), EventBody::VmDeleted {});
        bus.publish(Subject::vm("b", 2), EventBody::VmDeleted {});
        let f = Filter::parse(Some("follow=true&since=0&vm=b")).unwrap();
        let mut s = body(&bus, f, None).unwrap().into_data_stream();
        let first: serde_json::Value =
            serde_json::from_slice(&s.next().await.unwrap().unwrap()).unwrap();
        assert_eq!(first["vm"], "b");
        bus.publish(Subject::vm("a", 1), EventBody::VmDeleted {});
        bus.publish(Subject::vm("b", 2), EventBody::VmDeleted {});
        let next: serde_json::Value =
            serde_json::from_slice(&s.next().await.unwrap().unwrap()).unwrap();
        assert_eq!(next["seq"], 4);
        bus.close();
        assert!(s.next().await.is_none());
    }
}
