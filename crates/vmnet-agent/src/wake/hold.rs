//! One sleeping VM's held frames: a bounded queue, oldest first, and its counters. Pure logic
//! (no kernel, no clock of its own: the caller passes the time).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// The bounds of one VM's hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The most frames held.
    pub frames: usize,
    /// The most bytes held.
    pub bytes: usize,
    /// How long a frame is held.
    pub time: Duration,
}

/// A VM's wake counters since the agent started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// Frames held now.
    pub held_now: u64,
    /// Bytes held now.
    pub held_bytes: u64,
    /// Frames held in all.
    pub held: u64,
    /// Held frames delivered to the guest when its VMM attached.
    pub delivered: u64,
    /// Held frames dropped: the oldest, beyond the frame or byte bound.
    pub dropped_overflow: u64,
    /// Held frames dropped: held longer than the hold time.
    pub dropped_expired: u64,
    /// Frames not held: longer than the largest frame held.
    pub dropped_too_big: u64,
    /// Held frames the kernel refused when they were sent to the tap.
    pub dropped_send: u64,
    /// Wake events sent.
    pub wakes: u64,
}

/// One VM's hold (see the module docs).
#[derive(Debug, Default)]
pub struct VmHold {
    frames: VecDeque<(Instant, Vec<u8>)>,
    bytes: usize,
    last_wake: Option<Instant>,
    /// The counters.
    pub counters: Counters,
}

impl VmHold {
    fn sync(&mut self) {
        self.counters.held_now = self.frames.len() as u64;
        self.counters.held_bytes = self.bytes as u64;
    }

    /// Holds `frame` received at `now`, dropping the oldest frames while the bounds are
    /// exceeded; a frame longer than the byte bound itself is not held.
    pub fn push(&mut self, now: Instant, frame: Vec<u8>, l: Limits) {
        if frame.len() > l.bytes || l.frames == 0 {
            self.counters.dropped_overflow += 1;
            return;
        }
        self.bytes += frame.len();
        self.frames.push_back((now, frame));
        self.counters.held += 1;
        while self.frames.len() > l.frames || self.bytes > l.bytes {
            if let Some((_, f)) = self.frames.pop_front() {
                self.bytes -= f.len();
                self.counters.dropped_overflow += 1;
            }
        }
        self.sync();
    }

    /// Counts a frame too long to hold.
    pub fn too_big(&mut self) {
        self.counters.dropped_too_big += 1;
    }

    /// Drops the frames held longer than the hold time at `now`; how many.
    pub fn expire(&mut self, now: Instant, l: Limits) -> usize {
        let mut n = 0;
        while let Some((at, _)) = self.frames.front() {
            if now.saturating_duration_since(*at) < l.time {
                break;
            }
            if let Some((_, f)) = self.frames.pop_front() {
                self.bytes -= f.len();
                n += 1;
            }
        }
        self.counters.dropped_expired += n as u64;
        if n > 0 {
            // A later packet wakes again.
            self.last_wake = None;
        }
        self.sync();
        n
    }

    /// Takes every held frame, oldest first, with the time the oldest was held.
    pub fn take(&mut self) -> (Vec<Vec<u8>>, Option<Instant>) {
        let first = self.frames.front().map(|(at, _)| *at);
        let out = self.frames.drain(..).map(|(_, f)| f).collect();
        self.bytes = 0;
        self.last_wake = None;
        self.sync();
        (out, first)
    }

    /// Whether frames are held.
    #[must_use]
    pub fn holding(&self) -> bool {
        !self.frames.is_empty()
    }

    /// Whether a wake event is due at `now`: the first since the VM started holding, or
    /// `interval` after the last one. Counts it when due.
    pub fn wake_due(&mut self, now: Instant, interval: Duration) -> bool {
        if self
            .last_wake
            .is_some_and(|t| now.saturating_duration_since(t) < interval)
        {
            return false;
        }
        self.last_wake = Some(now);
        self.counters.wakes += 1;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: Limits = Limits {
        frames: 3,
        bytes: 100,
        time: Duration::from_secs(10),
    };

    #[test]
    fn the_oldest_go_beyond_the_frame_and_byte_bounds() {
        let t = Instant::now();
        let mut h = VmHold::default();
        for i in 0..5u8 {
            h.push(t, vec![i; 10], L);
        }
        let (frames, _) = h.take();
        assert_eq!(frames, vec![vec![2; 10], vec![3; 10], vec![4; 10]]);
        assert_eq!(h.counters.dropped_overflow, 2);
        h.push(t, vec![1; 60], L);
        h.push(t, vec![2; 60], L);
        assert_eq!(h.counters.held_now, 1);
        assert_eq!(h.counters.held_bytes, 60);
        h.push(t, vec![0; 101], L);
        assert_eq!(h.counters.dropped_overflow, 4);
        assert_eq!(h.take().0, vec![vec![2; 60]]);
    }

    #[test]
    fn frames_expire_in_order_and_a_later_packet_wakes_again() {
        let t = Instant::now();
        let mut h = VmHold::default();
        h.push(t, vec![1], L);
        assert!(h.wake_due(t, Duration::from_secs(1)));
        h.push(t + Duration::from_secs(5), vec![2], L);
        assert!(!h.wake_due(t + Duration::from_millis(500), Duration::from_secs(1)));
        assert_eq!(h.expire(t + Duration::from_secs(10), L), 1);
        assert_eq!(h.counters.dropped_expired, 1);
        assert!(h.holding());
        assert!(h.wake_due(t + Duration::from_secs(10), Duration::from_secs(1)));
        assert_eq!(h.counters.wakes, 2);
        let (frames, first) = h.take();
        assert_eq!(frames, vec![vec![2]]);
        assert_eq!(first, Some(t + Duration::from_secs(5)));
        assert!(!h.holding());
    }
}
