//! The driver's generation check of each VM's netns table: one kept netfilter socket per VM
//! netns ([`crate::nftgen::GenSocket`]) and the generation at which the table was last found
//! as planned.
//!
//! # Design
//! - A table listed and found in sync with plan `fp` after generation G was read is recorded
//!   as (fp, G). While the netns's generation is still G and the plan is still `fp`, nothing in
//!   that netns changed, so observe and the firewall audit skip the listing and the comparison
//!   ([`NftGens::unchanged`]): one `NFT_MSG_GETGEN` over the kept socket and a `stat` of the
//!   netns path, without entering the netns. Any commit there, ours or anyone's, moves the
//!   generation and brings the full comparison back.
//! - The generation is read *before* the listing: a change between the two moves it past G,
//!   so the next check lists again (never a wrong skip). After our own transaction the table
//!   is recorded only when the generation moved by exactly that one commit (read before and
//!   after it) and the listing read back is the plan's.
//! - One socket per VM netns, opened on the first thread that enters the netns for a listing
//!   and kept until the VM goes: [`NftGens::close`] (the driver's removal, DELETE and garbage
//!   collection) closes it synchronously, so the deleted netns, and the host veth end with it,
//!   is destroyed as soon as the kernel gets to it. A netns path that no longer names the
//!   socket's namespace (deleted by hand, made again) closes the socket and drops the record
//!   at the next check. A socket that fails is closed; the check then lists as before.
//! - A socket is only ever closed after it was taken out of the map, never under its lock: a
//!   close may wait for the kernel's pending nf_tables releases (see [`crate::nftgen`]).
//! - Nothing survives the process: after an agent restart every table is listed once.
//!
//! # Limitations
//! One file descriptor per VM netns (the agent raises its soft `RLIMIT_NOFILE` to the hard
//! limit at start).

use std::collections::HashMap;
use std::sync::Mutex;

use crate::netns;
use crate::nftgen::{GenSocket, NsId};

/// A generation read over the kept socket of one netns: which namespace, and its count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Generation {
    netns: NsId,
    id: u32,
}

struct Kept {
    sock: GenSocket,
    /// The plan fingerprint and the generation at which the table was found as planned.
    synced: Option<(String, u32)>,
}

/// The kept sockets and records, by netns name (see the module docs).
#[derive(Default)]
pub(super) struct NftGens(Mutex<HashMap<String, Kept>>);

impl std::fmt::Debug for NftGens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NftGens").finish_non_exhaustive()
    }
}

impl NftGens {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Kept>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether the table of `netns` was found as planned by `fp` at the generation the netns is
    /// at now. `false` (list and compare) when nothing is recorded, the plan differs, the path
    /// names another namespace now (the stale socket is closed) or the read fails (closed).
    /// Callable from any thread.
    pub(super) fn unchanged(&self, netns: &str, fp: &str) -> bool {
        let now = NsId::of_path(&netns::path(netns)).ok();
        let mut map = self.lock();
        let Some(kept) = map.get_mut(netns) else {
            return false;
        };
        if now != Some(kept.sock.netns()) {
            let stale = map.remove(netns);
            drop(map);
            drop(stale);
            return false;
        }
        let Some((sfp, at)) = kept.synced.as_ref().map(|(f, g)| (f.clone(), *g)) else {
            return false;
        };
        if sfp != fp {
            return false;
        }
        match kept.sock.read() {
            Ok(id) => id == at,
            Err(e) => {
                tracing::debug!(netns, error = %e, "nf_tables generation read failed; listing the table");
                let failed = map.remove(netns);
                drop(map);
                drop(failed);
                false
            }
        }
    }

    /// The generation of `netns` now, read on a thread inside it: over the kept socket, or over
    /// one opened here and kept (also when the kept one is of another namespace, which is then
    /// closed). `None` when no socket can be opened or the read fails (the table is then
    /// listed without a record).
    pub(super) fn read_here(&self, netns: &str) -> Option<Generation> {
        let here = NsId::here().ok()?;
        let mut map = self.lock();
        let mut stale = None;
        if map.get(netns).is_some_and(|k| k.sock.netns() != here) {
            stale = map.remove(netns);
        }
        if !map.contains_key(netns) {
            match GenSocket::open_here() {
                Ok(sock) => {
                    map.insert(netns.to_owned(), Kept { sock, synced: None });
                }
                Err(e) => {
                    tracing::debug!(netns, error = %e, "cannot open an nf_tables generation socket");
                    drop(map);
                    drop(stale);
                    return None;
                }
            }
        }
        let kept = map.get_mut(netns).expect("present or inserted above");
        let read = kept.sock.read();
        let (res, failed) = match read {
            Ok(id) => (
                Some(Generation {
                    netns: kept.sock.netns(),
                    id,
                }),
                None,
            ),
            Err(e) => {
                tracing::debug!(netns, error = %e, "nf_tables generation read failed");
                (None, map.remove(netns))
            }
        };
        drop(map);
        drop(stale);
        drop(failed);
        res
    }

    /// Records that the table of `netns` was found as planned by `fp` by a listing read after
    /// generation `at` was read. Ignored when the kept socket is not the one `at` was read
    /// over (closed or replaced meanwhile).
    pub(super) fn found_in_sync(&self, netns: &str, fp: &str, at: Generation) {
        if let Some(kept) = self.lock().get_mut(netns)
            && kept.sock.netns() == at.netns
        {
            kept.synced = Some((fp.to_owned(), at.id));
        }
    }

    /// After our own transaction: records the table as planned by `fp` when the generation
    /// moved by exactly one commit from `before` to `after` (no one else's between) and the
    /// listing read back after `after` was the plan's (`listed_in_sync`); otherwise drops any
    /// record, so the next check lists the table.
    pub(super) fn after_commit(
        &self,
        netns: &str,
        fp: &str,
        before: Option<Generation>,
        after: Option<Generation>,
        listed_in_sync: bool,
    ) {
        match (before, after) {
            (Some(b), Some(a))
                if listed_in_sync && b.netns == a.netns && a.id == b.id.wrapping_add(1) =>
            {
                self.found_in_sync(netns, fp, a);
            }
            _ => self.forget_sync(netns),
        }
    }

    /// Drops the record of `netns` (keeps its socket): the next check lists the table.
    pub(super) fn forget_sync(&self, netns: &str) {
        if let Some(kept) = self.lock().get_mut(netns) {
            kept.synced = None;
        }
    }

    /// Closes the kept socket of `netns` (here, synchronously) and drops its record: call it
    /// when the VM's netns is deleted. Returns whether one was kept.
    pub(super) fn close(&self, netns: &str) -> bool {
        let kept = self.lock().remove(netns);
        let was = kept.is_some();
        let started = std::time::Instant::now();
        drop(kept);
        if was {
            tracing::trace!(
                netns,
                micros = started.elapsed().as_micros(),
                "closed the nf_tables generation socket"
            );
        }
        was
    }
}
