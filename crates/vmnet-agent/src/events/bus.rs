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

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use tokio::sync::{Notify, broadcast};

use super::{Event, EventBody, Subject};

/// How many recent events the agent keeps (what `follow=false` answers, and what `since`
/// can resume from).
pub const RING_EVENTS: usize = 1024;

/// How far a stream's reader may fall behind the bus before it is cut.
pub const CHANNEL_EVENTS: usize = 1024;

#[derive(Debug)]
struct Inner {
    seq: u64,
    ring: VecDeque<Arc<Event>>,
}

#[derive(Debug)]
struct Shared {
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

    /// The kept events with a sequence number above `since`, oldest first.
    #[must_use]
    pub fn recent(&self, since: u64) -> Vec<Arc<Event>> {
        let inner = self
            .0
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        after(&inner.ring, since)
    }

    /// The kept events above `since` and a receiver of every later one, with nothing between.
    #[must_use]
    pub fn subscribe(&self, since: u64) -> (Vec<Arc<Event>>, broadcast::Receiver<Arc<Event>>) {
        let inner = self
            .0
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        (after(&inner.ring, since), self.0.tx.subscribe())
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
        let all = bus.recent(0);
        assert_eq!(all.len(), RING_EVENTS);
        assert_eq!(all[0].seq, 11);
        assert!(all.windows(2).all(|w| w[1].seq == w[0].seq + 1));
        let tail = bus.recent(bus.last_seq() - 2);
        assert_eq!(tail.len(), 2);
        assert!(bus.recent(bus.last_seq()).is_empty());
    }

    #[tokio::test]
    async fn a_subscriber_gets_the_ring_then_every_later_event_without_a_gap() {
        let bus = Events::new();
        deleted(&bus, "a");
        let (past, mut rx) = bus.subscribe(0);
        assert!(bus.followed());
        deleted(&bus, "b");
        assert_eq!(past.len(), 1);
        assert_eq!(rx.recv().await.unwrap().seq, 2);
    }

    #[tokio::test]
    async fn publishing_never_waits_for_a_receiver_that_does_not_read() {
        let bus = Events::new();
        let (_, mut rx) = bus.subscribe(0);
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
