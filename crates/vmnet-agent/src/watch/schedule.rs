//! When a notified change is checked: the debounce that makes a burst of notifications one
//! check, and the back-off of an object another program keeps changing. Pure: the caller
//! passes the clock.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

/// What a notification asks the agent to check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Target {
    /// One VM (by user id): the pass's own check and repair of that VM.
    Vm(u32),
    /// The host-wide state (forwarding, router advertisements, the host nft table).
    Host,
    /// Everything: a full reconcile pass (lost notifications, or a change no single VM can be
    /// named for, e.g. the public address table).
    Pass,
    /// Every VM's proxy ARP/NDP entries on the uplink (a proxy entry changed, or the uplink
    /// did: a link going down loses its proxy entries without a notification of their own).
    Proxies,
    /// Pool mode's tables: its audit, at once.
    PoolTables,
    /// Pool mode's instances (a tap changed): its pass.
    PoolTaps,
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Vm(uid) => write!(f, "vm user id {uid}"),
            Self::Host => f.write_str("host-wide state"),
            Self::Pass => f.write_str("every vm (full pass)"),
            Self::Proxies => f.write_str("proxy entries on the uplink"),
            Self::PoolTables => f.write_str("pool tables"),
            Self::PoolTaps => f.write_str("pool taps"),
        }
    }
}

/// The tuning of a [`Schedule`].
#[derive(Debug, Clone, Copy)]
pub struct Tuning {
    /// How long after the first notification of a target its check runs: the notifications
    /// of one change (an `nft flush` deletes every chain and rule, one message each) arrive
    /// within it and cost one check.
    pub debounce: Duration,
    /// Repairs of one target within this window …
    pub window: Duration,
    /// … above this many put it in back-off; so do checks (repairing or not) above
    /// `check_limit` in the window.
    pub limit: usize,
    /// See `limit`.
    pub check_limit: usize,
    /// The first back-off; each further repair in back-off doubles it …
    pub first_backoff: Duration,
    /// … up to this (the reconcile interval: the pass repairs it then anyway).
    pub max_backoff: Duration,
}

impl Tuning {
    /// The agent's: 30 ms debounce, back-off after 5 repairs or 20 checks in 10 s, from 250 ms
    /// doubling up to `max_backoff`.
    #[must_use]
    pub fn agent(max_backoff: Duration) -> Self {
        Self {
            debounce: Duration::from_millis(30),
            window: Duration::from_secs(10),
            limit: 5,
            check_limit: 20,
            first_backoff: Duration::from_millis(250),
            max_backoff,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Pending {
    /// The first notification not yet checked.
    first: Instant,
    due: Instant,
}

#[derive(Debug, Default)]
struct History {
    repairs: VecDeque<Instant>,
    checks: VecDeque<Instant>,
    backoff: Option<Duration>,
    until: Option<Instant>,
    logged: Option<Instant>,
}

/// A back-off decided by [`Schedule::checked`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackOff {
    /// The next check waits this long.
    pub delay: Duration,
    /// Repairs in the window.
    pub repairs: usize,
    /// Whether to log it (once per `max_backoff` per target).
    pub log: bool,
}

/// The pending checks and the repair history of every target.
#[derive(Debug)]
pub struct Schedule {
    tuning: Tuning,
    pending: BTreeMap<Target, Pending>,
    history: HashMap<Target, History>,
    /// Back-offs decided so far.
    pub backoffs_total: u64,
}

impl Schedule {
    /// An empty schedule.
    #[must_use]
    pub fn new(tuning: Tuning) -> Self {
        Self {
            tuning,
            pending: BTreeMap::new(),
            history: HashMap::new(),
            backoffs_total: 0,
        }
    }

    /// A notification for `target`, read at `at`: its check is due one debounce after the
    /// first notification not yet checked, or when its back-off ends.
    pub fn notified(&mut self, target: Target, at: Instant) {
        let until = self.history.get(&target).and_then(|h| h.until);
        let p = self.pending.entry(target).or_insert(Pending {
            first: at,
            due: at + self.tuning.debounce,
        });
        p.first = p.first.min(at);
        if let Some(u) = until {
            p.due = p.due.max(u);
        }
    }

    /// When the next check is due.
    #[must_use]
    pub fn next_due(&self) -> Option<Instant> {
        self.pending.values().map(|p| p.due).min()
    }

    /// The targets due at `now`, each with its first notification's time; they are no longer
    /// pending (a notification during their check makes them pending again).
    pub fn take_due(&mut self, now: Instant) -> Vec<(Target, Instant)> {
        let due: Vec<Target> = self
            .pending
            .iter()
            .filter(|(_, p)| p.due <= now)
            .map(|(t, _)| *t)
            .collect();
        due.into_iter()
            .filter_map(|t| self.pending.remove(&t).map(|p| (t, p.first)))
            .collect()
    }

    /// Records the check of `target` at `now`: whether it repaired something. More than
    /// `limit` repairs, or `check_limit` checks, within `window` put the target in back-off;
    /// each further repair (or check above the limit) doubles it (capped); a check that
    /// repaired nothing, within the check limit, ends it.
    pub fn checked(&mut self, target: Target, repaired: bool, now: Instant) -> Option<BackOff> {
        let t = self.tuning;
        let h = self.history.entry(target).or_default();
        for q in [&mut h.repairs, &mut h.checks] {
            while q
                .front()
                .is_some_and(|r| now.saturating_duration_since(*r) > t.window)
            {
                q.pop_front();
            }
        }
        h.checks.push_back(now);
        let too_often = h.checks.len() > t.check_limit;
        if repaired {
            h.repairs.push_back(now);
        }
        let fight = repaired && (h.backoff.is_some() || h.repairs.len() > t.limit);
        if !(fight || too_often) {
            // Within the limits, or the other program stopped (for now): no back-off.
            h.backoff = None;
            h.until = None;
            // Forget the targets not checked within the window (none in back-off then).
            self.history.retain(|_, h| {
                h.checks
                    .back()
                    .is_some_and(|c| now.saturating_duration_since(*c) <= t.window)
            });
            return None;
        }
        let delay = h
            .backoff
            .map_or(t.first_backoff, |d| d.saturating_mul(2))
            .min(t.max_backoff);
        h.backoff = Some(delay);
        h.until = Some(now + delay);
        let log = h
            .logged
            .is_none_or(|l| now.saturating_duration_since(l) >= t.max_backoff);
        if log {
            h.logged = Some(now);
        }
        self.backoffs_total += 1;
        Some(BackOff {
            delay,
            repairs: h.repairs.len(),
            log,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tuning() -> Tuning {
        Tuning::agent(Duration::from_secs(10))
    }

    #[test]
    fn a_burst_of_notifications_is_one_check_after_the_debounce() {
        let mut s = Schedule::new(tuning());
        let t0 = Instant::now();
        for i in 0..50 {
            s.notified(Target::Vm(7), t0 + Duration::from_micros(i * 100));
        }
        s.notified(Target::Host, t0 + Duration::from_millis(10));
        assert_eq!(s.next_due(), Some(t0 + Duration::from_millis(30)));
        assert!(s.take_due(t0 + Duration::from_millis(29)).is_empty());
        assert_eq!(
            s.take_due(t0 + Duration::from_millis(30)),
            vec![(Target::Vm(7), t0)]
        );
        assert_eq!(s.next_due(), Some(t0 + Duration::from_millis(40)));
        assert_eq!(
            s.take_due(t0 + Duration::from_millis(45)),
            vec![(Target::Host, t0 + Duration::from_millis(10))]
        );
        assert_eq!(s.next_due(), None);
    }

    #[test]
    fn a_target_repaired_again_and_again_backs_off_exponentially_up_to_the_cap() {
        let mut s = Schedule::new(tuning());
        let mut now = Instant::now();
        let v = Target::Vm(1);
        for _ in 0..5 {
            assert_eq!(s.checked(v, true, now), None, "within the limit");
            now += Duration::from_millis(100);
        }
        let mut delays = Vec::new();
        let mut logs = 0;
        for _ in 0..10 {
            let b = s.checked(v, true, now).expect("in back-off");
            delays.push(b.delay.as_millis());
            logs += usize::from(b.log);
            // A notification now waits for the back-off.
            s.notified(v, now);
            assert_eq!(s.next_due(), Some(now + b.delay));
            s.take_due(now + b.delay);
            now += b.delay;
        }
        assert_eq!(
            delays,
            [250, 500, 1000, 2000, 4000, 8000, 10000, 10000, 10000, 10000]
        );
        assert_eq!(s.backoffs_total, 10);
        // Logged at the first back-off, then once per 10 s: at +15.75 s, +35.75 s … (sum of
        // the delays) — far fewer than the back-offs.
        assert!((2..=5).contains(&logs), "{logs}");
    }

    #[test]
    fn a_check_without_repair_ends_the_back_off_and_a_quiet_window_the_history() {
        let mut s = Schedule::new(tuning());
        let mut now = Instant::now();
        let v = Target::Pass;
        for _ in 0..5 {
            assert_eq!(s.checked(v, true, now), None);
            now += Duration::from_millis(10);
        }
        assert!(
            s.checked(v, true, now).is_some(),
            "the sixth repair in 10 s"
        );
        s.notified(v, now);
        assert_eq!(s.next_due(), Some(now + Duration::from_millis(250)));
        s.take_due(now + Duration::from_millis(250));
        assert_eq!(s.checked(v, false, now), None, "nothing to repair");
        s.notified(v, now);
        assert_eq!(
            s.next_due(),
            Some(now + Duration::from_millis(30)),
            "back-off over"
        );
        s.take_due(now + Duration::from_millis(30));
        assert!(
            s.checked(v, true, now).is_some(),
            "still 7 repairs in the window"
        );
        now += Duration::from_secs(11);
        assert_eq!(s.checked(Target::Host, false, now), None);
        assert_eq!(s.history.len(), 1, "the quiet target is forgotten");
        for _ in 0..5 {
            assert_eq!(s.checked(v, true, now), None, "a fresh start");
        }
    }

    #[test]
    fn checks_that_keep_coming_back_off_even_without_repairs() {
        let mut s = Schedule::new(tuning());
        let mut now = Instant::now();
        let v = Target::Vm(3);
        for _ in 0..20 {
            assert_eq!(s.checked(v, false, now), None);
            now += Duration::from_millis(30);
        }
        let b = s.checked(v, false, now).expect("the 21st check in 10 s");
        assert_eq!(b.delay, Duration::from_millis(250));
        now += b.delay;
        assert_eq!(
            s.checked(v, false, now).map(|b| b.delay),
            Some(Duration::from_millis(500))
        );
    }
}
