//! Pool mode as the agent runs it: the root helper started, the three tables loaded (empty of
//! taps) before any VM starts, the drift audit running every [`AUDIT_PERIOD`], and a watchdog
//! on the helper.
//!
//! # Design
//! The tables belong to the helper's netlink socket (table flag `owner`), so the kernel deletes
//! them when the helper exits. The watchdog (a thread, when the executor has an owner to watch:
//! [`NftExec::owner_watch`]) waits on the helper's pidfd; on its exit it takes the firewall
//! lock, starts a new helper and re-applies the full desired state, and records the restart and
//! how long the tables were missing for ([`AuditRecord`]). A change that reached the dead
//! helper fails with `UNAVAILABLE` and is retried by the caller's next pass.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vmnet_kernel::pool::firewall::{
    FirewallError, FirewallStatus, NftExec, OwnerWatch, PoolFirewall,
};
use vmnet_model::Error;
use vmnet_model::nic::InstanceSpec;
use vmnet_plan::pool::nft::{Firewall, HostAddrs};

use super::audit::{self, AUDIT_PERIOD, AuditRecord};
use super::helper::HelperClient;

/// Any [`NftExec`] behind one type: the root helper in production, a fake in tests.
pub struct DynExec(pub Box<dyn NftExec>);

impl std::fmt::Debug for DynExec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DynExec")
    }
}

impl NftExec for DynExec {
    fn apply(&self, batch: &str) -> Result<(), FirewallError> {
        self.0.apply(batch)
    }

    fn list(&self) -> Result<String, FirewallError> {
        self.0.list()
    }

    fn owner_watch(&self) -> Option<Arc<dyn OwnerWatch>> {
        self.0.owner_watch()
    }
}

/// How often the watchdog checks whether it should stop (it wakes at once on the helper's
/// exit).
const WATCH_TICK: Duration = Duration::from_millis(100);

/// Waits for the owner of the tables to die, restarts it and re-applies, until `stop`.
fn spawn_watchdog(
    watch: Arc<dyn OwnerWatch>,
    firewall: Arc<Mutex<AgentFirewall>>,
    record: Arc<Mutex<AuditRecord>>,
    stop: Arc<AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("pool-helper-watch".into())
        .spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if !watch.wait_lost(WATCH_TICK) {
                    continue;
                }
                let t = Instant::now();
                tracing::error!("pool root helper exited: the kernel dropped the bcd tables");
                let res = {
                    let mut fw = firewall
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    watch.restart().and_then(|()| fw.reapply())
                };
                let took = u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX);
                let mut r = record
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                match res {
                    Ok(()) => {
                        tracing::warn!(took_ms = took, "bcd tables re-applied by a new helper");
                        r.helper_restarts += 1;
                        r.last_helper_restart_ms = Some(took);
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "pool root helper restart failed");
                        r.last_error = Some(e.to_error().message);
                        drop(r);
                        // The old helper stays exited: the next round retries.
                        std::thread::sleep(Duration::from_secs(1));
                    }
                }
            }
        })
}

/// The firewall type the agent drives.
pub type AgentFirewall = PoolFirewall<DynExec>;

/// The agent's pool-mode firewall: the executor, the desired tables and the audit task.
#[derive(Debug)]
pub struct PoolRuntime {
    firewall: Arc<Mutex<AgentFirewall>>,
    record: Arc<Mutex<AuditRecord>>,
    audit: tokio::task::JoinHandle<()>,
    stop: Arc<AtomicBool>,
    watchdog: Option<std::thread::JoinHandle<()>>,
}

impl PoolRuntime {
    /// Takes a started executor (the helper from [`HelperClient::spawn`], or
    /// [`HelperClient::spawn_default`] in production; a fake in tests), replaces the three tables
    /// with an empty host state for `host`, starts the audit every `period` (the agent uses
    /// [`AUDIT_PERIOD`]) and, when the executor's tables belong to another process (the
    /// helper), the watchdog that restarts it and re-applies on its exit. Call inside a tokio
    /// runtime.
    ///
    /// # Errors
    /// `UNAVAILABLE` when the first replace fails or the watchdog cannot start.
    pub fn start<E: NftExec + 'static>(
        exec: E,
        host: HostAddrs,
        period: Duration,
    ) -> Result<Self, Error> {
        let watch = exec.owner_watch();
        let mut fw = PoolFirewall::new(DynExec(Box::new(exec)));
        fw.replace(Firewall { taps: vec![], host })
            .map_err(|e| e.to_error())?;
        let firewall = Arc::new(Mutex::new(fw));
        let record = Arc::new(Mutex::new(AuditRecord::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let watchdog = watch
            .map(|w| {
                spawn_watchdog(
                    w,
                    Arc::clone(&firewall),
                    Arc::clone(&record),
                    Arc::clone(&stop),
                )
            })
            .transpose()
            .map_err(|e| Error::unavailable(format!("pool helper watchdog: {e}")))?;
        let audit = audit::spawn(Arc::clone(&firewall), Arc::clone(&record), period);
        Ok(Self {
            firewall,
            record,
            audit,
            stop,
            watchdog,
        })
    }

    /// [`Self::start`] with the installed helper (`vmnet-pool-helper` next to the running
    /// executable) serving `netns`, and the 5-second audit.
    ///
    /// # Errors
    /// `UNAVAILABLE` when the helper cannot start or the first replace fails.
    pub fn start_default(netns: Option<&str>, host: HostAddrs) -> Result<Self, Error> {
        let helper = HelperClient::spawn_default(netns)
            .map_err(|e| Error::unavailable(format!("pool root helper: {e}")))?;
        Self::start(helper, host, AUDIT_PERIOD)
    }

    /// Adds an instance's rules (before its taps exist).
    ///
    /// # Errors
    /// The documented error (`INVALID_INPUT`, `CONFLICT`, `UNAVAILABLE`).
    pub fn add_instance(&self, inst: &InstanceSpec) -> Result<(), Error> {
        self.lock().add_instance(inst).map_err(|e| e.to_error())
    }

    /// Removes an instance's rules (after its taps are gone).
    ///
    /// # Errors
    /// `UNAVAILABLE` when the helper refuses or fails.
    pub fn remove_instance(&self, instance_id: &str) -> Result<(), Error> {
        self.lock()
            .remove_instance(instance_id)
            .map_err(|e| e.to_error())
    }

    /// The status counters: taps, drift repairs, last drift.
    #[must_use]
    pub fn status(&self) -> FirewallStatus {
        audit::status(&self.firewall)
    }

    /// What the audit loop has done.
    #[must_use]
    pub fn audit_record(&self) -> AuditRecord {
        self.record
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The shared firewall (for callers that drive it directly).
    #[must_use]
    pub fn firewall(&self) -> Arc<Mutex<AgentFirewall>> {
        Arc::clone(&self.firewall)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, AgentFirewall> {
        self.firewall
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Drop for PoolRuntime {
    fn drop(&mut self) {
        self.audit.abort();
        self.stop.store(true, Ordering::Relaxed);
        if let Some(w) = self.watchdog.take() {
            let _ = w.join();
        }
    }
}
