//! Repair on the kernel's change notifications: a change to something vmnet owns is checked
//! and repaired as soon as the kernel reports it, through the reconcile pass's own per-VM path.
//!
//! # Design
//! - The driver's watcher ([`vmnet_kernel::watch`]) reports "namespace X changed (kind)" for
//!   the host and every VM netns. Each event is attributed ([`attribute`]): everything in a
//!   VM's netns is that VM's; in the host, a host veth end (by name or derived ifindex), a
//!   VM's routing table or a rule naming its veth is that VM's, vmnet's host nft table is the
//!   host-wide state, a proxy entry or the public address table asks for a full pass (which VM
//!   it was for is not in the message), pool mode's tables ask for its audit and its taps for
//!   its pass; anything else in the host (another program's links, routes, tables) asks for
//!   nothing. Lost notifications (a receive buffer overran) ask for a full pass.
//! - Checks are debounced per target ([`schedule`]): the first notification makes the check
//!   due 30 ms later, and the notifications until then join it, so an `nft flush ruleset`
//!   (one message per chain and rule) is one check and one repair.
//! - A VM is checked exactly as a full pass checks it: under the kernel lock, its row re-read,
//!   its desired config applied by [`Agent::converge`] (observe, compare, repair what differs;
//!   an in-sync VM costs an observe and writes nothing, to the kernel or the store). The host
//!   is checked by the driver's `repair_host`, a full pass is [`Agent::reconcile`], pool mode's
//!   tables by its audit ([`crate::pool::audit::audit_once`]) and its taps by its pass.
//! - A VM's check that repaired something schedules a check of every VM with a route via its
//!   mesh address: while the gateway was broken (its host veth end down or without IPv6),
//!   their routes through it resolved to the `unreachable` guard, and nothing of theirs
//!   changes when the gateway comes back. A check that finds them in sync writes nothing.
//! - The agent's own changes (API changes, passes, audits) never trigger a check: they run
//!   under the kernel lock, which quiets the namespaces the change touches (the host and the
//!   netns of the VMs it changes) and discards their notifications before it is released
//!   ([`crate::agent::kernel`]). The notifications of every other VM's netns are kept: a
//!   foreign change there is checked right after the change that holds the lock. Sorting
//!   notifications by the sender's port id instead does not work: link changes are notified
//!   with port id 0, and nft changes made by the `nft` executable carry its own. A check on a
//!   notification quiets nothing: it writes only when it repairs, and the notifications of its
//!   repair cost one more check that finds nothing, while a foreign change made during the
//!   check (a storm undoing the repair at once) is never lost. Pool mode's helper changes its
//!   tables outside the lock: a notification of its own change costs one audit that finds
//!   nothing and writes nothing.
//! - A target repaired more than 5 times in 10 s (another program keeps undoing vmnet's
//!   state), or checked more than 20 times in 10 s, is backed off: its next check waits
//!   250 ms, doubling with each further repair up to the reconcile interval; a back-off is
//!   counted each time and logged at most once per interval. A check that repairs nothing
//!   ends it. The agent never spins: a storm of changes costs at most one check per target
//!   per back-off delay.
//! - Counted in `GET /v1/status` (`reconcile.notifications`): events, lost notifications,
//!   checks, repairs, back-offs, and the time from the first notification of a change to the
//!   end of its repair (last and max). Repairs also count in `drift_repairs_total`.
//! - The passes stay as they are: the backstop for what has no notification (sysctls), for
//!   notifications lost or discarded (a foreign change made while the agent changed the same
//!   VM netns, or the host while the agent changed any VM), and for VMs whose netns could not
//!   be watched.

pub mod attribute;
pub mod schedule;

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc::UnboundedReceiver;
use vmnet_ipam::vm_store;
use vmnet_kernel::ns::{Change, ObjectKind};
use vmnet_kernel::watch::{Event, What};
use vmnet_model::Error;
use vmnet_model::vm::parse_vm_config;
use vmnet_plan::ns::PublicNeighbors;

use crate::agent::{Agent, store_tx};
use crate::events;
use crate::repairs::{Repaired, Trigger};
use attribute::Names;
use schedule::{Schedule, Target, Tuning};

impl Agent {
    /// Starts the repair on notifications (see the module docs) with the driver's `events`
    /// ([`vmnet_kernel::ns::NetlinkNsDriver::watch_kernel`]); it runs until the task is
    /// aborted or the events end. Call it after pool mode is set, if it runs.
    pub fn start_watching(
        self: &Arc<Self>,
        events: UnboundedReceiver<Event>,
    ) -> tokio::task::JoinHandle<()> {
        if let Ok(mut r) = self.record.lock() {
            r.notifications.on = true;
        }
        tokio::spawn(Arc::clone(self).watch_loop(events))
    }

    async fn watch_loop(self: Arc<Self>, mut events: UnboundedReceiver<Event>) {
        let names = Names {
            prefix: self.settings().name_prefix.clone(),
            table_base: self.settings().host_table_base,
            pool: self.pool().is_some(),
            uplink: self
                .settings()
                .uplink
                .clone()
                .filter(|_| self.settings().public_neighbors == PublicNeighbors::Proxy),
        };
        let mut sched = Schedule::new(Tuning::agent(self.interval()));
        loop {
            self.loops.beat(crate::health::Loop::Watch);
            let next = sched.next_due();
            tokio::select! {
                // The loop is alive while it waits: it beats every `Loops::idle_beat`.
                () = tokio::time::sleep(self.loops.idle_beat()) => {}
                ev = events.recv() => {
                    let Some(ev) = ev else {
                        self.loops.end(crate::health::Loop::Watch);
                        return;
                    };
                    self.notified(&names, &mut sched, &ev);
                    // Take what else is queued before sleeping.
                    while let Ok(ev) = events.try_recv() {
                        self.notified(&names, &mut sched, &ev);
                    }
                }
                () = sleep_until(next) => {
                    for (target, first) in sched.take_due(Instant::now()) {
                        self.check_notified(&mut sched, target, first).await;
                    }
                }
            }
        }
    }

    fn notified(&self, names: &Names, sched: &mut Schedule, ev: &Event) {
        let Some(target) = names.target(ev) else {
            return;
        };
        if let Ok(mut r) = self.record.lock() {
            r.notifications.events_total += 1;
            if ev.what == What::Lost {
                r.notifications.lost_total += 1;
            }
        }
        tracing::debug!(netns = ?ev.netns, what = ?ev.what, scope = %target, "kernel change notified");
        sched.notified(target, ev.at);
    }

    /// Runs the check of `target` and records it; `first` is when its first notification
    /// was read.
    async fn check_notified(&self, sched: &mut Schedule, target: Target, first: Instant) {
        let (done, behind) = match self.check_target(target).await {
            Ok((done, behind)) => {
                if !done.is_empty() {
                    let lines: Vec<&str> = done.iter().map(|r| r.line.as_str()).collect();
                    tracing::warn!(scope = %target, op = "repair", repairs = ?lines, "repaired on a kernel notification");
                    if target != Target::Pass {
                        // A full pass counts its own repairs.
                        self.metrics
                            .count_repairs(crate::metrics::Trigger::Notification, &lines);
                    }
                }
                (done, behind)
            }
            Err(e) => {
                tracing::warn!(scope = %target, "check on a kernel notification failed: {e}");
                (Vec::new(), Vec::new())
            }
        };
        let repaired = done.len() as u64;
        for uid in behind {
            sched.notified(Target::Vm(uid), Instant::now());
        }
        let took = u64::try_from(first.elapsed().as_micros()).unwrap_or(u64::MAX);
        let backoff = sched.checked(target, repaired > 0, Instant::now());
        if let Ok(mut r) = self.record.lock() {
            let n = &mut r.notifications;
            n.checks_total += 1;
            n.backoffs_total = sched.backoffs_total;
            if repaired > 0 {
                n.repairs_total += repaired;
                n.last_change_to_repair_us = Some(took);
                n.max_change_to_repair_us = Some(n.max_change_to_repair_us.unwrap_or(0).max(took));
                r.repairs.change_to_repair.record(took);
                if target != Target::Pass {
                    // A full pass counts its own repairs.
                    r.drift_repairs_total += repaired;
                    let kinds: Vec<ObjectKind> =
                        done.iter().flat_map(|d| d.kinds.iter().copied()).collect();
                    r.repairs.record(Trigger::Notification, repaired, &kinds);
                }
            }
        }
        if let Some(b) = backoff.filter(|b| b.log) {
            tracing::warn!(
                scope = %target,
                repairs_in_window = b.repairs,
                delay_ms = u64::try_from(b.delay.as_millis()).unwrap_or(u64::MAX),
                "another program keeps changing this; its repairs are backed off"
            );
        }
    }

    /// Checks and repairs `target`; returns the repairs made and the VMs to check next (those
    /// behind a repaired VM, see the module docs).
    async fn check_target(&self, target: Target) -> Result<(Vec<Repaired>, Vec<u32>), Error> {
        let done = match target {
            Target::Vm(uid) => return self.check_vm(uid).await,
            Target::Host => {
                self.yield_to_api().await;
                let _kernel = self.kernel.lock_checking("notification: host state").await;
                let changes = self
                    .driver()
                    .repair_host()
                    .await
                    .map_err(|e| Error::unavailable(format!("host: {e}")))?;
                self.emit_drift(None, &changes, events::Trigger::Notification);
                Ok(changes
                    .iter()
                    .filter_map(|c| Repaired::of("host", &[c]))
                    .collect())
            }
            // The pass counts its repairs' kinds itself.
            Target::Pass => Ok(self
                .reconcile_notified()
                .await?
                .repaired
                .into_iter()
                .map(|line| Repaired {
                    line,
                    kinds: Vec::new(),
                })
                .collect()),
            Target::Proxies => self.check_proxies().await,
            Target::PoolTables => {
                let Some(p) = self.pool() else {
                    return Ok((Vec::new(), Vec::new()));
                };
                let drift = p.runtime().audit_now().await;
                let mut kinds: Vec<ObjectKind> = drift
                    .iter()
                    .map(|d| ObjectKind::of_nft_difference(d))
                    .collect();
                kinds.sort_unstable();
                kinds.dedup();
                self.emit_host_lines("pool_tables", &drift, events::Trigger::Notification);
                Ok((!drift.is_empty())
                    .then(|| Repaired {
                        line: format!("pool: tables: {}", drift.join("; ")),
                        kinds,
                    })
                    .into_iter()
                    .collect())
            }
            Target::PoolTaps => {
                if let Some(p) = self.pool() {
                    let o = p.converge(self.db()).await?;
                    if !o.errors.is_empty() {
                        tracing::warn!(errors = ?o.errors, "pool pass on a tap notification had errors");
                    }
                }
                Ok(Vec::new())
            }
        };
        done.map(|d| (d, Vec::new()))
    }

    /// The reconcile pass's check of one VM, by user id: under the kernel lock, its stored row
    /// applied by [`Agent::converge`]. Returns its repairs and, when it had any, the VMs behind
    /// it (from the rows read to find it).
    async fn check_vm(&self, uid: u32) -> Result<(Vec<Repaired>, Vec<u32>), Error> {
        let rows = store_tx!(self.db(), tx => vm_store::list(tx).await)?;
        let Some(id) = rows.iter().find(|r| r.user_id == uid).map(|r| r.id.clone()) else {
            // Not a stored VM's (one being removed, or an orphan for the pass's collection).
            return Ok((Vec::new(), Vec::new()));
        };
        self.yield_to_api().await;
        let _kernel = self
            .kernel
            .lock_checking(format!("notification: vm {id}"))
            .await;
        let Some(row) = store_tx!(self.db(), tx => vm_store::get(tx, &id).await)? else {
            return Ok((Vec::new(), Vec::new()));
        };
        if row.user_id != uid {
            return Ok((Vec::new(), Vec::new()));
        }
        let done: Vec<Repaired> = self
            .converge(&row, Trigger::Notification)
            .await?
            .into_iter()
            .collect();
        // The VMs routing via this one's mesh address resolved their routes against it while
        // it was broken (an `unreachable` guard in their tables): checked next.
        let behind = if done.is_empty() {
            Vec::new()
        } else {
            behind_gateway(&rows, uid)
        };
        Ok((done, behind))
    }

    /// Every stored VM's proxy entries on the uplink, checked and repaired by the driver's
    /// comparison of them ([`vmnet_kernel::ns::NsDriver::repair_proxies`], what an apply runs),
    /// one VM at a time under the kernel lock: one lookup per entry, nothing written when all
    /// are there. Only VMs with a public address and their desired config applied (the check
    /// of a VM mid-change or failed is its own apply's or the pass's).
    async fn check_proxies(&self) -> Result<Vec<Repaired>, Error> {
        let rows = store_tx!(self.db(), tx => vm_store::list(tx).await)?;
        let ids: Vec<String> = rows
            .into_iter()
            .filter(|r| {
                parse_vm_config(r.config.as_bytes())
                    .is_ok_and(|c| c.public_ipv4.is_some() || c.public_ipv6.is_some())
            })
            .map(|r| r.id)
            .collect();
        let mut out = Vec::new();
        for id in ids {
            self.yield_to_api().await;
            let _kernel = self
                .kernel
                .lock_checking(format!("notification: proxy entries of vm {id}"))
                .await;
            let Some(row) = store_tx!(self.db(), tx => vm_store::get(tx, &id).await)? else {
                continue;
            };
            if row.last_error.is_some() || row.applied.as_deref() != Some(row.config.as_str()) {
                continue;
            }
            let Ok(config) = parse_vm_config(row.config.as_bytes()) else {
                continue;
            };
            let plan = self.plan(&config)?;
            let changes = self
                .driver()
                .repair_proxies(&plan)
                .await
                .map_err(|e| Error::unavailable(format!("vm {id}: proxy entries: {e}")))?;
            let changes: Vec<&Change> = changes.iter().collect();
            let at = Some((id.as_str(), config.user_id, plan.netns.as_str()));
            self.emit_drift(at, changes.iter().copied(), events::Trigger::Notification);
            out.extend(Repaired::of(&format!("vm {id}"), &changes));
        }
        Ok(out)
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t.into()).await,
        None => std::future::pending().await,
    }
}

/// The user ids of the stored VMs with a route via the mesh address of the VM with user id
/// `gateway` (its desired config's).
fn behind_gateway(rows: &[vm_store::VmRow], gateway: u32) -> Vec<u32> {
    let mesh = |r: &vm_store::VmRow| {
        parse_vm_config(r.config.as_bytes())
            .ok()
            .map(|c| (c.mesh_ipv6, c.network.routes))
    };
    let Some(Some(gw)) = rows
        .iter()
        .find(|r| r.user_id == gateway)
        .and_then(mesh)
        .map(|(m, _)| m)
    else {
        return Vec::new();
    };
    rows.iter()
        .filter(|r| r.user_id != gateway)
        .filter(|r| {
            mesh(r).is_some_and(|(_, routes)| {
                routes
                    .iter()
                    .any(|rt| rt.via == vmnet_model::vm::Via::Mesh(gw))
            })
        })
        .map(|r| r.user_id)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(uid: u32, routes: &str) -> vm_store::VmRow {
        vm_store::VmRow {
            id: format!("v{uid}"),
            user_id: uid,
            mesh: None,
            config: format!(
                r#"{{"id":"v{uid}","user_id":{uid},"tenant":1,"mesh_ipv6":"fdaa:1::{uid:x}","network":{{"routes":{routes}}}}}"#
            ),
            applied: None,
            last_error: None,
            updated_at: 0,
        }
    }

    #[test]
    fn the_vms_behind_a_gateway_are_those_routing_via_its_mesh_address() {
        let via7 = r#"[{"destination":"2000::/3","via":"fdaa:1::7"}]"#;
        let via8 = r#"[{"destination":"2000::/3","via":"fdaa:1::8"}]"#;
        let host = r#"[{"destination":"0.0.0.0/0","via":"host"}]"#;
        let rows = vec![
            row(7, host),
            row(1, via7),
            row(2, via8),
            row(3, via7),
            row(8, "[]"),
        ];
        assert_eq!(behind_gateway(&rows, 7), [1, 3]);
        assert_eq!(behind_gateway(&rows, 8), [2]);
        assert!(behind_gateway(&rows, 1).is_empty());
        assert!(behind_gateway(&rows, 99).is_empty());
    }
}
