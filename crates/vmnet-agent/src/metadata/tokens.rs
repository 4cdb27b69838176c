//! Session tokens of MMDS version 2: `PUT /latest/api/token` with
//! `X-metadata-token-ttl-seconds: N` (1..=21600) hands out a token valid for `N` seconds in this
//! VM only.
//!
//! # Design
//! Tokens are stateless, as Firecracker's: a token is its expiry, a random nonce and an
//! HMAC-SHA-256 tag over the VM's id, the expiry and the nonce, keyed with the agent's
//! [`TokenKey`] (made once per agent start, handed to the metadata worker). Checking a token
//! is recomputing its tag, so no per-token state is kept, a guest cannot make the service hold
//! memory by asking for tokens, and a restarted worker (same key) accepts the tokens its
//! predecessor issued. Expiry is measured on the boot-time clock (`CLOCK_BOOTTIME`), which is
//! the same for every process of the host and never goes back.
//!
//! A token is 32 bytes in URL-safe base64 (43 characters): expiry (8 bytes, big-endian
//! seconds of boot time), nonce (8 bytes), the tag's first 16 bytes. The key's `Debug` redacts
//! it and its memory is zeroed when dropped.

use std::sync::Arc;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, KeyInit, Mac};
use secrecy::{ExposeSecret, SecretBox};
use sha2::Sha256;

/// The shortest token lifetime, seconds (Firecracker's).
pub const MIN_TTL_SECS: u32 = 1;
/// The longest token lifetime, seconds (Firecracker's: 6 hours).
pub const MAX_TTL_SECS: u32 = 21_600;
/// Bytes of a token before base64.
const TOKEN_BYTES: usize = 32;
/// Bytes of the tag kept in a token.
const TAG_BYTES: usize = 16;
/// What the tag covers first: names the token format.
const DOMAIN: &[u8] = b"vmnet mmds token v1\0";

/// The key every VM's tokens are made with. `Debug` shows `TokenKey(..)`.
pub struct TokenKey(SecretBox<[u8; 32]>);

impl std::fmt::Debug for TokenKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenKey(..)")
    }
}

impl TokenKey {
    /// A new random key.
    ///
    /// # Errors
    /// When the system's random source fails.
    pub fn random() -> Result<Self, String> {
        let mut k = Box::new([0u8; 32]);
        getrandom::fill(k.as_mut()).map_err(|e| format!("no random bytes for a token key: {e}"))?;
        Ok(Self(SecretBox::new(k)))
    }

    /// The key from its bytes (the worker, from the agent's message).
    #[must_use]
    pub fn from_bytes(bytes: Box<[u8; 32]>) -> Self {
        Self(SecretBox::new(bytes))
    }

    /// The key's bytes, to hand to the worker only.
    #[must_use]
    pub fn expose(&self) -> &[u8; 32] {
        self.0.expose_secret()
    }

    fn tag(&self, vm: &str, expiry: u64, nonce: &[u8]) -> [u8; TAG_BYTES] {
        let mut out = [0u8; TAG_BYTES];
        // An HMAC takes a key of any length: `new_from_slice` cannot fail here.
        if let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(self.0.expose_secret()) {
            mac.update(DOMAIN);
            mac.update(vm.as_bytes());
            mac.update(&[0]);
            mac.update(&expiry.to_be_bytes());
            mac.update(nonce);
            out.copy_from_slice(&mac.finalize().into_bytes()[..TAG_BYTES]);
        }
        out
    }
}

/// Seconds of the boot-time clock (`CLOCK_BOOTTIME`): the same in every process of the host.
#[must_use]
pub fn boot_secs() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the live struct `ts` only.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &raw mut ts) };
    if rc == 0 {
        u64::try_from(ts.tv_sec).unwrap_or(0)
    } else {
        0
    }
}

/// One VM's tokens: made and checked with the agent's key, bound to the VM's id.
#[derive(Debug, Clone)]
pub struct Tokens {
    key: Arc<TokenKey>,
    vm: Arc<str>,
}

/// Parses a TTL header value: a plain decimal number of seconds in
/// `MIN_TTL_SECS..=MAX_TTL_SECS`, ASCII digits only, without sign, leading zero or whitespace
/// (`5` is a TTL; ` 5`, `05` and `+5` are not). HTTP's optional whitespace around a field value
/// is not part of the value: the HTTP parser removes it before this sees it.
///
/// # Errors
/// The message Firecracker answers with (status 400).
pub fn parse_ttl(v: &str) -> Result<u32, String> {
    let plain = !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) && !v.starts_with('0');
    Some(v)
        .filter(|_| plain)
        .and_then(|v| v.parse::<u32>().ok())
        .filter(|t| (MIN_TTL_SECS..=MAX_TTL_SECS).contains(t))
        .ok_or_else(|| {
            format!(
                "Invalid time to live value provided for token: {v}. Please provide a value between {MIN_TTL_SECS} and {MAX_TTL_SECS}."
            )
        })
}

impl Tokens {
    /// VM `vm`'s tokens under `key`.
    #[must_use]
    pub fn new(key: Arc<TokenKey>, vm: &str) -> Self {
        Self {
            key,
            vm: Arc::from(vm),
        }
    }

    /// A new token valid for `ttl_secs` from `now` (boot-time seconds, [`boot_secs`]).
    ///
    /// # Errors
    /// When the system's random source fails.
    pub fn issue(&self, ttl_secs: u32, now: u64) -> Result<String, String> {
        let mut nonce = [0u8; 8];
        getrandom::fill(&mut nonce).map_err(|e| format!("no random bytes for a token: {e}"))?;
        let expiry = now.saturating_add(u64::from(ttl_secs));
        let mut raw = [0u8; TOKEN_BYTES];
        raw[..8].copy_from_slice(&expiry.to_be_bytes());
        raw[8..16].copy_from_slice(&nonce);
        raw[16..].copy_from_slice(&self.key.tag(&self.vm, expiry, &nonce));
        Ok(URL_SAFE_NO_PAD.encode(raw))
    }

    /// Whether `token` was issued for this VM with this key and has not expired at `now`.
    #[must_use]
    pub fn valid(&self, token: &str, now: u64) -> bool {
        let mut raw = [0u8; TOKEN_BYTES];
        match URL_SAFE_NO_PAD.decode_slice(token.as_bytes(), &mut raw) {
            Ok(n) if n == TOKEN_BYTES => {}
            _ => return false,
        }
        let mut e = [0u8; 8];
        e.copy_from_slice(&raw[..8]);
        let expiry = u64::from_be_bytes(e);
        if expiry <= now {
            return false;
        }
        let want = self.key.tag(&self.vm, expiry, &raw[8..16]);
        // Constant time: the comparison does not stop at the first differing byte.
        want.iter()
            .zip(&raw[16..])
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_bounds() {
        assert_eq!(parse_ttl("1"), Ok(1));
        assert_eq!(parse_ttl("21600"), Ok(21600));
        for bad in [
            "0",
            "21601",
            "-1",
            "abc",
            "",
            "1.5",
            " 5",
            "5 ",
            "\t5",
            "05",
            "+5",
            "00",
            "5\n",
            "٥",
            "99999999999999999999",
        ] {
            let e = parse_ttl(bad).unwrap_err();
            assert!(e.contains("between 1 and 21600"), "{bad}: {e}");
        }
    }

    #[test]
    fn tokens_expire_and_belong_to_their_vm_and_key() {
        let key = Arc::new(TokenKey::random().unwrap());
        let s = Tokens::new(Arc::clone(&key), "vm-a");
        let t0 = 1000;
        let a = s.issue(1, t0).unwrap();
        let b = s.issue(10, t0).unwrap();
        assert_ne!(a, b);
        assert_eq!(a.len(), 43);
        assert!(s.valid(&a, t0));
        assert!(!s.valid(&a, t0 + 1));
        assert!(s.valid(&b, t0 + 9));
        assert!(!s.valid("forged", t0));
        assert!(!s.valid("", t0));
        // Another VM, or another key, does not accept it.
        assert!(!Tokens::new(Arc::clone(&key), "vm-b").valid(&b, t0));
        let other = Tokens::new(Arc::new(TokenKey::random().unwrap()), "vm-a");
        assert!(!other.valid(&b, t0));
        // The same key in a new process (a restarted worker) accepts it.
        let again = Tokens::new(
            Arc::new(TokenKey::from_bytes(Box::new(*key.expose()))),
            "vm-a",
        );
        assert!(again.valid(&b, t0 + 5));
        // A changed expiry breaks the tag.
        let mut raw = URL_SAFE_NO_PAD.decode(&b).unwrap();
        raw[7] ^= 0x40;
        assert!(!s.valid(&URL_SAFE_NO_PAD.encode(&raw), t0));
        assert_eq!(format!("{key:?}"), "TokenKey(..)");
        assert!(boot_secs() > 0);
    }
}
