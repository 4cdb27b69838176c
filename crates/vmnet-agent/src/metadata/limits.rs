//! Per-VM protection of the metadata service: a token bucket on requests and a cap on open
//! connections, so one guest flooding the service costs the others nothing but a share of the
//! CPU its refused requests take.

use std::time::Instant;

/// Requests per second a VM may make, sustained (the guest agent makes 4: one read of the
/// `meta-data` folder every 250 ms).
pub const RATE_PER_SEC: f64 = 100.0;
/// Requests a VM may make at once after being idle.
pub const BURST: f64 = 200.0;
/// Connections a VM may hold open at once; more are closed as soon as they are accepted.
pub const MAX_CONNECTIONS: usize = 16;
/// The longest a connection may stay open, seconds (keep-alive included): a guest cannot hold
/// its connection slots with idle or slow connections for longer.
pub const CONNECTION_LIFETIME_SECS: u64 = 30;
/// The longest the service waits for a request's headers, seconds.
pub const HEADER_TIMEOUT_SECS: u64 = 5;
/// [`HEADER_TIMEOUT_SECS`] as the C int `TCP_DEFER_ACCEPT` takes.
pub const HEADER_TIMEOUT_SECS_C: libc::c_int = 5;

/// A token bucket: [`RATE_PER_SEC`] tokens a second, at most [`BURST`] saved up.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    /// A full bucket at `now`.
    #[must_use]
    pub fn new(now: Instant) -> Self {
        Self {
            tokens: BURST,
            last: now,
        }
    }

    /// Takes one token at `now`; `false` (and nothing taken) when the bucket is empty.
    pub fn take(&mut self, now: Instant) -> bool {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now.max(self.last);
        self.tokens = (self.tokens + dt * RATE_PER_SEC).min(BURST);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn the_burst_then_the_rate() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(t0);
        let burst = (0..1000).filter(|_| b.take(t0)).count();
        assert_eq!(burst, 200);
        assert!(!b.take(t0));
        // A second later: RATE_PER_SEC more, not more than that.
        let t1 = t0 + Duration::from_secs(1);
        let more = (0..1000).filter(|_| b.take(t1)).count();
        assert_eq!(more, 100);
        // Idle for an hour: never more than the burst.
        let t2 = t1 + Duration::from_secs(3600);
        assert_eq!((0..1000).filter(|_| b.take(t2)).count(), 200);
    }
}
