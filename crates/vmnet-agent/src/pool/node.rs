//! Pool mode on this host: the instances the store places here, realised as NICs (rules, then
//! taps on the bridge) and NoCloud seeds (spec: hosted-pool-networking.md, "What reaches the
//! host", "The guest's network configuration", "bcd's nftables tables").
//!
//! # Design
//! - Desired state comes from the store alone: every `running` instance whose `host_id` is this
//!   host gets one NIC ([`vmnet_plan::pool::nic::instance_spec`]): the host bridge, the MAC from
//!   its id, its lease in CIDR form with the range's gateway and nameservers, or no addresses
//!   (DHCP) when it holds no lease; its `allocation_id`, network policy and sandbox flag come
//!   from the stored instance.
//! - [`PoolNode::converge`] compares that with what it realised (kept in memory, the same set the
//!   firewall holds) and the taps the kernel lists: an instance gone is stopped (taps deleted,
//!   then its elements), a new one is started (elements first, then taps), a tap missing under a
//!   realised instance is made again, and any other link named like an instance tap
//!   ([`is_instance_tap`]) whose instance is neither placed here nor realised is deleted as an
//!   orphan, then the elements of such taps. Each start, update and stop goes through the one
//!   orchestrator, [`vmnet_kernel::pool::host`]: a start that fails undoes only what it made,
//!   so a tap that existed before (a VM running under an earlier agent) is never deleted by a
//!   failed start, nor collected while its instance is placed here. Every collection (a tap, an
//!   instance's NICs, elements, a seed) is logged with the object and the reason.
//! - An instance whose spec changed (a new lease, gateway or nameservers after its range was
//!   replaced) is updated in place when its taps stay the same (same NIC count, so the same tap
//!   names, each NIC on the same bridge): its changed elements are swapped in one nft
//!   transaction ([`replace_instance`]), each tap is ensured again with its new entry (the tap
//!   and the VMM's fd on it stay; the guard and the bridge port are updated) and its seed is
//!   rewritten. Only a changed NIC count or bridge stops and starts it (its taps are made
//!   again). The spec: taps are deleted when the VM stops or is destroyed.
//! - Seeds are written for every realised instance and removed for the rest. Passes are
//!   serialized; one instance's failure is recorded and does not stop the others.
//! - The host's addresses (for the host-address drop) are read from the kernel on every pass,
//!   the gateways are those of the ranges of the instances here; when either changes the tables
//!   are replaced in full (the only change that rewrites every rule).
//! - On start ([`PoolNode::start`]) the tables are loaded, before any tap is touched, with the
//!   tap entries of every instance the store places here, so taps left by an earlier agent keep
//!   their rules and the backstop tables stay (no window in which they are gone); a tap of an
//!   instance no longer placed here is closed (its port is not in the `taps` set) until the
//!   first pass deletes it.
//!
//! - The agent stopping (or dying) leaves taps, tables and seeds in place, so running VMs keep
//!   their network; a restarted agent loads the tables (with the placed instances' taps), then
//!   its first pass reuses the taps of instances still placed here (their elements are already
//!   there, so nothing is applied for them) and collects the rest, with their elements.
//!
//! [`replace_instance`]: vmnet_kernel::pool::firewall::PoolFirewall::replace_instance
//!
//! # Limitations
//! One NIC per instance, on the one bridge given to the agent. A stored instance's policy and
//! sandbox flag are fixed at creation (there is no update call yet). Status-report addresses are
//! not merged here.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::sync::Mutex;
use vmnet_ipam::Db;
use vmnet_kernel::pool::firewall::{FirewallError, NftExec};
use vmnet_kernel::pool::host::{self, InstanceRules, PoolHostError};
use vmnet_model::Error;
use vmnet_model::nic::{IfName, InstanceSpec};
use vmnet_plan::nftdiff::Tables;
use vmnet_plan::pool::nft::{Firewall, HostAddrs, tap_entries};

pub use super::desired::{NicRanges, is_instance_tap, spec_of};
use super::desired::{TAP_PREFIX_LEN, desired, first_taps, same_taps, tap_prefix};
use super::runtime::{AgentFirewall, PoolRuntime};
use super::seeds;
use super::taps::PoolTaps;
use crate::api::error::from_pool;
use crate::status::{PoolStatus, now_ms};

/// How the agent runs pool mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolConfig {
    /// This host's id in the store (`vmnet serve --host-id`).
    pub host_id: String,
    /// The bridge every instance NIC joins (`--bridge`, default `br0`).
    pub bridge: IfName,
    /// Where the seeds go (`<state dir>/pool/seeds`).
    pub seed_dir: PathBuf,
    /// Whether to build the `cidata` image next to the seed files.
    pub seed_images: bool,
}

/// What one pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolPassOutcome {
    /// Instances started in this pass.
    pub started: Vec<String>,
    /// Instances stopped in this pass.
    pub stopped: Vec<String>,
    /// Realised instances whose spec changed under the same taps, updated in place (elements
    /// swapped, taps ensured again, seed rewritten) in this pass.
    pub updated: Vec<String>,
    /// Taps made again under a realised instance.
    pub taps_repaired: Vec<String>,
    /// Orphaned `bc*` links deleted.
    pub orphans_deleted: Vec<String>,
    /// Errors, one line each naming the instance or object.
    pub errors: Vec<String>,
}

#[derive(Debug, Default)]
struct Record {
    passes: u64,
    last_pass_at_unix_ms: Option<i64>,
    last_errors: Vec<String>,
}

/// The pool-mode state of this host (see the module docs).
pub struct PoolNode {
    cfg: PoolConfig,
    runtime: PoolRuntime,
    taps: Arc<dyn PoolTaps>,
    /// Realised instances by id; the pass lock.
    realised: Mutex<BTreeMap<String, InstanceSpec>>,
    record: StdMutex<Record>,
    /// When pool mode started, ms since the Unix epoch.
    started_at_unix_ms: i64,
}

impl std::fmt::Debug for PoolNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolNode").field("cfg", &self.cfg).finish()
    }
}

/// [`InstanceRules`] over a node's firewall (each call on a blocking thread).
struct NodeRules<'a>(&'a PoolNode);

impl InstanceRules for NodeRules<'_> {
    fn set<'a>(&'a mut self, inst: &'a InstanceSpec) -> BoxFuture<'a, Result<bool, PoolHostError>> {
        let s = inst.clone();
        Box::pin(self.0.fw_host(move |fw| {
            let held = fw.holds(&s.id);
            fw.replace_instance(&s)?;
            Ok(held)
        }))
    }

    fn remove<'a>(&'a mut self, instance_id: &'a str) -> BoxFuture<'a, Result<(), PoolHostError>> {
        let id = instance_id.to_owned();
        Box::pin(self.0.fw_host(move |fw| fw.remove_instance(&id)))
    }
}

impl PoolNode {
    /// Starts pool mode: reads this host's addresses and the gateways of its instances' ranges,
    /// loads the three tables through `exec` (the root helper in production) with the tap
    /// entries of every instance the store places here (so taps an earlier agent left keep
    /// their rules and the backstop) and starts the drift audit every `audit_period`. No tap is
    /// touched before the tables exist; the first [`Self::converge`] realises the instances.
    ///
    /// # Errors
    /// `INVALID_INPUT` for a bridge starting with `bc`; `UNAVAILABLE` when the store, the
    /// addresses or the first load fail.
    pub async fn start<E: NftExec + 'static>(
        cfg: PoolConfig,
        exec: E,
        taps: Arc<dyn PoolTaps>,
        db: &Db,
        audit_period: Duration,
    ) -> Result<Arc<Self>, Error> {
        if cfg
            .bridge
            .as_str()
            .starts_with(vmnet_model::nic::TAP_PREFIX)
        {
            return Err(Error::invalid(format!(
                "--bridge {:?} starts with \"{}\" and would match every tap rule",
                cfg.bridge.as_str(),
                vmnet_model::nic::TAP_PREFIX
            )));
        }
        vmnet_model::ids::validate_id("--host-id", &cfg.host_id)?;
        let (want, gateways, _) = desired(db, &cfg.host_id, &cfg.bridge).await?;
        let own = taps.host_addresses().await?;
        let host = HostAddrs { own, gateways };
        taps.set_host(&host).await?;
        let first = Firewall {
            taps: first_taps(&want),
            host,
        };
        let runtime =
            tokio::task::spawn_blocking(move || PoolRuntime::start_with(exec, first, audit_period))
                .await
                .map_err(|e| Error::internal(format!("pool start: {e}")))??;
        Ok(Arc::new(Self {
            cfg,
            runtime,
            taps,
            realised: Mutex::new(BTreeMap::new()),
            record: StdMutex::new(Record::default()),
            started_at_unix_ms: crate::status::now_ms(),
        }))
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &PoolConfig {
        &self.cfg
    }

    /// When pool mode started, ms since the Unix epoch.
    #[must_use]
    pub fn started_at_unix_ms(&self) -> i64 {
        self.started_at_unix_ms
    }

    /// The tap guard's counters; `None` when it is off.
    #[must_use]
    pub fn guard_status(&self) -> Option<crate::status::GuardStatus> {
        self.taps.guard_status()
    }

    /// The runtime (firewall and audit).
    #[must_use]
    pub fn runtime(&self) -> &PoolRuntime {
        &self.runtime
    }

    /// Runs `f` on the firewall on a blocking thread.
    async fn fw_host<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut AgentFirewall) -> Result<T, FirewallError> + Send + 'static,
    ) -> Result<T, PoolHostError> {
        let fw = self.runtime.firewall();
        tokio::task::spawn_blocking(move || {
            let mut g = fw.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            f(&mut g).map_err(PoolHostError::Firewall)
        })
        .await
        .map_err(PoolHostError::FirewallTask)?
    }

    /// [`Self::fw_host`] with its failure as the documented error.
    async fn fw<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut AgentFirewall) -> Result<T, FirewallError> + Send + 'static,
    ) -> Result<T, Error> {
        self.fw_host(f).await.map_err(|e| from_pool(&e))
    }

    /// The rule side of [`vmnet_kernel::pool::host`]'s steps: this node's firewall.
    fn rules(&self) -> NodeRules<'_> {
        NodeRules(self)
    }

    /// Starts an instance: [`host::start_instance`] (its elements, then its taps; a failure
    /// undoes only what it made).
    async fn start_instance(&self, spec: &InstanceSpec) -> Result<(), Error> {
        host::start_instance(&mut self.rules(), &*self.taps, spec)
            .await
            .map(drop)
            .map_err(|e| from_pool(&e))
    }

    /// A realised instance's new spec under the same taps ([`same_taps`]):
    /// [`host::update_instance`]. On a failure the caller keeps the old spec, so the next pass
    /// tries again.
    async fn update_instance(&self, spec: &InstanceSpec) -> Result<(), Error> {
        host::update_instance(&mut self.rules(), &*self.taps, spec)
            .await
            .map_err(|e| from_pool(&e))
    }

    /// Stops an instance: [`host::stop_instance`] (its taps, then its elements).
    async fn stop_instance(&self, spec: &InstanceSpec) -> Result<(), Error> {
        host::stop_instance(&mut self.rules(), &*self.taps, spec)
            .await
            .map_err(|e| from_pool(&e))
    }

    /// Converges this host to the store (see the module docs) and records the pass.
    ///
    /// # Errors
    /// `UNAVAILABLE` when the store cannot be read (nothing was changed then). Per-instance
    /// failures are in the outcome.
    pub async fn converge(&self, db: &Db) -> Result<PoolPassOutcome, Error> {
        let result = self.pass(db).await;
        let mut r = self
            .record
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        r.passes += 1;
        r.last_pass_at_unix_ms = Some(now_ms());
        r.last_errors = match &result {
            Ok(o) => o.errors.clone(),
            Err(e) => vec![e.message.clone()],
        };
        result
    }

    async fn pass(&self, db: &Db) -> Result<PoolPassOutcome, Error> {
        let mut realised = self.realised.lock().await;
        let (want, gateways, failed) = desired(db, &self.cfg.host_id, &self.cfg.bridge).await?;
        let mut out = PoolPassOutcome::default();
        let unplanned: BTreeSet<String> = failed.iter().map(|(id, _)| id.clone()).collect();
        out.errors
            .extend(failed.into_iter().map(|(_, e)| e.message));

        // The host's addresses and gateways: a change is a full replace.
        match self.taps.host_addresses().await {
            Ok(own) => {
                let host = HostAddrs { own, gateways };
                let fw = self.runtime.firewall();
                let current = fw
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .desired()
                    .host
                    .clone();
                if current != host {
                    let h = host.clone();
                    let replaced = self
                        .fw(move |fw| {
                            let taps = fw.desired().taps.clone();
                            fw.replace(Firewall { taps, host: h })
                        })
                        .await;
                    let guarded = match replaced {
                        Ok(()) => self.taps.set_host(&host).await,
                        Err(e) => Err(e),
                    };
                    if let Err(e) = guarded {
                        out.errors.push(format!("host addresses: {}", e.message));
                    }
                }
            }
            Err(e) => out.errors.push(e.message),
        }

        // Stop what is gone or changed beyond its taps, update in place what changed under the
        // same taps (an instance that no longer plans is left as it is).
        let mut stale: Vec<InstanceSpec> = Vec::new();
        let mut changed: Vec<InstanceSpec> = Vec::new();
        for s in realised.values().filter(|s| !unplanned.contains(&s.id)) {
            match want.get(&s.id) {
                Some(w) if w == s => {}
                Some(w) if same_taps(s, w) => changed.push(w.clone()),
                _ => stale.push(s.clone()),
            }
        }
        for spec in stale {
            let placed = want.contains_key(&spec.id);
            match self.stop_instance(&spec).await {
                Ok(()) => {
                    tracing::info!(instance = %spec.id, taps = ?spec.tap_names().unwrap_or_default(),
                        reason = if placed { "its taps changed (NIC count or bridge)" }
                            else { "no longer running on this host" },
                        "pool: stopped an instance: taps and elements removed");
                    realised.remove(&spec.id);
                    out.stopped.push(spec.id.clone());
                }
                Err(e) => out.errors.push(e.message),
            }
        }
        for spec in changed {
            match self.update_instance(&spec).await {
                Ok(()) => {
                    out.updated.push(spec.id.clone());
                    realised.insert(spec.id.clone(), spec);
                }
                Err(e) => out.errors.push(e.message),
            }
        }
        // Start what is new.
        for (id, spec) in &want {
            if realised.contains_key(id) {
                continue;
            }
            match self.start_instance(spec).await {
                Ok(()) => {
                    realised.insert(id.clone(), spec.clone());
                    out.started.push(id.clone());
                }
                Err(e) => out.errors.push(e.message),
            }
        }
        // Every instance placed or realised here owns its taps and their elements, whether it
        // started or not: a start that failed leaves a tap that existed before (a VM running
        // under an earlier agent) in place, and it is never collected here.
        let owners: BTreeSet<String> = want
            .keys()
            .chain(&unplanned)
            .chain(realised.keys())
            .map(|id| tap_prefix(id))
            .collect();
        let owned = |tap: &str| {
            tap.get(..TAP_PREFIX_LEN)
                .is_some_and(|p| owners.contains(p))
        };
        // Taps: make missing ones again, delete orphans.
        match self.taps.list().await {
            Ok(present) => {
                let present: BTreeSet<String> = present.into_iter().collect();
                for spec in realised.values() {
                    let entries = tap_entries(spec).unwrap_or_default();
                    for (nic, entry) in spec.nics.iter().zip(&entries) {
                        let tap = &entry.tap;
                        let Some(bridge) = &nic.network else { continue };
                        if !present.contains(tap.as_str()) {
                            match self.taps.ensure(entry, bridge).await {
                                Ok(_) => {
                                    tracing::warn!(instance = %spec.id, tap = %tap,
                                        "pool: made a missing tap again");
                                    out.taps_repaired.push(tap.to_string());
                                }
                                Err(e) => out.errors.push(from_pool(&e).message),
                            }
                        }
                    }
                }
                for name in present.iter().filter(|n| is_instance_tap(n) && !owned(n)) {
                    let Ok(tap) = name.parse::<IfName>() else {
                        continue;
                    };
                    match self.taps.delete(&tap).await {
                        Ok(_) => {
                            tracing::warn!(tap = %name,
                                reason = "no instance placed on or realised by this host owns it",
                                "pool: deleted a stray tap");
                            out.orphans_deleted.push(name.clone());
                        }
                        Err(e) => out.errors.push(from_pool(&e).message),
                    }
                }
            }
            Err(e) => out.errors.push(e.message),
        }
        // Elements of taps no instance here owns (loaded at start for an instance that is gone,
        // or left by a start whose clean-up failed), after their taps.
        let keep: BTreeSet<String> = owners.clone();
        match self
            .fw(move |fw| {
                fw.retain_taps(|t| {
                    t.as_str()
                        .get(..TAP_PREFIX_LEN)
                        .is_some_and(|p| keep.contains(p))
                })
            })
            .await
        {
            Ok(gone) => {
                for tap in gone {
                    tracing::info!(tap = %tap,
                        reason = "no instance placed on or realised by this host owns it",
                        "pool: removed the elements of a tap");
                }
            }
            Err(e) => out
                .errors
                .push(format!("stale tap elements: {}", e.message)),
        }
        // Seeds.
        let keep: BTreeSet<String> = realised.keys().cloned().collect();
        for spec in realised.values() {
            if let Err(e) = seeds::write(&self.cfg.seed_dir, spec, self.cfg.seed_images) {
                out.errors.push(e.message);
            }
        }
        match seeds::prune(&self.cfg.seed_dir, &keep) {
            Ok(gone) => {
                for id in gone {
                    tracing::info!(instance = %id, dir = %self.cfg.seed_dir.join(&id).display(),
                        reason = "the instance is not realised on this host",
                        "pool: removed a seed");
                }
            }
            Err(e) => out.errors.push(e.message),
        }
        Ok(out)
    }

    /// Whether `instance_id` is realised on this host now.
    pub async fn is_realised(&self, instance_id: &str) -> bool {
        self.realised.lock().await.contains_key(instance_id)
    }

    /// The tap guard's drops by reason since the agent started; `None` without the guard or
    /// when the counters cannot be read.
    #[must_use]
    pub fn guard_drops(&self) -> Option<BTreeMap<String, u64>> {
        self.taps
            .guard_status()
            .filter(|g| g.error.is_none())
            .map(|g| g.drops)
    }

    /// The pool part of `GET /v1/status`: the tables as the kernel lists them now, the audit's
    /// counters and the last pass.
    pub async fn status(&self) -> PoolStatus {
        let listed = self.fw(|fw| fw.observe()).await;
        let (census, listing_error) = match listed {
            Ok(c) => (c, None),
            Err(e) => (Tables::default(), Some(e.message)),
        };
        let fw = self.runtime.status();
        let audit = self.runtime.audit_record();
        let instances = self.realised.lock().await.len() as u64;
        let r = self
            .record
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let to_u64 = |m: BTreeMap<String, usize>| -> BTreeMap<String, u64> {
            m.into_iter().map(|(k, v)| (k, v as u64)).collect()
        };
        PoolStatus {
            host_id: self.cfg.host_id.clone(),
            bridge: self.cfg.bridge.to_string(),
            seed_dir: self.cfg.seed_dir.display().to_string(),
            tables: census.tables.keys().cloned().collect(),
            rules: to_u64(census.rule_counts()),
            elements: to_u64(census.element_counts()),
            listing_error,
            instances,
            taps: fw.taps as u64,
            drift_repairs: fw.drift_repairs,
            last_drift: fw.last_drift,
            audits: audit.audits,
            last_audit_at_unix_ms: audit.last_audit_at_unix_ms,
            last_audit_error: audit.last_error,
            passes: r.passes,
            last_pass_at_unix_ms: r.last_pass_at_unix_ms,
            last_errors: r.last_errors.clone(),
            guard: self.taps.guard_status(),
        }
    }
}
