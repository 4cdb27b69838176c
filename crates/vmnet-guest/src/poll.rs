//! One poll of the guest agent: read the `meta-data` folder (one request), check its two
//! values, apply when they differ from what this process applied last (the applier then
//! compares with the disk and the kernel and changes only what differs). A bad or missing
//! document keeps the last good configuration; nothing here panics on input.

use crate::doc::{self, GuestNet};
use crate::fetch::Fetch;
use crate::networkd::Applied;

/// The folder read at each poll (as JSON: `mesh-ipv6` and `host-routes` in one answer).
pub const META_PATH: &str = "/latest/meta-data";

/// How a configuration is applied; faked in tests.
pub trait Apply {
    /// Applies `net`: changes what differs from it, and says what that was.
    ///
    /// # Errors
    /// A message; the poller retries at its next poll.
    fn apply(&mut self, net: &GuestNet) -> impl Future<Output = Result<Applied, String>>;
}

/// What one poll did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The document equals what is applied.
    Unchanged,
    /// A new configuration was applied: what changed.
    Applied(GuestNet, Applied),
    /// A configuration new to this process was found in place already (on disk and in the
    /// kernel, e.g. after a restart of vmnet-guest): nothing was changed.
    InPlace(GuestNet),
    /// The document could not be read or was bad; the last good configuration stays.
    Kept(String),
    /// Applying failed; retried at the next poll.
    ApplyFailed(String),
}

/// The poller's state: the configuration applied last.
#[derive(Debug)]
pub struct Poller<F, A> {
    fetch: F,
    apply: A,
    applied: Option<GuestNet>,
}

impl<F: Fetch, A: Apply> Poller<F, A> {
    /// A poller that has applied nothing yet.
    pub fn new(fetch: F, apply: A) -> Self {
        Self {
            fetch,
            apply,
            applied: None,
        }
    }

    #[cfg(test)]
    /// The configuration applied last.
    #[must_use]
    pub fn applied(&self) -> Option<&GuestNet> {
        self.applied.as_ref()
    }

    #[cfg(test)]
    /// The applier (tests look at what the fake recorded).
    #[must_use]
    pub fn applier(&self) -> &A {
        &self.apply
    }

    #[cfg(test)]
    /// The fetcher (tests change what the fake answers).
    pub fn fetcher(&mut self) -> &mut F {
        &mut self.fetch
    }

    /// One poll.
    pub async fn poll(&mut self) -> Outcome {
        let folder = match self.fetch.fetch(META_PATH).await {
            Ok(v) => v,
            Err(e) => return Outcome::Kept(format!("meta-data: {e}")),
        };
        let net = match doc::parse_folder(&folder) {
            Ok(n) => n,
            Err(e) => return Outcome::Kept(e),
        };
        if self.applied.as_ref() == Some(&net) {
            return Outcome::Unchanged;
        }
        match self.apply.apply(&net).await {
            Ok(done) => {
                self.applied = Some(net.clone());
                if done.changed() {
                    Outcome::Applied(net, done)
                } else {
                    Outcome::InPlace(net)
                }
            }
            Err(e) => Outcome::ApplyFailed(e),
        }
    }
}

#[cfg(test)]
#[path = "poll_tests.rs"]
mod tests;
