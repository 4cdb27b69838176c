//! The agent's state and the VM operations behind the API: desired configs in the store, applied
//! through the namespace driver, one change at a time.
//!
//! # Design
//! - The store (`vm_configs`, [`vmnet_ipam::vm_store`]) holds, per VM, the desired config, the
//!   last config applied successfully and the last error. The kernel holds the realised state.
//! - Every kernel change (a PUT, a DELETE, one VM of a reconcile pass) runs under one async
//!   mutex, so driver calls never overlap and a PUT's answer reflects its own apply; reconcile
//!   passes are serialized by a second mutex (see [`crate::reconcile`]). A PUT or DELETE waits
//!   for the lock and its apply at most the kernel deadline ([`kernel`]).
//! - A PUT is transactional from the caller's view and costs one durable store write: it checks
//!   (reading) that no other VM holds the user id or mesh address, then applies the config and,
//!   at the same time, stores it as desired *and* applied in one statement ([`vm_store::save`]);
//!   it answers once both are done. An unchanged re-PUT writes nothing. When the apply fails,
//!   the driver rolls back the VM's partial apply, the agent re-applies the last good config (if
//!   any) or removes the VM, puts the row back as it was with the error in `last_error` (a new
//!   VM is deleted from the store again) and answers the error. When the write itself fails,
//!   the kernel is taken back the same way. A reader (`GET`) may see the new config as applied
//!   a few milliseconds before the PUT is answered.
//! - A DELETE removes the kernel objects first and the row only when that succeeded, so a failed
//!   delete can be retried and never leaves an unrecorded VM behind. The driver answers once the
//!   VM's namespace is gone; the kernel may finish destroying its devices afterwards
//!   ([`vmnet_kernel::ns::NsDriver::remove_deferred`]).
//! - A PUT or DELETE does not wake a reconcile pass: it made its change itself, and a pass per
//!   burst of changes costs an observe of the whole host and a read of every VM, which at
//!   1000 VMs slowed the changes themselves. Failed VMs are retried, and leftovers collected,
//!   by the periodic full pass, which yields to a burst of API changes (see
//!   [`crate::reconcile`]).
//!
//! # Crashes
//! The agent may die at any instant; on restart the full pass converges the kernel to the store
//! (every stored VM applied with its desired config, the objects of every other user id
//! collected):
//! - killed during a PUT, before its write committed: the store still holds what it held
//!   before — a new VM is not stored and its partial objects are collected; a changed VM is
//!   re-applied with its previous config (objects of a new user id it was moving to are
//!   collected). The caller got no answer and retries;
//! - killed during a PUT after its write committed: the new config is stored, so it is applied
//!   on restart;
//! - killed after a failed apply, before the row was put back: the new config is stored as
//!   applied; the pass fails on it again and records the error (state `failed`), and the
//!   previous config is not re-applied (the store no longer names it): PUT it again.
//! - killed during a DELETE after the kernel objects were removed: the VM is still stored and is
//!   re-created on restart; delete it again.
//!
//! # Limitations
//! One agent per store and host: two agents sharing a database would fight over the same VMs.
//! Objects made under another `--name-prefix` are neither observed nor collected.

use std::sync::{Arc, Mutex as StdMutex, OnceLock};
use std::time::Duration;

use tokio::sync::{Mutex, Notify};
use vmnet_ipam::Db;
use vmnet_ipam::vm_store::{self, VmRow};
use vmnet_kernel::ns::NsDriver;
use vmnet_model::Error;
use vmnet_model::vm::{VmConfig, parse_vm_config};
use vmnet_plan::ns::{NsSettings, VmPlan, plan_vm};

use crate::api::error::from_ns;
use crate::events::{Applied, EventBody, Trigger};
use crate::mesh::runtime::Mesh;
use crate::metadata::MetadataService;
use crate::pool::node::PoolNode;
use crate::provider::poller::Poller;
mod activity;
mod change;
mod failure;
mod fwaudit;
mod guard;
pub mod kernel;
mod meshvms;
mod meta;
mod publish;
mod subsystems;
mod view;

use view::vm_not_found;

pub use fwaudit::DEFAULT_FIREWALL_AUDIT_SECS;
pub use kernel::DEFAULT_KERNEL_DEADLINE_SECS;

use crate::status::{ReconcileStatus, VmView};

// The clock lives in `status`; re-exported for `vmnet-bench`, which calls it by this path.
pub use crate::status::now_ms;

/// Default seconds between periodic reconcile passes.
pub const DEFAULT_RECONCILE_INTERVAL_SECS: u64 = 10;

/// The agent: store, driver, settings, and the reconcile bookkeeping.
pub struct Agent {
    db: Db,
    driver: Arc<dyn NsDriver>,
    settings: NsSettings,
    interval: Duration,
    /// Serializes every kernel change (PUT, DELETE, each VM of a reconcile pass, GC) and
    /// bounds the API's.
    pub(crate) kernel: kernel::KernelGate,
    /// Serializes reconcile passes (one at a time).
    pub(crate) pass_lock: Mutex<()>,
    pub(crate) record: StdMutex<ReconcileStatus>,
    pub(crate) wake: Notify,
    /// The loops' heartbeats and the convergence since start ([`crate::health`]).
    pub(crate) loops: crate::health::Loops,
    /// What the metrics observe as the agent works ([`crate::metrics`]).
    pub(crate) metrics: crate::metrics::AgentMetrics,
    /// When the last VM change through the API (PUT or DELETE) started or ended: a reconcile
    /// pass yields to a burst of them (see [`crate::reconcile::API_QUIET`]).
    pub(crate) last_api_change: StdMutex<Option<tokio::time::Instant>>,
    /// Pool mode on this host, when the agent runs it (`vmnet serve --host-id`).
    pool: OnceLock<Arc<PoolNode>>,
    /// The mesh's WireGuard interface, when the agent runs it.
    mesh: OnceLock<Arc<Mesh>>,
    /// The firewall audit's period ([`Agent::set_firewall_audit_period`]).
    firewall_period: StdMutex<Duration>,
    /// The firewall audit's record.
    pub(crate) firewall: StdMutex<fwaudit::FirewallRecord>,
    /// The provider pools' poller, when the agent runs it (`--poll-providers`).
    providers: OnceLock<Arc<Poller>>,
    /// The metadata service, when the agent serves it (`vmnet serve`).
    metadata: OnceLock<Arc<MetadataService>>,
    /// The unprivileged worker (metadata listeners, provider polls), when it runs.
    worker: OnceLock<Arc<crate::worker::Worker>>,
    /// What the agent accepts of provider pools' credentials files and API URLs.
    provider_rules: StdMutex<vmnet_model::pool::ProviderRules>,
    /// The packet-activity program, when the agent runs it (`--activity-root`).
    activity: OnceLock<Arc<vmnet_kernel::activity::ActivityRecorder>>,
    /// Wake on packet ([`crate::wake`]), when on.
    wake_on_packet: OnceLock<Arc<crate::wake::Wake>>,
    /// When this agent started: the baseline of the activity reports.
    started: std::time::SystemTime,
    /// When this agent created each VM (by user id) it created: that VM's later baseline.
    activity_since: StdMutex<std::collections::HashMap<u32, std::time::SystemTime>>,
    /// The event bus (`GET /v1/events`).
    events: crate::events::Events,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("settings", &self.settings)
            .field("interval", &self.interval)
            .finish()
    }
}

/// Runs `$body` (using `$tx: &mut Tx`, failing with an [`IpamError`](vmnet_ipam::IpamError)) in
/// a store transaction; commits on `Ok`, and runs it again when it failed on a deadlock or
/// serialization conflict ([`vmnet_ipam::transaction!`]). A failure becomes the API's error at
/// the API edge ([`from_ipam`](crate::api::error::from_ipam)).
macro_rules! store_tx {
    ($db:expr, $tx:ident => $body:expr) => {
        vmnet_ipam::transaction!($db, $tx => $body).map_err($crate::metrics::store_error)
    };
}
pub(crate) use store_tx;

/// Marks a VM change through the API in progress: records the time when made and again when
/// dropped (the change answered), so a reconcile pass sees the API busy for its whole length.
struct ApiChange<'a>(&'a Agent);

impl<'a> ApiChange<'a> {
    fn new(agent: &'a Agent) -> Self {
        agent.mark_api_change();
        Self(agent)
    }
}

impl Drop for ApiChange<'_> {
    fn drop(&mut self) {
        self.0.mark_api_change();
    }
}

fn decode(row: &VmRow, json: &str, what: &str) -> Result<VmConfig, Error> {
    parse_vm_config(json.as_bytes()).map_err(|e| {
        Error::internal(format!(
            "vm {}: stored {what} config does not parse: {}",
            row.id,
            e.message()
        ))
    })
}

fn encode(cfg: &VmConfig) -> Result<String, Error> {
    serde_json::to_string(cfg)
        .map_err(|e| Error::internal(format!("vm {}: cannot encode config: {e}", cfg.id)))
}

impl Agent {
    /// An agent over `db` applying through `driver`, reconciling every `interval`.
    ///
    /// # Errors
    /// `INVALID_INPUT` when `settings` are invalid.
    pub fn new(
        db: Db,
        driver: Arc<dyn NsDriver>,
        settings: NsSettings,
        interval: Duration,
    ) -> Result<Arc<Self>, Error> {
        settings.validate()?;
        let kernel = kernel::KernelGate::new(driver.watcher());
        Ok(Arc::new(Self {
            db,
            driver,
            settings,
            interval,
            kernel,
            pass_lock: Mutex::new(()),
            record: StdMutex::new(ReconcileStatus::default()),
            wake: Notify::new(),
            loops: crate::health::Loops::default(),
            metrics: crate::metrics::AgentMetrics::default(),
            last_api_change: StdMutex::new(None),
            pool: OnceLock::new(),
            mesh: OnceLock::new(),
            firewall_period: StdMutex::new(Duration::from_secs(DEFAULT_FIREWALL_AUDIT_SECS)),
            firewall: StdMutex::new(fwaudit::FirewallRecord {
                status: crate::status::FirewallAuditStatus {
                    audit_period_secs: DEFAULT_FIREWALL_AUDIT_SECS,
                    ..Default::default()
                },
                per_vm: std::collections::BTreeMap::new(),
            }),
            providers: OnceLock::new(),
            metadata: OnceLock::new(),
            worker: OnceLock::new(),
            provider_rules: StdMutex::new(vmnet_model::pool::ProviderRules::default()),
            activity: OnceLock::new(),
            wake_on_packet: OnceLock::new(),
            started: std::time::SystemTime::now(),
            activity_since: StdMutex::default(),
            events: crate::events::Events::new(),
        }))
    }

    /// The store.
    #[must_use]
    pub fn db(&self) -> &Db {
        &self.db
    }

    /// The namespace-mode settings.
    #[must_use]
    pub fn settings(&self) -> &NsSettings {
        &self.settings
    }

    /// The driver.
    #[must_use]
    pub fn driver(&self) -> &Arc<dyn NsDriver> {
        &self.driver
    }

    /// Seconds between periodic reconcile passes.
    #[must_use]
    pub fn interval(&self) -> Duration {
        self.interval
    }

    fn mark_api_change(&self) {
        if let Ok(mut t) = self.last_api_change.lock() {
            *t = Some(tokio::time::Instant::now());
        }
    }

    pub(crate) fn plan(&self, cfg: &VmConfig) -> Result<VmPlan, Error> {
        Ok(plan_vm(cfg, &self.settings)?)
    }

    /// `GET /v1/vms/{id}`.
    ///
    /// # Errors
    /// `NOT_FOUND` for an unknown VM; `UNAVAILABLE` on a store failure.
    pub async fn get_vm(&self, id: &str) -> Result<VmView, Error> {
        let row = store_tx!(self.db, tx => vm_store::get(tx, id).await)?;
        let row = row.ok_or_else(|| vm_not_found(id))?;
        let mut view = self.view(&row)?;
        let Ok(plan) = self.plan(&view.config) else {
            return Ok(view);
        };
        self.fill_guard_drops(&mut view, &plan);
        // The counters of the limits in force, read from the kernel.
        if view.status.limits.iter().any(|l| l.applied) {
            // Read without the kernel lock, but never longer than the kernel deadline: a hung
            // kernel read leaves the counters out instead of stalling the answer.
            let read =
                tokio::time::timeout(self.kernel.deadline(), self.driver.limit_counters(&plan));
            let counters = read.await.unwrap_or_else(|_| {
                Err(vmnet_kernel::ns::NsError::Missing(format!(
                    "{}: no answer within the kernel deadline",
                    plan.netns
                )))
            });
            match counters {
                Ok(counters) => {
                    for c in counters {
                        if let Some(l) = view
                            .status
                            .limits
                            .iter_mut()
                            .find(|l| l.class == c.class && l.direction == c.direction)
                        {
                            l.bytes = Some(c.bytes);
                            l.packets = Some(c.packets);
                            l.drops = Some(c.drops);
                        }
                    }
                }
                Err(e) => tracing::warn!(vm = %id, error = %e, "reading the limit counters failed"),
            }
        }
        Ok(view)
    }

    /// `GET /v1/vms`, ordered by id.
    ///
    /// # Errors
    /// `UNAVAILABLE` on a store failure.
    pub async fn list_vms(&self) -> Result<Vec<VmView>, Error> {
        let rows = store_tx!(self.db, tx => vm_store::list(tx).await)?;
        rows.iter().map(|r| self.view(r)).collect()
    }

    /// `PUT /v1/vms/{id}`: validate `body`, check that its user id and mesh address are free,
    /// apply it, store it with its outcome in one write, and answer the VM with its status after
    /// the apply. See the module docs for what a failed apply leaves.
    ///
    /// # Errors
    /// `INVALID_INPUT` naming the field (also when the body's id differs from `path_id`);
    /// `CONFLICT` when another VM holds the user id or the mesh address; `UNAVAILABLE` when the
    /// store fails, the apply failed (the previous good config stays applied), or the kernel
    /// lock or the apply took longer than the kernel deadline ([`kernel`]).
    pub async fn put_vm(self: &Arc<Self>, path_id: &str, body: &[u8]) -> Result<VmView, Error> {
        let cfg = parse_vm_config(body).map_err(|e| e.naming_vm(path_id))?;
        if cfg.id != path_id {
            return Err(Error::invalid(format!(
                "vm {}: id {:?} in the body does not match {path_id:?} in the path",
                cfg.id, cfg.id
            )));
        }
        let plan = self.plan(&cfg)?;
        let json = encode(&cfg)?;
        let later = format!("GET /v1/vms/{}", cfg.id);
        // The VM's netns is quiet before the apply may make it; its earlier user ids' are
        // added once its row is read.
        let spaces = self.vm_spaces([cfg.user_id]);
        self.bounded(
            format!("PUT vm {}", cfg.id),
            &later,
            spaces,
            move |me| async move { me.put_locked(cfg, plan, json).await },
        )
        .await
    }

    /// The rest of [`Self::put_vm`], under the kernel lock.
    async fn put_locked(&self, cfg: VmConfig, plan: VmPlan, json: String) -> Result<VmView, Error> {
        let clock = std::time::Instant::now();
        crate::public::check_host(self.driver.as_ref(), &cfg).await?;
        self.mesh_claim_free(&cfg).await?;
        let mesh = cfg.mesh_ipv6.map(|m| m.to_string());
        // Reads only. The conflict checks come before the apply: applying a user id another VM
        // holds would take over that VM's kernel objects.
        let own_mesh = self.mesh.get().and_then(|m| m.mesh_address());
        let before = store_tx!(self.db, tx => async {
            crate::public::check(tx, &cfg).await?;
            crate::mesh::conflicts::vm_mesh(tx, &cfg, own_mesh).await?;
            vm_store::get_if_free(tx, &cfg.id, cfg.user_id, mesh.as_deref()).await
        }.await)?;
        let prev_good = match &before {
            Some(b) => b
                .applied
                .as_deref()
                .map(|a| decode(b, a, "applied"))
                .transpose()?,
            None => None,
        };
        // A changed user id removes the old one's netns, and a failed apply re-applies it.
        if let Some(b) = &before {
            let old = prev_good.as_ref().map(|p| p.user_id);
            self.kernel
                .quiet_also(self.vm_spaces(std::iter::once(b.user_id).chain(old)));
        }
        // A config that differs from the applied one in one kind of field only changes just
        // that ([`change::Kind`]); anything else, or a VM whose last apply failed, is a full apply.
        let in_sync = before.as_ref().is_some_and(|b| b.last_error.is_none());
        let kind = prev_good
            .as_ref()
            .filter(|_| in_sync)
            .map_or(change::Kind::Full, |o| change::Kind::of(o, &cfg));
        let row = VmRow {
            id: cfg.id.clone(),
            user_id: cfg.user_id,
            mesh,
            config: json.clone(),
            applied: Some(json),
            last_error: None,
            updated_at: now_ms(),
        };
        // The one write of the change (none when the row already says exactly this), made while
        // the kernel applies it: the answer waits for both, and a failed apply puts the row back.
        let unchanged = before.as_ref().is_some_and(|b| {
            *b == VmRow {
                updated_at: b.updated_at,
                ..row.clone()
            }
        });
        let write = async {
            if unchanged {
                return Ok(false);
            }
            store_tx!(self.db, tx => vm_store::save(tx, &row).await).map(|()| true)
        };
        let apply = async {
            match kind {
                change::Kind::Limits => self.driver.apply_limits(&plan).await,
                change::Kind::Firewall => self.driver.apply_table(&plan).await,
                change::Kind::Public => self.driver.apply_public(&plan).await,
                change::Kind::Full => self.driver.apply(&plan).await,
            }
        };
        let (applied, written) = tokio::join!(apply, write);
        match (applied, written) {
            (Ok(_), Ok(_)) => {}
            (Err(e), written) => {
                let written = written.unwrap_or(false);
                return Err(self
                    .put_failed(&cfg, before, prev_good.as_ref(), from_ns(&e), written)
                    .await);
            }
            (Ok(_), Err(e)) => {
                // The store keeps the previous state: take the kernel back to it.
                let restored = self.restore_after_failure(&cfg, prev_good.as_ref()).await;
                let e = Error::new(e.code, format!("{}{restored}", e.message));
                self.emit_failed(&cfg, &e);
                return Err(e);
            }
        }
        let served = self.sync_metadata(&plan);
        if !unchanged {
            let change = match before.as_ref().and_then(|b| b.applied.as_ref()) {
                None => Applied::Created,
                Some(_) => Applied::Changed,
            };
            let trigger = Trigger::Api;
            self.emit_vm(
                &cfg.id,
                cfg.user_id,
                EventBody::VmApplied { change, trigger },
            );
        }
        if before.as_ref().is_none_or(|b| b.user_id != cfg.user_id) {
            self.activity_starts(cfg.user_id, before.as_ref().map(|b| b.user_id));
        }
        self.mesh_vm_up(&cfg, &plan, prev_good.as_ref()).await;
        self.metadata_served(&cfg.id, served).await;
        // A changed user id leaves the old names behind: remove them now, but not the public
        // map entries the VM holds under its new user id.
        if let Some(old) = prev_good.as_ref().filter(|o| o.user_id != cfg.user_id) {
            if let Err(e) = self.driver.release_public(old.user_id) {
                tracing::warn!(vm = %cfg.id, "releasing the public entries of the old user id failed: {e}");
            }
            if let Err(e) = self.driver.remove_deferred(old.user_id).await {
                tracing::warn!(vm = %cfg.id, "removing the objects of the old user id failed: {e}");
            }
        }
        if unchanged {
            tracing::debug!(vm = %cfg.id, op = "change", apply = kind.as_str(), "vm applied (unchanged)");
        } else {
            let op = if before.is_some() { "change" } else { "create" };
            tracing::info!(vm = %cfg.id, op, apply = kind.as_str(), "vm applied");
        }
        let metric_kind = if before.is_some() {
            crate::metrics::ApplyKind::Change
        } else {
            crate::metrics::ApplyKind::Create
        };
        let row = match before {
            Some(b) if unchanged => b,
            _ => row,
        };
        self.metrics.observe_apply(metric_kind, clock.elapsed());
        self.view_planned(&row, cfg, &plan)
    }

    /// `DELETE /v1/vms/{id}`: remove everything the VM had, then forget it. Answers the VM as it
    /// was.
    ///
    /// # Errors
    /// `NOT_FOUND` for an unknown VM; `UNAVAILABLE` when the removal failed (the VM stays in the
    /// store, so the delete can be retried) or took longer than the kernel deadline.
    pub async fn delete_vm(self: &Arc<Self>, id: &str) -> Result<VmView, Error> {
        let owned = id.to_owned();
        let later = format!("GET /v1/vms/{id}");
        // Only the host until the row names the VM's user ids.
        let spaces = self.vm_spaces([]);
        self.bounded(
            format!("DELETE vm {id}"),
            &later,
            spaces,
            move |me| async move { me.delete_locked(&owned).await },
        )
        .await
    }

    /// The rest of [`Self::delete_vm`], under the kernel lock.
    async fn delete_locked(&self, id: &str) -> Result<VmView, Error> {
        let clock = std::time::Instant::now();
        let row = store_tx!(self.db, tx => vm_store::get(tx, id).await)?;
        let row = row.ok_or_else(|| vm_not_found(id))?;
        let view = self.view(&row)?;
        let mut uids = vec![view.config.user_id];
        if let Some(a) = row.applied.as_deref() {
            let applied = decode(&row, a, "applied")?;
            if applied.user_id != view.config.user_id {
                uids.push(applied.user_id);
            }
        }
        self.kernel.quiet_also(self.vm_spaces(uids.iter().copied()));
        self.mesh_vm_down(&view.config).await;
        if let Some(a) = row.applied.as_deref()
            && let Ok(applied) = decode(&row, a, "applied")
            && applied.mesh_ipv6 != view.config.mesh_ipv6
        {
            self.mesh_vm_down(&applied).await;
        }
        for uid in uids {
            // The kernel may finish destroying the devices after the answer; an immediate
            // re-create works, and collection deletes whatever it leaves (see the driver).
            if let Err(e) = self.driver.remove_deferred(uid).await {
                let err = from_ns(&e);
                return Err(Error::new(
                    err.code,
                    format!(
                        "vm {id}: removal failed (the VM is kept; retry the delete): {}",
                        err.message
                    ),
                ));
            }
        }
        if let Some(m) = self.metadata.get() {
            m.remove(id);
        }
        store_tx!(self.db, tx => vm_store::delete(tx, id).await)?;
        self.activity_ends(view.config.user_id);
        self.metrics
            .observe_apply(crate::metrics::ApplyKind::Delete, clock.elapsed());
        tracing::info!(vm = %id, op = "delete", "vm deleted");
        self.emit_vm(id, view.config.user_id, EventBody::VmDeleted {});
        Ok(view)
    }
}
