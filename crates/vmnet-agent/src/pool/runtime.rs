//! Pool mode as the agent runs it: the root helper started, the three tables loaded before any
//! tap is touched (with the taps of the instances already placed on this host, so taps left by
//! an earlier agent keep their rules and the backstop), and the drift audit running every
//! [`AUDIT_PERIOD`].

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::api::error::from_firewall;
use vmnet_kernel::pool::firewall::{FirewallError, FirewallStatus, NftExec, PoolFirewall};
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
}

/// The firewall type the agent drives.
pub type AgentFirewall = PoolFirewall<DynExec>;

/// The agent's pool-mode firewall: the executor, the desired tables and the audit task.
#[derive(Debug)]
pub struct PoolRuntime {
    firewall: Arc<Mutex<AgentFirewall>>,
    record: Arc<Mutex<AuditRecord>>,
    audit: tokio::task::JoinHandle<()>,
}

impl PoolRuntime {
    /// Takes a started executor (the helper from [`HelperClient::spawn`], or
    /// [`HelperClient::spawn_default`] in production; a fake in tests), replaces the three tables
    /// with an empty host state for `host` and starts the audit every `period` (the agent uses
    /// [`AUDIT_PERIOD`]). Call inside a tokio runtime.
    ///
    /// # Errors
    /// `UNAVAILABLE` when the first replace fails.
    pub fn start<E: NftExec + 'static>(
        exec: E,
        host: HostAddrs,
        period: Duration,
    ) -> Result<Self, Error> {
        Self::start_with(exec, Firewall { taps: vec![], host }, period)
    }

    /// [`Self::start`] with a first load of `first` (its taps sorted by tap name): the tap
    /// entries of the instances this host should run, so the tables (and the backstop with
    /// them) hold those taps from the first transaction on.
    ///
    /// # Errors
    /// `UNAVAILABLE` when the first replace fails.
    pub fn start_with<E: NftExec + 'static>(
        exec: E,
        first: Firewall,
        period: Duration,
    ) -> Result<Self, Error> {
        let mut fw = PoolFirewall::new(DynExec(Box::new(exec)));
        fw.replace(first).map_err(|e| from_firewall(&e))?;
        let firewall = Arc::new(Mutex::new(fw));
        let record = Arc::new(Mutex::new(AuditRecord::default()));
        let audit = audit::spawn(Arc::clone(&firewall), Arc::clone(&record), period);
        Ok(Self {
            firewall,
            record,
            audit,
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
        self.lock()
            .add_instance(inst)
            .map_err(|e| from_firewall(&e))
    }

    /// Removes an instance's rules (after its taps are gone).
    ///
    /// # Errors
    /// `UNAVAILABLE` when the helper refuses or fails.
    pub fn remove_instance(&self, instance_id: &str) -> Result<(), Error> {
        self.lock()
            .remove_instance(instance_id)
            .map_err(|e| from_firewall(&e))
    }

    /// The status counters: taps, drift repairs, last drift.
    #[must_use]
    pub fn status(&self) -> FirewallStatus {
        audit::status(&self.firewall)
    }

    /// Runs one audit of the tables now ([`audit::audit_once`]); returns the differences it
    /// repaired (empty: none).
    pub async fn audit_now(&self) -> Vec<String> {
        audit::audit_once(&self.firewall, &self.record).await
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
    }
}
