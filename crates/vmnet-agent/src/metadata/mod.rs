//! The metadata service (MMDS) of namespace mode: every VM's document served at
//! `169.254.169.254:80` inside the VM's own netns (spec: namespaced-vm-networking.md, the MMDS
//! paragraph of "Atlas WG Mesh"; the document is planned by [`vmnet_plan::ns::metadata`]).
//!
//! # Design
//! - The root agent makes one listening socket per VM inside the VM's netns (a short-lived
//!   thread enters the netns, binds `169.254.169.254:80` and returns the socket, which stays in
//!   that netns) and keeps it; the unprivileged metadata worker ([`crate::worker`]) gets a copy
//!   of it over `SCM_RIGHTS` and serves it ([`serve`]). The worker parses every guest's HTTP;
//!   the root process never does. The VM a request is for is the listener it arrived on, never
//!   its source address or any header: a guest can only ever reach its own netns, so it can
//!   only ever read its own document.
//! - Because the agent keeps each listener, a worker that dies loses only the connections it
//!   had open: new connections wait in the listener's queue until the restarted worker (handed
//!   every listener again) accepts them.
//! - [`MetadataService::sync`] hands the worker a VM's new document when its config changes
//!   (after the apply), so the next request sees the change at once. Its folders' answers are
//!   serialised then, once, by the worker ([`answers`]): a poll is a lookup, not a
//!   serialisation.
//! - Listeners take descriptors of 1024 and above in the agent ([`fds`]), leaving the numbers
//!   below `FD_SETSIZE` to libnftables in that process.
//! - Listeners follow the VM: [`MetadataService::sync`] creates one when the VM has none, or
//!   when its netns is a different one than the listener's (the netns was re-created: compared
//!   by inode); [`MetadataService::remove`] closes it when the VM is deleted;
//!   [`MetadataService::retain`] (end of every reconcile pass) closes those of VMs no longer
//!   stored. An agent restart re-creates them all in its first full pass.
//! - Per VM, a token bucket ([`limits::RATE_PER_SEC`], [`limits::BURST`]) answers `429` beyond
//!   its rate, at most [`limits::MAX_CONNECTIONS`] connections are open at once (more are closed
//!   on accept), each for at most [`limits::CONNECTION_LIFETIME_SECS`] (then closed gracefully:
//!   the request in flight is answered first); a connection reaches the service only once its
//!   request data arrived (`TCP_DEFER_ACCEPT`). Connections are HTTP/1.1 keep-alive, as
//!   `vmnet-guest` uses them: a poll costs one request on an open connection, not a TCP
//!   connection's setup and teardown. Refused work costs a
//!   flooding guest's own budget, not another VM's: each VM's connections are separate tasks.
//! - Version 2 session tokens are stateless ([`tokens`]): a restarted worker accepts the
//!   tokens its predecessor issued.
//! - The version (v1 or v2, [`mmds`]) is the VM's `metadata.version`, else the host default
//!   (`vmnet serve --metadata-version`, default v2).

pub mod answers;
pub mod fds;
pub mod limits;
pub mod mmds;
pub mod serve;
pub mod tokens;

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::sync::{Arc, Mutex};

use vmnet_model::vm::metadata::MetadataVersion;
use vmnet_plan::ns::VmPlan;
use vmnet_plan::ns::metadata::{METADATA_IPV4, METADATA_PORT};

pub use self::serve::{VmMeta, serve};
use crate::worker::{Change, Worker};

/// Asks the kernel to hand a connection to `accept` only once its first data arrived
/// (`TCP_DEFER_ACCEPT`, `secs` seconds at most): the service then reads the request at once
/// instead of waking twice per connection, and a guest's idle connections never reach it.
fn defer_accept(l: &std::net::TcpListener, secs: libc::c_int) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let len = libc::socklen_t::try_from(std::mem::size_of::<libc::c_int>())
        .map_err(std::io::Error::other)?;
    // SAFETY: the descriptor is a TCP socket `l` owns for the whole call, and the option value
    // points at a live c_int whose size is `len`.
    let rc = unsafe {
        libc::setsockopt(
            l.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_DEFER_ACCEPT,
            (&raw const secs).cast(),
            len,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Binds `169.254.169.254:80` inside the netns `netns` and returns the listener (non-blocking,
/// `TCP_DEFER_ACCEPT`, its descriptor at [`fds::FD_MIN`] or above where the open-files limit
/// allows; not registered with any runtime: the worker serves it) and the netns inode it lives
/// in.
///
/// # Errors
/// A message when the netns cannot be entered or the address cannot be bound (e.g. it is not
/// on the tap yet).
pub fn bind_in(netns: &str) -> Result<(std::net::TcpListener, u64), String> {
    let ino = netns_inode(netns)?;
    let std_listener = vmnet_kernel::netns::run_in(netns, || {
        std::net::TcpListener::bind((METADATA_IPV4, METADATA_PORT))
    })
    .map_err(|e| format!("{netns}: {e}"))?
    .map_err(|e| format!("{netns}: bind {METADATA_IPV4}:{METADATA_PORT}: {e}"))?;
    let std_listener = fds::move_above(std_listener, fds::FD_MIN);
    std_listener
        .set_nonblocking(true)
        .map_err(|e| format!("{netns}: {e}"))?;
    defer_accept(&std_listener, limits::HEADER_TIMEOUT_SECS_C)
        .map_err(|e| format!("{netns}: TCP_DEFER_ACCEPT: {e}"))?;
    Ok((std_listener, ino))
}

fn netns_inode(netns: &str) -> Result<u64, String> {
    std::fs::metadata(vmnet_kernel::netns::path(netns))
        .map(|m| m.ino())
        .map_err(|e| format!("{netns}: {e}"))
}

/// Where a VM's listener lives.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Listener {
    netns: String,
    ino: u64,
}

/// Every VM's listener, by VM id, served by the worker.
pub struct MetadataService {
    default_version: MetadataVersion,
    worker: Arc<Worker>,
    vms: Mutex<HashMap<String, Listener>>,
}

impl std::fmt::Debug for MetadataService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetadataService")
            .field("default_version", &self.default_version)
            .field("vms", &self.len())
            .finish()
    }
}

impl MetadataService {
    /// A service with no listeners, served by `worker`; VMs without a `metadata.version` speak
    /// `default_version`.
    #[must_use]
    pub fn new(default_version: MetadataVersion, worker: Arc<Worker>) -> Arc<Self> {
        Arc::new(Self {
            default_version,
            worker,
            vms: Mutex::new(HashMap::new()),
        })
    }

    /// The host's default version.
    #[must_use]
    pub fn default_version(&self) -> MetadataVersion {
        self.default_version
    }

    /// The worker serving the listeners.
    #[must_use]
    pub fn worker(&self) -> &Arc<Worker> {
        &self.worker
    }

    /// Makes VM `plan.vm_id` serve `plan`'s document in `plan.netns` (call after a successful
    /// apply): hands the worker the new document, or a new listener when the VM has none or its
    /// netns changed. Answers the worker's change to wait for ([`Worker::settled`]), `None` when
    /// nothing changed.
    ///
    /// # Errors
    /// A message naming the netns when the listener cannot be created (the VM keeps no
    /// listener; the next call retries).
    pub fn sync(&self, plan: &VmPlan) -> Result<Option<Change>, String> {
        let version = plan.metadata.version.unwrap_or(self.default_version);
        let doc = plan.metadata.document.clone();
        let ino = netns_inode(&plan.netns).ok();
        {
            let Ok(vms) = self.vms.lock() else {
                return Err("metadata: listener table poisoned".into());
            };
            if let Some(l) = vms.get(&plan.vm_id)
                && l.netns == plan.netns
                && Some(l.ino) == ino
                && self.worker.serves(&plan.vm_id)
            {
                return Ok(self.worker.document(&plan.vm_id, version, doc));
            }
        }
        // Close the old listener first: a re-created netns with the same name needs no port
        // of the old one, but the old socket must not outlive the VM's change.
        self.remove(&plan.vm_id);
        let (listener, ino) = bind_in(&plan.netns)?;
        let change = self
            .worker
            .listen(&plan.vm_id, listener.into(), version, doc);
        if let Ok(mut vms) = self.vms.lock() {
            vms.insert(
                plan.vm_id.clone(),
                Listener {
                    netns: plan.netns.clone(),
                    ino,
                },
            );
        }
        Ok(Some(change))
    }

    /// Closes VM `vm_id`'s listener and every connection on it (no-op without one).
    pub fn remove(&self, vm_id: &str) {
        let gone = self.vms.lock().ok().and_then(|mut v| v.remove(vm_id));
        if gone.is_some() {
            self.worker.forget(vm_id);
        }
    }

    /// Closes the listeners of every VM not in `keep`.
    pub fn retain(&self, keep: &std::collections::BTreeSet<String>) {
        let gone: Vec<String> = match self.vms.lock() {
            Ok(mut v) => {
                let ids: Vec<String> = v.keys().filter(|k| !keep.contains(*k)).cloned().collect();
                for k in &ids {
                    v.remove(k);
                }
                ids
            }
            Err(_) => Vec::new(),
        };
        for id in gone {
            self.worker.forget(&id);
        }
    }

    /// How many VMs have a listener.
    #[must_use]
    pub fn len(&self) -> usize {
        self.vms.lock().map(|v| v.len()).unwrap_or(0)
    }

    /// Whether no VM has a listener.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
