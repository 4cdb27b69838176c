//! The caller's own changes: the namespaces whose notifications are discarded while a
//! [`Quiet`] naming them is held (see the module docs of [`super`]).

use std::collections::{BTreeSet, HashMap};

use super::Watcher;

/// Which namespaces are quiet now: the [`Quiet`]s held, counted per namespace (`None`: the
/// host), and those of every namespace ([`Watcher::quiet_all`]).
#[derive(Debug, Default)]
pub(super) struct Quieted {
    all: u32,
    by_ns: HashMap<Option<String>, u32>,
}

impl Quieted {
    /// Whether the notifications of `netns` are discarded now.
    pub(super) fn is_quiet(&self, netns: &Option<String>) -> bool {
        self.all > 0 || self.by_ns.contains_key(netns)
    }

    fn hold(&mut self, netns: &Option<String>) {
        *self.by_ns.entry(netns.clone()).or_insert(0) += 1;
    }

    fn release(&mut self, netns: &Option<String>) {
        if let Some(n) = self.by_ns.get_mut(netns) {
            *n -= 1;
            if *n == 0 {
                self.by_ns.remove(netns);
            }
        }
    }
}

/// What one [`Quiet`] quiets.
#[derive(Debug)]
enum Scope {
    All,
    /// These namespaces, each named once.
    Only(BTreeSet<Option<String>>),
}

/// A caller's own change in progress (see [`Watcher::quiet`]); dropping it discards what the
/// change caused.
pub struct Quiet {
    w: Watcher,
    scope: Scope,
}

impl std::fmt::Debug for Quiet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Quiet")
            .field("scope", &self.scope)
            .finish_non_exhaustive()
    }
}

impl Watcher {
    /// Marks the caller's own change of the namespaces `netns` (a VM netns by name, `None` for
    /// the host) until the returned guard drops: their notifications are discarded meanwhile,
    /// those of every other namespace are kept. A VM netns may be named before it exists (a
    /// create): the sockets a create opens in it are quiet from the moment they are adopted.
    #[must_use]
    pub fn quiet(&self, netns: impl IntoIterator<Item = Option<String>>) -> Quiet {
        let mut q = Quiet {
            w: self.clone(),
            scope: Scope::Only(BTreeSet::new()),
        };
        q.also(netns);
        q
    }

    /// Marks a change of any namespace, e.g. one of namespaces not known beforehand, until the
    /// returned guard drops: every notification is discarded meanwhile.
    #[must_use]
    pub fn quiet_all(&self) -> Quiet {
        self.lock().quieted.all += 1;
        Quiet {
            w: self.clone(),
            scope: Scope::All,
        }
    }
}

impl Quiet {
    /// Quiets the namespaces `netns` too, until this guard drops (the holder found out what
    /// else it changes; call it before changing them). A no-op for [`Watcher::quiet_all`]'s.
    pub fn also(&mut self, netns: impl IntoIterator<Item = Option<String>>) {
        let Scope::Only(held) = &mut self.scope else {
            return;
        };
        let mut st = self.w.lock();
        for n in netns {
            if !held.contains(&n) {
                st.quieted.hold(&n);
                held.insert(n);
            }
        }
    }
}

impl Drop for Quiet {
    fn drop(&mut self) {
        let mut st = self.w.lock();
        // Bounded: a socket is emptied or dropped from the set in one round.
        for _ in 0..4 {
            if !self.w.drain(&mut st) {
                break;
            }
        }
        match &self.scope {
            Scope::All => st.quieted.all -= 1,
            Scope::Only(held) => {
                for n in held {
                    st.quieted.release(n);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vm(n: &str) -> Option<String> {
        Some(n.to_owned())
    }

    #[test]
    fn only_the_namespaces_held_are_quiet_until_their_last_holder_releases_them() {
        let mut q = Quieted::default();
        assert!(!q.is_quiet(&None) && !q.is_quiet(&vm("a")));
        q.hold(&None);
        q.hold(&vm("a"));
        assert!(q.is_quiet(&None) && q.is_quiet(&vm("a")));
        assert!(!q.is_quiet(&vm("b")), "another VM's netns is kept");
        // A second holder of the host: the host stays quiet until both released it.
        q.hold(&None);
        q.release(&None);
        assert!(q.is_quiet(&None));
        q.release(&None);
        q.release(&vm("a"));
        assert!(!q.is_quiet(&None) && !q.is_quiet(&vm("a")));
        assert!(q.by_ns.is_empty(), "nothing left counted: {:?}", q.by_ns);
        // A release of what is not held changes nothing.
        q.release(&vm("b"));
        assert!(q.by_ns.is_empty());
    }

    #[test]
    fn quiet_all_quiets_every_namespace_beside_the_counted_ones() {
        let mut q = Quieted::default();
        q.hold(&vm("a"));
        q.all += 1;
        assert!(q.is_quiet(&vm("b")) && q.is_quiet(&None));
        q.all -= 1;
        assert!(!q.is_quiet(&vm("b")) && q.is_quiet(&vm("a")));
    }
}
