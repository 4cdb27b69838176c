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
//! - A firewall or public IPv4 change of the recorded shape goes in as one rule batch over the
//!   kept socket ([`NftGens::change_rules`]) when nothing else committed since the record; the
//!   table is then recorded unlisted (the next check lists it). A create records its table the
//!   same way when its transactions were the only commits in the new netns
//!   ([`NftGens::adopt_created`]).
//! - One socket per VM netns, opened by the create (or on the first thread that enters the
//!   netns for a listing) and kept until the VM goes: [`NftGens::close`] (the driver's removal, DELETE and garbage
//!   collection) closes it synchronously, so the deleted netns, and the host veth end with it,
//!   is destroyed as soon as the kernel gets to it. A netns path that no longer names the
//!   socket's namespace (deleted by hand, made again) closes the socket and drops the record
//!   at the next check. A socket that fails is closed; the check then lists as before.
//! - A socket is only ever closed after it was taken out of the map, never under its lock: a
//!   close may wait for the kernel's pending nf_tables releases (see [`crate::nftgen`]).
//! - An agent that stops saves its records ([`super::gens_saved`]): per netns its cookie
//!   (unique until the host reboots), the generation and the plan's fingerprints. The next
//!   agent takes them as the records of the sockets it opens ([`NftGens::resume_here`]) when the
//!   netns has that cookie, is still at that generation and the plan has that fingerprint:
//!   nothing committed there since a listing showed the table as planned, so a restart lists
//!   no table that nobody touched. Any other case lists, as without a record.
//!
//! # Limitations
//! One file descriptor per VM netns (the agent raises its soft `RLIMIT_NOFILE` to the hard
//! limit at start).

use std::collections::HashMap;
use std::sync::Mutex;

use vmnet_plan::ns::VmPlan;

use super::gens_saved::SavedTable;
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
    synced: Option<Synced>,
}

/// The table as last known: made or found as planned at generation `at`.
struct Synced {
    /// The plan's fingerprint.
    fp: String,
    /// The plan's shape fingerprint.
    shape: String,
    /// The generation.
    at: u32,
    /// Whether a listing showed it so (`false` after a rule batch: the next check lists).
    listed: bool,
}

impl Synced {
    fn of(plan: &VmPlan, at: u32, listed: bool) -> Self {
        Self {
            fp: plan.nft_fingerprint.clone(),
            shape: plan.nft_shape.clone(),
            at,
            listed,
        }
    }
}

/// What [`NftGens::change_rules`] did.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum RuleChange {
    /// The batch was committed.
    Done,
    /// The table is not known to be of that shape at the current generation: replace it whole.
    NotEligible,
}

/// The kept sockets and records, by netns name, and the records an earlier agent saved not
/// yet taken (see the module docs).
#[derive(Default)]
pub(super) struct NftGens {
    kept: Mutex<HashMap<String, Kept>>,
    saved: Mutex<HashMap<String, SavedTable>>,
}

impl std::fmt::Debug for NftGens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NftGens").finish_non_exhaustive()
    }
}

impl NftGens {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Kept>> {
        self.kept
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn lock_saved(&self) -> std::sync::MutexGuard<'_, HashMap<String, SavedTable>> {
        self.saved
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The records worth saving for the next agent: tables a listing showed as planned, in a
    /// netns whose cookie is known, and the records taken from the agent before that no check
    /// has used yet.
    pub(super) fn to_save(&self) -> Vec<SavedTable> {
        let map = self.lock();
        let mut out: Vec<SavedTable> = map
            .iter()
            .filter_map(|(netns, kept)| {
                let s = kept.synced.as_ref().filter(|s| s.listed)?;
                Some(SavedTable {
                    netns: netns.clone(),
                    cookie: kept.sock.cookie()?,
                    generation: s.at,
                    fingerprint: s.fp.clone(),
                    shape: s.shape.clone(),
                })
            })
            .collect();
        // Taken from the agent before and not used yet: as valid as when it saved them.
        let saved = self.lock_saved();
        out.extend(
            saved
                .values()
                .filter(|t| !map.contains_key(&t.netns))
                .cloned(),
        );
        drop(saved);
        drop(map);
        out.sort_by(|a, b| a.netns.cmp(&b.netns));
        out
    }

    /// Holds `tables`, saved by an earlier agent of this boot, for [`Self::resume_here`].
    pub(super) fn restore(&self, tables: Vec<SavedTable>) {
        let mut saved = self.lock_saved();
        saved.clear();
        saved.extend(tables.into_iter().map(|t| (t.netns.clone(), t)));
    }

    /// On a thread inside `netns`: takes the saved record of `netns`, if any, and makes it the
    /// kept socket's record when the netns is the one it was saved for (same cookie), nothing
    /// committed there since (same generation) and the plan is the same (`fp`). Returns whether
    /// it did: the table is then as planned, without a listing. The record is used once.
    pub(super) fn resume_here(&self, netns: &str, fp: &str) -> bool {
        let Some(rec) = self.lock_saved().remove(netns) else {
            return false;
        };
        if rec.fingerprint != fp {
            return false;
        }
        let Some(now) = self.read_here(netns) else {
            return false;
        };
        let mut map = self.lock();
        let Some(kept) = map.get_mut(netns) else {
            return false;
        };
        if kept.sock.netns() != now.netns
            || kept.sock.cookie() != Some(rec.cookie)
            || now.id != rec.generation
        {
            return false;
        }
        kept.synced = Some(Synced {
            fp: rec.fingerprint,
            shape: rec.shape,
            at: now.id,
            listed: true,
        });
        true
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
        let Some(at) = kept
            .synced
            .as_ref()
            .filter(|s| s.listed && s.fp == fp)
            .map(|s| s.at)
        else {
            return false;
        };
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

    /// Records that the table of `netns` was found as `plan` says by a listing read after
    /// generation `at` was read. Ignored when the kept socket is not the one `at` was read over
    /// (closed or replaced meanwhile).
    pub(super) fn found_in_sync(&self, netns: &str, plan: &VmPlan, at: Generation) {
        let synced = Synced::of(plan, at.id, true);
        if let Some(kept) = self.lock().get_mut(netns)
            && kept.sock.netns() == at.netns
        {
            kept.synced = Some(synced);
        }
    }

    /// Changes the table of `netns`, known to be of `plan`'s shape at the generation the netns
    /// is at now, into `plan` by `batch` (one transaction over the kept socket, from any
    /// thread). Records
    /// the table as `plan` when the generation moved by exactly that commit, to be listed at
    /// the next check. [`RuleChange::NotEligible`] (nothing
    /// sent) when no socket is kept, its path names another namespace, nothing is recorded, the
    /// recorded shape differs or anything committed since.
    ///
    /// # Errors
    /// `batch`'s error (nothing was committed; the record is dropped).
    pub(super) fn change_rules(
        &self,
        netns: &str,
        plan: &VmPlan,
        batch: impl FnOnce(&mut crate::nfnl::NfnlSocket) -> Result<(), crate::nfnl::NetfilterError>,
    ) -> Result<RuleChange, crate::nfnl::NetfilterError> {
        let next = Synced::of(plan, 0, false);
        let now = NsId::of_path(&netns::path(netns)).ok();
        let mut map = self.lock();
        let Some(kept) = map.get_mut(netns) else {
            return Ok(RuleChange::NotEligible);
        };
        let Some(at) = kept
            .synced
            .as_ref()
            .filter(|s| s.shape == next.shape && now == Some(kept.sock.netns()))
            .map(|s| s.at)
        else {
            return Ok(RuleChange::NotEligible);
        };
        // Nothing committed since: the table is the recorded one. The kept socket serializes
        // this with the other checks of this netns (under the map's lock: a few round trips).
        if kept.sock.read().ok() != Some(at) {
            kept.synced = None;
            return Ok(RuleChange::NotEligible);
        }
        kept.synced = None;
        batch(kept.sock.nfnl())?;
        if kept.sock.read().ok() == Some(at.wrapping_add(1)) {
            kept.synced = Some(Synced {
                at: at.wrapping_add(1),
                ..next
            });
        }
        Ok(RuleChange::Done)
    }

    /// After our own transaction: records the table as planned by `plan` when the generation
    /// moved by exactly one commit from `before` to `after` (no one else's between) and the
    /// listing read back after `after` was the plan's (`listed_in_sync`); otherwise drops any
    /// record, so the next check lists the table.
    pub(super) fn after_commit(
        &self,
        netns: &str,
        plan: &VmPlan,
        before: Option<Generation>,
        after: Option<Generation>,
        listed_in_sync: bool,
    ) {
        match (before, after) {
            (Some(b), Some(a))
                if listed_in_sync && b.netns == a.netns && a.id == b.id.wrapping_add(1) =>
            {
                self.found_in_sync(netns, plan, a);
            }
            _ => self.forget_sync(netns),
        }
    }

    /// Keeps `sock`, opened in the netns `netns` just created, and records its table as `plan`
    /// at generation `at`: given when our create's transactions were the only commits there
    /// (the generation read over `sock` before them moved by exactly their number). Recorded
    /// unlisted: the next check lists the table, and a firewall change may go in as a rule
    /// batch before that. A socket kept for an earlier namespace of that name is closed.
    pub(super) fn adopt_created(
        &self,
        netns: &str,
        sock: GenSocket,
        at: Option<u32>,
        plan: &VmPlan,
    ) {
        let synced = at.map(|at| Synced::of(plan, at, false));
        let stale = self.lock().insert(netns.to_owned(), Kept { sock, synced });
        drop(stale);
    }

    /// Drops the record of `netns` (keeps its socket): the next check lists the table.
    pub(super) fn forget_sync(&self, netns: &str) {
        if let Some(kept) = self.lock().get_mut(netns) {
            kept.synced = None;
        }
    }

    /// Closes the kept socket of `netns` (here, synchronously) and drops its record and any
    /// record taken from the agent before: call it when the VM's netns is deleted. Returns
    /// whether a socket was kept.
    pub(super) fn close(&self, netns: &str) -> bool {
        self.lock_saved().remove(netns);
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
