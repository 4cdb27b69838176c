//! The agent's state and the VM operations behind the API: desired configs in the store, applied
//! through the namespace driver, one change at a time.
//!
//! # Design
//! - The store (`vm_configs`, [`vmnet_ipam::vm_store`]) holds, per VM, the desired config, the
//!   last config applied successfully and the last error. The kernel holds the realised state.
//! - Every kernel change (a PUT, a DELETE, one VM of a reconcile pass) runs under one async
//!   mutex, so driver calls never overlap and a PUT's answer reflects its own apply; reconcile
//!   passes are serialized by a second mutex (see [`crate::reconcile`]).
//! - A PUT is transactional from the caller's view: the new config is stored *before* it is
//!   applied (so an agent killed mid-apply converges to it on restart), then applied. When the
//!   apply fails, the driver rolls back the VM's partial apply, the agent re-applies the last
//!   good config (if any), puts the store row back as it was with the error in `last_error`,
//!   and answers the error. A VM that had no good config is removed again.
//! - A DELETE removes the kernel objects first and the row only when that succeeded, so a failed
//!   delete can be retried and never leaves an unrecorded VM behind.
//!
//! # Crashes
//! The agent may die at any instant; on restart the full pass converges the kernel to the store:
//! - killed during a PUT's apply: the new config is stored, so it is applied on restart;
//! - killed after a failed apply, before the row was put back: the new config stays desired, the
//!   pass fails on it again, re-applies the last good config and records the error (state
//!   `failed`), so the VM keeps working and the caller sees why;
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

use crate::pool::node::PoolNode;
use crate::status::{AgentStatus, ReconcileStatus, VmCounts, VmState, VmStatus, VmView};

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
    /// Serializes every kernel change (PUT, DELETE, each VM of a reconcile pass, GC).
    pub(crate) kernel_lock: Mutex<()>,
    /// Serializes reconcile passes (one at a time).
    pub(crate) pass_lock: Mutex<()>,
    pub(crate) record: StdMutex<ReconcileStatus>,
    pub(crate) wake: Notify,
    /// Pool mode on this host, when the agent runs it (`vmnet serve --host-id`).
    pool: OnceLock<Arc<PoolNode>>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("settings", &self.settings)
            .field("interval", &self.interval)
            .finish()
    }
}

/// Runs `$body` (using `$tx: &mut Tx`) in a store transaction; commits on `Ok`, and runs it
/// again when it failed on a deadlock or serialization conflict ([`vmnet_ipam::transaction!`]).
macro_rules! store_tx {
    ($db:expr, $tx:ident => $body:expr) => {
        vmnet_ipam::transaction!($db, $tx => $body)
    };
}
pub(crate) use store_tx;

fn decode(row: &VmRow, json: &str, what: &str) -> Result<VmConfig, Error> {
    parse_vm_config(json.as_bytes()).map_err(|e| {
        Error::internal(format!(
            "vm {}: stored {what} config does not parse: {}",
            row.id, e.message
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
        Ok(Arc::new(Self {
            db,
            driver,
            settings,
            interval,
            kernel_lock: Mutex::new(()),
            pass_lock: Mutex::new(()),
            record: StdMutex::new(ReconcileStatus::default()),
            wake: Notify::new(),
            pool: OnceLock::new(),
        }))
    }

    /// Turns pool mode on: from now on every reconcile pass, and every instance change made
    /// through the API, converges `pool` to the store. Set once, before serving.
    ///
    /// # Errors
    /// `CONFLICT` when pool mode is already set.
    pub fn set_pool(&self, pool: Arc<PoolNode>) -> Result<(), Error> {
        self.pool
            .set(pool)
            .map_err(|_| Error::conflict("pool mode is already set on this agent"))
    }

    /// Pool mode, when it is on.
    #[must_use]
    pub fn pool(&self) -> Option<&Arc<PoolNode>> {
        self.pool.get()
    }

    /// Converges pool mode now (no-op without it) after an instance change made through the API;
    /// failures are logged and recorded in the status, not returned: the store change stands and
    /// the next pass retries.
    pub async fn converge_pool(&self) {
        if let Some(p) = self.pool.get() {
            match p.converge(&self.db).await {
                Ok(o) if o.errors.is_empty() => {}
                Ok(o) => tracing::warn!(errors = ?o.errors, "pool pass had errors"),
                Err(e) => tracing::warn!("pool pass failed: {e}"),
            }
        }
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

    pub(crate) fn plan(&self, cfg: &VmConfig) -> Result<VmPlan, Error> {
        plan_vm(cfg, &self.settings)
    }

    /// The API view of a stored row. A config that no longer plans under the current settings
    /// is shown `failed` with the reason in `last_error`.
    ///
    /// # Errors
    /// `INTERNAL` when the stored config no longer parses.
    pub fn view(&self, row: &VmRow) -> Result<VmView, Error> {
        let config = decode(row, &row.config, "desired")?;
        let applied = row
            .applied
            .as_deref()
            .map(|a| decode(row, a, "applied"))
            .transpose()?;
        // A stored VM may no longer plan (the agent restarted with a smaller transit range):
        // show it with its derived names and the reason instead of failing the whole listing.
        let (p, plan_error) = match self.plan(&config) {
            Ok(plan) => (plan.status(), None),
            Err(e) => (self.unplanned_status(&config), Some(e.message)),
        };
        let state = if row.last_error.is_some() || plan_error.is_some() {
            VmState::Failed
        } else if applied.as_ref() == Some(&config) {
            VmState::Applied
        } else {
            VmState::Pending
        };
        let status = VmStatus {
            state,
            netns: p.netns,
            veth_host: p.host_veth,
            veth_ns: p.peer_veth,
            transit: p.transit.map(|t| t.to_string()),
            mtu: p.mtu,
            tap: p.tap,
            tap_owner: self.settings.tap_owner_uid,
            guest_ipv4: p.guest_ipv4.addr().to_string(),
            gateway_ipv4: p.gateway_ipv4.to_string(),
            guest_mac: p.guest_mac,
            mesh_ipv6: p.mesh_ipv6.map(|m| m.to_string()),
            applied_public_ipv4: applied
                .as_ref()
                .and_then(|a| a.public_ipv4)
                .map(|a| a.to_string()),
            applied_public_ipv6: applied.as_ref().and_then(|a| {
                a.public_ipv6_mapped()
                    .map(|m| m.to_string())
                    .or_else(|| a.public_ipv6_block().map(|b| b.to_string()))
            }),
            public_neighbors: self.settings.public_neighbors,
            applied_routes: applied.map(|a| a.network.routes).unwrap_or_default(),
            last_error: row.last_error.clone().or(plan_error),
            updated_at_unix_ms: row.updated_at,
        };
        Ok(VmView { config, status })
    }

    /// The status fields that derive from names alone, for a config that does not plan.
    fn unplanned_status(&self, cfg: &VmConfig) -> vmnet_plan::ns::VmStatus {
        use vmnet_plan::ns::{
            GATEWAY_IPV4, GUEST_IPV4, GUEST_MAC, HOST_LINK_LOCAL, NameKind, TAP_PREFIX_LEN, name,
        };
        let p = &self.settings.name_prefix;
        let with_veth = cfg.mesh_ipv6.is_some();
        vmnet_plan::ns::VmStatus {
            netns: name(p, NameKind::Netns, cfg.user_id),
            host_veth: with_veth.then(|| name(p, NameKind::HostVeth, cfg.user_id)),
            peer_veth: with_veth.then(|| name(p, NameKind::PeerVeth, cfg.user_id)),
            transit: None,
            tap: name(p, NameKind::Tap, cfg.user_id),
            guest_ipv4: ipnet::Ipv4Net::new(GUEST_IPV4, TAP_PREFIX_LEN).unwrap_or_default(),
            gateway_ipv4: GATEWAY_IPV4,
            guest_mac: GUEST_MAC
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(":"),
            gateway_ipv6: HOST_LINK_LOCAL,
            mesh_ipv6: cfg.mesh_ipv6,
            mtu: self.settings.mtu,
            nat: false,
            routes: cfg.network.routes.clone(),
            public_ipv4: None,
            public_ipv6: None,
        }
    }

    /// `GET /v1/vms/{id}`.
    ///
    /// # Errors
    /// `NOT_FOUND` for an unknown VM; `UNAVAILABLE` on a store failure.
    pub async fn get_vm(&self, id: &str) -> Result<VmView, Error> {
        let row = store_tx!(self.db, tx => vm_store::get(tx, id).await)?;
        let row = row.ok_or_else(|| Error::not_found(format!("vm {id} not found")))?;
        self.view(&row)
    }

    /// `GET /v1/vms`, ordered by id.
    ///
    /// # Errors
    /// `UNAVAILABLE` on a store failure.
    pub async fn list_vms(&self) -> Result<Vec<VmView>, Error> {
        let rows = store_tx!(self.db, tx => vm_store::list(tx).await)?;
        rows.iter().map(|r| self.view(r)).collect()
    }

    /// `PUT /v1/vms/{id}`: validate `body`, store it, apply it, and answer the VM with its status
    /// after the apply. See the module docs for what a failed apply leaves.
    ///
    /// # Errors
    /// `INVALID_INPUT` naming the field (also when the body's id differs from `path_id`);
    /// `CONFLICT` when another VM holds the user id or the mesh address; `UNAVAILABLE` when the store fails or the
    /// apply failed (the previous good config stays applied).
    pub async fn put_vm(&self, path_id: &str, body: &[u8]) -> Result<VmView, Error> {
        let cfg = parse_vm_config(body)?;
        if cfg.id != path_id {
            return Err(Error::invalid(format!(
                "vm {}: id {:?} in the body does not match {path_id:?} in the path",
                cfg.id, cfg.id
            )));
        }
        let plan = self.plan(&cfg)?;
        let json = encode(&cfg)?;
        let _guard = self.kernel_lock.lock().await;
        let mesh = cfg.mesh_ipv6.map(|m| m.to_string());
        let before = store_tx!(self.db, tx => async {
            crate::public::check(tx, &cfg).await?;
            vm_store::put(tx, &cfg.id, cfg.user_id, mesh.as_deref(), &json, now_ms()).await
        }.await)?;
        let prev_good = match &before {
            Some(b) => b
                .applied
                .as_deref()
                .map(|a| decode(b, a, "applied"))
                .transpose()?,
            None => None,
        };
        match self.driver.apply(&plan).await {
            Ok(_) => {
                // A changed user id leaves the old names behind: remove them now.
                if let Some(old) = prev_good.as_ref().filter(|o| o.user_id != cfg.user_id)
                    && let Err(e) = self.driver.remove(old.user_id).await
                {
                    tracing::warn!(vm = %cfg.id, "removing the objects of the old user id failed: {e}");
                }
                let row = store_tx!(self.db, tx => async {
                    vm_store::set_result(tx, &cfg.id, Some(&json), None, now_ms()).await?;
                    vm_store::get(tx, &cfg.id).await
                }.await)?;
                let row = row.ok_or_else(|| {
                    Error::internal(format!("vm {} vanished from the store", cfg.id))
                })?;
                self.wake.notify_one();
                self.view(&row)
            }
            Err(e) => {
                let err = Error::from(e);
                let restored = self.restore_after_failure(&cfg, prev_good.as_ref()).await;
                let message = format!("vm {}: apply failed: {}{restored}", cfg.id, err.message);
                store_tx!(self.db, tx => async {
                    vm_store::restore(tx, &cfg.id, before.as_ref()).await?;
                    if let Some(b) = &before {
                        vm_store::set_result(tx, &cfg.id, b.applied.as_deref(), Some(&message), now_ms()).await?;
                    }
                    Ok::<_, Error>(())
                }.await)?;
                Err(Error::new(err.code, message))
            }
        }
    }

    /// After a failed apply of `cfg`: re-apply the previous good config, or remove the VM when
    /// there was none. Returns a sentence for the error message.
    async fn restore_after_failure(&self, cfg: &VmConfig, prev_good: Option<&VmConfig>) -> String {
        match prev_good {
            Some(prev) => {
                if prev.user_id != cfg.user_id {
                    let _ = self.driver.remove(cfg.user_id).await;
                }
                match self.plan(prev) {
                    Ok(p) => match self.driver.apply(&p).await {
                        Ok(_) => "; the previous config stays applied".to_owned(),
                        Err(e) => format!("; re-applying the previous config also failed: {e}"),
                    },
                    Err(e) => format!("; the previous config does not plan: {}", e.message),
                }
            }
            None => match self.driver.remove(cfg.user_id).await {
                Ok(_) => "; nothing of the VM was kept".to_owned(),
                Err(e) => format!("; removing the partial VM also failed: {e}"),
            },
        }
    }

    /// `DELETE /v1/vms/{id}`: remove everything the VM had, then forget it. Answers the VM as it
    /// was.
    ///
    /// # Errors
    /// `NOT_FOUND` for an unknown VM; `UNAVAILABLE` when the removal failed (the VM stays in the
    /// store, so the delete can be retried).
    pub async fn delete_vm(&self, id: &str) -> Result<VmView, Error> {
        let _guard = self.kernel_lock.lock().await;
        let row = store_tx!(self.db, tx => vm_store::get(tx, id).await)?;
        let row = row.ok_or_else(|| Error::not_found(format!("vm {id} not found")))?;
        let view = self.view(&row)?;
        let mut uids = vec![view.config.user_id];
        if let Some(a) = row.applied.as_deref() {
            let applied = decode(&row, a, "applied")?;
            if applied.user_id != view.config.user_id {
                uids.push(applied.user_id);
            }
        }
        for uid in uids {
            if let Err(e) = self.driver.remove(uid).await {
                let err = Error::from(e);
                return Err(Error::new(
                    err.code,
                    format!(
                        "vm {id}: removal failed (the VM is kept; retry the delete): {}",
                        err.message
                    ),
                ));
            }
        }
        store_tx!(self.db, tx => vm_store::delete(tx, id).await)?;
        self.wake.notify_one();
        Ok(view)
    }

    /// `GET /v1/status`.
    ///
    /// # Errors
    /// `UNAVAILABLE` on a store failure.
    pub async fn status(&self) -> Result<AgentStatus, Error> {
        let rows = store_tx!(self.db, tx => vm_store::list(tx).await)?;
        let mut vms = VmCounts {
            desired: rows.len() as u64,
            ..VmCounts::default()
        };
        for r in &rows {
            if r.last_error.is_some() {
                vms.failed += 1;
            } else if r.applied.as_deref() == Some(r.config.as_str()) {
                vms.applied += 1;
            }
        }
        let reconcile = self.record.lock().map(|r| r.clone()).unwrap_or_default();
        let pool = match self.pool.get() {
            Some(p) => Some(p.status().await),
            None => None,
        };
        Ok(AgentStatus {
            version: env!("CARGO_PKG_VERSION").to_owned(),
            name_prefix: self.settings.name_prefix.clone(),
            reconcile_interval_secs: self.interval.as_secs(),
            vms,
            reconcile,
            pool,
        })
    }
}
