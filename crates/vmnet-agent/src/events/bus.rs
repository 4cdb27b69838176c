//! The event bus: a bounded ring of the recent events and a broadcast channel to the streams.
//!
//! # Design
//! - [`Events::publish`] takes one short lock (a `std` mutex held for a push and a channel
//!   send, never across an await): it numbers the event, appends it to the ring (dropping the
//!   oldest beyond [`RING_EVENTS`]) and sends it on the broadcast channel, whose send never
//!   waits (a receiver that falls [`CHANNEL_EVENTS`] behind loses the oldest and learns how
//!   many). Numbering and sending under the same lock keeps the channel in sequence order.
//! - [`Events::subscribe`] takes the same lock, so the ring's copy it returns and the receiver
//!   it opens meet without a gap or a repeat: a stream replays the copy, then follows.
//! - [`Events::close`] ends every stream (the agent is stopping): their requests finish, so
//!   the server's graceful shutdown does not wait for them.
//! - Each bus has a run id ([`Run`]: random, with the time it started), carried by every event:
//!   sequence numbers start again at 1 in each run, so a position is the pair (run, seq). A
//!   position the bus cannot resume from exactly (another run's, a sequence number it never
//!   published, or events it no longer keeps) is refused as `CONFLICT` under the same lock
//!   ([`Events::recent`], [`Events::subscribe`]), like a Kubernetes watch's `410 Gone`: the
//!   client reads the state again and follows from the current position.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use tokio::sync::{Notify, broadcast};
use vmnet_model::Error;

use super::{Event, EventBody, Subject};

/// How many recent events the agent keeps (what `follow=false` answers, and what `since`
/// can resume from).
pub const RING_EVENTS: usize = 1024;

/// How far a stream's reader may fall behind the bus before it is cut.
pub const CHANNEL_EVENTS: usize = 1024;

/// One run of the agent's bus: a random id and when it started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    /// 16 lowercase hex digits, random per start of the agent.
    pub id: String,
    /// When the bus was made (the agent's start): RFC 3339, UTC, milliseconds.
    pub started: String,
}

/// The length of a run id in hex digits.
pub const RUN_ID_DIGITS: usize = 16;

impl Run {
    /// A new run, starting now.
    #[must_use]
    pub fn new() -> Self {
        let mut id = [0u8; RUN_ID_DIGITS / 2];
        if getrandom::fill(&mut id).is_err() {
            // No randomness: the clock's nanoseconds still tell two starts apart.
            let nanos = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            id = nanos.to_le_bytes()[..RUN_ID_DIGITS / 2]
                .try_into()
                .unwrap_or_default();
        }
        Self {
            id: hex::encode(id),
            started: rfc3339(SystemTime::now()),
        }
    }
}

impl Default for Run {
    fn default() -> Self {
        Self::new()
    }
}

/// Where a client wants the stream to start: after sequence number `since` of run `run` (each
/// when given).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Position<'a> {
    /// Only events above this sequence number.
    pub since: Option<u64>,
    /// The run `since` belongs to.
    pub run: Option<&'a str>,
}

/// What [`Events::subscribe`] gives: the kept events to replay, then a receiver of every later
/// one.
pub type Subscription = (Vec<Arc<Event>>, broadcast::Receiver<Arc<Event>>);

#[derive(Debug)]
struct Inner {
    seq: u64,
    ring: VecDeque<Arc<Event>>,
}

#[derive(Debug)]
struct Shared {
    run: Run,
    inner: Mutex<Inner>,
    tx: broadcast::Sender<Arc<Event>>,
    closed: Notify,
    is_closed: std::sync::atomic::AtomicBool,
}

/// The agent's event bus; cheap to clone (all clones are the same bus).
#[derive(Debug, Clone)]
pub struct Events(Arc<Shared>);

impl Default for Events {
    fn default() -> Self {
        Self::new()
    }
}

/// RFC 3339 in UTC with milliseconds (`2025-01-31T12:00:00.123Z`).
#[must_use]
pub fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

impl Events {
    /// An empty bus.
    #[must_use]
    pub fn new() -> Self {
        let (tx, _) = broadcast::channel(CHANNEL_EVENTS);
        Self(Arc::new(Shared {
            run: Run::new(),
            inner: Mutex::new(Inner {
                seq: 0,
                ring: VecDeque::with_capacity(RING_EVENTS),
            }),
            tx,
            closed: Notify::new(),
            is_closed: std::sync::atomic::AtomicBool::new(false),
        }))
    }

    /// Publishes `body` about `subject`; never waits for a consumer. Returns its sequence
    /// number.
    pub fn publish(&self, subject: Subject, body: EventBody) -> u64 {
        let time = rfc3339(SystemTime::now());
        let mut inner = self
            .0
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        inner.seq += 1;
        let event = Arc::new(Event {
            run: self.0.run.id.clone(),
            seq: inner.seq,
            time,
            vm: subject.vm,
            user_id: subject.user_id,
            body,
        });
        if inner.ring.len() == RING_EVENTS {
            inner.ring.pop_front();
        }
        inner.ring.push_back(Arc::clone(&event));
        // An error only says nobody listens.
        let _ = self.0.tx.send(event);
        inner.seq
    }

    /// This bus's run.
    #[must_use]
    pub fn run(&self) -> &Run {
        &self.0.run
    }

    /// The kept events after `from`, oldest first.
    ///
    /// # Errors
    /// `CONFLICT` when `from` cannot be resumed exactly ([`Events::check`]).
    pub fn recent(&self, from: Position<'_>) -> Result<Vec<Arc<Event>>, Error> {
        let inner = self
            .0
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.check(&inner, from)?;
        Ok(after(&inner.ring, from.since.unwrap_or(0)))
    }

    /// The kept events after `from` and a receiver of every later one, with nothing between.
    ///
    /// # Errors
    /// `CONFLICT` when `from` cannot be resumed exactly ([`Events::check`]).
    pub fn subscribe(&self, from: Position<'_>) -> Result<Subscription, Error> {
        let inner = self
            .0
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.check(&inner, from)?;
        Ok((
            after(&inner.ring, from.since.unwrap_or(0)),
            self.0.tx.subscribe(),
        ))
    }

    /// Refuses a position the bus cannot resume from without losing events: another run's,
    /// a sequence number above the last one published (it comes from an earlier run: the
    /// numbers start again at 1), or one whose following events are no longer kept. `since=0`
    /// of this run (or without a run) is always fine: it asks for what is kept.
    fn check(&self, inner: &Inner, from: Position<'_>) -> Result<(), Error> {
        let run = &self.0.run;
        let restart = || {
            format!(
                "the agent restarted: this run, {}, started at {}, and sequence numbers start again at 1; the events before it are gone (read the state again, then follow with since=0&run={})",
                run.id, run.started, run.id
            )
        };
        if let Some(r) = from.run
            && r != run.id
        {
            return Err(Error::conflict(format!(
                "query parameter run: {r:?} is not this agent's run: {}",
                restart()
            )));
        }
        let Some(since) = from.since.filter(|s| *s > 0) else {
            return Ok(());
        };
        if since > inner.seq {
            return Err(Error::conflict(format!(
                "query parameter since: {since} is beyond the last event, {}: it is from an earlier run of the agent; {}",
                inner.seq,
                restart()
            )));
        }
        if let Some(oldest) = inner.ring.front()
            && oldest.seq > since + 1
        {
            return Err(Error::conflict(format!(
                "query parameter since: events {} to {} are no longer kept (the agent keeps the last {RING_EVENTS}); read the state again, then follow with since={}&run={}",
                since + 1,
                oldest.seq - 1,
                inner.seq,
                run.id
            )));
        }
        Ok(())
    }

    /// Whether any stream follows the bus now.
    #[must_use]
    pub fn followed(&self) -> bool {
        self.0.tx.receiver_count() > 0
    }

    /// The last sequence number published (0 before the first event).
    #[must_use]
    pub fn last_seq(&self) -> u64 {
        self.0
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .seq
    }

    /// Ends every stream, now and from now on (the agent is stopping).
    pub fn close(&self) {
        self.0
            .is_closed
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.0.closed.notify_waiters();
    }

    /// Completes once [`Events::close`] was called.
    pub async fn closed(&self) {
        let notified = self.0.closed.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if self.0.is_closed.load(std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        notified.await;
    }
}

fn after(ring: &VecDeque<Arc<Event>>, since: u64) -> Vec<Arc<Event>> {
    // The ring is in sequence order: skip to the first event above `since`.
    let start = ring.partition_point(|e| e.seq <= since);
    ring.range(start..).cloned().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deleted(bus: &Events, id: &str) -> u64 {
        bus.publish(Subject::vm(id, 1), EventBody::VmDeleted {})
    }

    #[test]
    fn the_ring_keeps_the_last_events_in_order_and_since_skips() {
        let bus = Events::new();
        for i in 0..RING_EVENTS + 10 {
            assert_eq!(deleted(&bus, &format!("v{i}")), i as u64 + 1);
        }
        let all = bus.recent(Position::default()).unwrap();
        assert_eq!(all.len(), RING_EVENTS);
        assert_eq!(all[0].seq, 11);
        assert!(all.windows(2).all(|w| w[1].seq == w[0].seq + 1));
        let tail = bus.recent(since(bus.last_seq() - 2)).unwrap();
        assert_eq!(tail.len(), 2);
        assert!(bus.recent(since(bus.last_seq())).unwrap().is_empty());
        // Resuming right after the oldest kept event loses nothing; before it, it would.
        assert_eq!(bus.recent(since(10)).unwrap().len(), RING_EVENTS);
        let e = bus.recent(since(9)).unwrap_err();
        assert_eq!(e.code, vmnet_model::ErrorCode::Conflict);
        assert!(
            e.message
                .contains("since: events 10 to 10 are no longer kept")
                && e.message
                    .contains(&format!("since={}&run=", bus.last_seq())),
            "{e}"
        );
        assert_eq!(
            bus.recent(Position::default()).unwrap().len(),
            RING_EVENTS,
            "since=0 asks for what is kept"
        );
    }

    fn since(seq: u64) -> Position<'static> {
        Position {
            since: Some(seq),
            run: None,
        }
    }

    #[test]
    fn every_event_carries_the_run_and_another_runs_position_is_refused() {
        let (old, bus) = (Events::new(), Events::new());
        assert_ne!(old.run().id, bus.run().id, "each start is a new run");
        assert_eq!(bus.run().id.len(), RUN_ID_DIGITS);
        for _ in 0..5 {
            deleted(&old, "a");
        }
        deleted(&bus, "a");
        let e = &bus.recent(Position::default()).unwrap()[0];
        assert_eq!(e.run, bus.run().id);
        let ours = Position {
            since: Some(1),
            run: Some(&bus.run().id),
        };
        assert!(bus.subscribe(ours).is_ok());
        // The old run's position, with its run or with a number this run never reached.
        let theirs = Position {
            since: Some(1),
            run: Some(&old.run().id),
        };
        for (from, needle) in [
            (theirs, "query parameter run"),
            (
                since(old.last_seq()),
                "since: 5 is beyond the last event, 1",
            ),
        ] {
            let e = bus.subscribe(from).unwrap_err();
            assert_eq!(e.code, vmnet_model::ErrorCode::Conflict);
            assert!(
                e.message.contains(needle)
                    && e.message.contains("the agent restarted")
                    && e.message.contains(&bus.run().id),
                "{e}"
            );
        }
    }

    #[tokio::test]
    async fn a_subscriber_gets_the_ring_then_every_later_event_without_a_gap() {
        let bus = Events::new();
        deleted(&bus, "a");
        let (past, mut rx) = bus.subscribe(Position::default()).unwrap();
        assert!(bus.followed());
        deleted(&bus, "b");
        assert_eq!(past.len(), 1);
        assert_eq!(rx.recv().await.unwrap().seq, 2);
    }

    #[tokio::test]
    async fn publishing_never_waits_for_a_receiver_that_does_not_read() {
        let bus = Events::new();
        let (_, mut rx) = bus.subscribe(Position::default()).unwrap();
        for i in 0..10 * CHANNEL_EVENTS {
            deleted(&bus, &format!("v{i}"));
        }
        match rx.recv().await {
            Err(broadcast::error::RecvError::Lagged(n)) => {
                assert_eq!(usize::try_from(n).unwrap(), 9 * CHANNEL_EVENTS);
            }
            other => panic!("expected a lag, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn close_wakes_waiters_now_and_later() {
        let bus = Events::new();
        let b = bus.clone();
        let waiter = tokio::spawn(async move { b.closed().await });
        tokio::task::yield_now().await;
        bus.close();
        waiter.await.unwrap();
        bus.closed().await;
    }
}
