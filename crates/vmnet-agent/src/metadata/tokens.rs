//! Session tokens of MMDS version 2: `PUT /latest/api/token` with
//! `X-metadata-token-ttl-seconds: N` (1..=21600) hands out a random token valid for `N` seconds
//! in this VM only (each VM's listener has its own store).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

/// The shortest token lifetime, seconds (Firecracker's).
pub const MIN_TTL_SECS: u32 = 1;
/// The longest token lifetime, seconds (Firecracker's: 6 hours).
pub const MAX_TTL_SECS: u32 = 21_600;
/// Live tokens kept per VM; when full, expired tokens go first, then the one expiring soonest.
pub const MAX_TOKENS: usize = 1024;

/// The live tokens of one VM.
#[derive(Debug, Default)]
pub struct TokenStore {
    live: HashMap<String, Instant>,
}

/// Parses a TTL header value: a whole number of seconds in `MIN_TTL_SECS..=MAX_TTL_SECS`.
///
/// # Errors
/// The message Firecracker answers with (status 400).
pub fn parse_ttl(v: &str) -> Result<u32, String> {
    v.trim()
        .parse::<u32>()
        .ok()
        .filter(|t| (MIN_TTL_SECS..=MAX_TTL_SECS).contains(t))
        .ok_or_else(|| {
            format!(
                "Invalid time to live value provided for token: {v}. Please provide a value between {MIN_TTL_SECS} and {MAX_TTL_SECS}."
            )
        })
}

impl TokenStore {
    /// A new token valid for `ttl_secs` from `now`.
    ///
    /// # Errors
    /// When the system's random source fails.
    pub fn issue(&mut self, ttl_secs: u32, now: Instant) -> Result<String, String> {
        let mut raw = [0u8; 32];
        getrandom::fill(&mut raw).map_err(|e| format!("no random bytes for a token: {e}"))?;
        let token = URL_SAFE_NO_PAD.encode(raw);
        if self.live.len() >= MAX_TOKENS {
            self.live.retain(|_, exp| *exp > now);
        }
        if self.live.len() >= MAX_TOKENS
            && let Some(k) = self
                .live
                .iter()
                .min_by_key(|(_, exp)| **exp)
                .map(|(k, _)| k.clone())
        {
            self.live.remove(&k);
        }
        self.live.insert(
            token.clone(),
            now + Duration::from_secs(u64::from(ttl_secs)),
        );
        Ok(token)
    }

    /// Whether `token` was issued here and has not expired at `now`.
    #[must_use]
    pub fn valid(&self, token: &str, now: Instant) -> bool {
        self.live.get(token).is_some_and(|exp| *exp > now)
    }

    /// How many tokens are held (expired ones included until they are swept).
    #[must_use]
    pub fn len(&self) -> usize {
        self.live.len()
    }

    /// Whether no token is held.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_bounds() {
        assert_eq!(parse_ttl("1"), Ok(1));
        assert_eq!(parse_ttl("21600"), Ok(21600));
        for bad in ["0", "21601", "-1", "abc", "", "1.5"] {
            let e = parse_ttl(bad).unwrap_err();
            assert!(e.contains("between 1 and 21600"), "{bad}: {e}");
        }
    }

    #[test]
    fn tokens_expire_and_are_capped() {
        let t0 = Instant::now();
        let mut s = TokenStore::default();
        let a = s.issue(1, t0).unwrap();
        let b = s.issue(10, t0).unwrap();
        assert_ne!(a, b);
        assert!(s.valid(&a, t0));
        assert!(!s.valid(&a, t0 + Duration::from_secs(1)));
        assert!(s.valid(&b, t0 + Duration::from_secs(9)));
        assert!(!s.valid("forged", t0));
        for _ in 0..(2 * MAX_TOKENS) {
            s.issue(100, t0).unwrap();
        }
        assert!(s.len() <= MAX_TOKENS);
    }
}
