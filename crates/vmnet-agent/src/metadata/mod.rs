//! The metadata service (MMDS) of namespace mode: every VM's document served at
//! `169.254.169.254:80` inside the VM's own netns, by this one agent process (spec:
//! namespaced-vm-networking.md, the MMDS paragraph of "Atlas WG Mesh"; the document is planned
//! by [`vmnet_plan::ns::metadata`]).
//!
//! # Design
//! - One listening socket per VM, created inside the VM's netns (a short-lived thread enters
//!   the netns, binds `169.254.169.254:80` and returns the socket, which stays in that netns),
//!   all served by the agent's tokio runtime. The VM a request is for is the listener it
//!   arrived on, never its source address or any header: a guest can only ever reach its own
//!   netns, so it can only ever read its own document.
//! - The document lives in memory ([`VmMeta`]); [`MetadataService::sync`] replaces it when a
//!   VM's config changes (after the apply), so the next request sees the change at once. Its
//!   folders' answers are serialised then, once ([`answers`]): a poll is a lookup, not a
//!   serialisation.
//! - Listeners and accepted connections take descriptors of 1024 and above ([`fds`]), leaving
//!   the numbers below `FD_SETSIZE` to libnftables in this process.
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
//! - The version (v1 or v2, [`mmds`]) is the VM's `metadata.version`, else the host default
//!   (`vmnet serve --metadata-version`, default v2).

pub mod answers;
pub mod fds;
pub mod limits;
pub mod mmds;
pub mod tokens;

use std::collections::HashMap;
use std::convert::Infallible;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::Value;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use vmnet_model::vm::metadata::MetadataVersion;
use vmnet_plan::ns::VmPlan;
use vmnet_plan::ns::metadata::{METADATA_IPV4, METADATA_PORT};

use self::answers::Document;
use self::limits::TokenBucket;
use self::tokens::TokenStore;

/// A VM's document and version, replaced together.
#[derive(Debug)]
struct Served {
    doc: Arc<Document>,
    version: MetadataVersion,
}

/// What one VM's listener serves, shared by its connections.
#[derive(Debug)]
pub struct VmMeta {
    served: RwLock<Served>,
    tokens: Mutex<TokenStore>,
    bucket: Mutex<TokenBucket>,
    conns: Arc<Semaphore>,
    /// Requests answered (any status), for the status and the benchmark.
    pub requests: AtomicU64,
    /// Requests answered `429`.
    pub limited: AtomicU64,
    /// Connections closed on accept because the VM had [`limits::MAX_CONNECTIONS`] open.
    pub refused: AtomicU64,
}

impl VmMeta {
    /// A VM's state serving `doc` as `version`.
    #[must_use]
    pub fn new(doc: Value, version: MetadataVersion) -> Arc<Self> {
        Arc::new(Self {
            served: RwLock::new(Served {
                doc: Arc::new(Document::new(doc)),
                version,
            }),
            tokens: Mutex::new(TokenStore::default()),
            bucket: Mutex::new(TokenBucket::new(Instant::now())),
            conns: Arc::new(Semaphore::new(limits::MAX_CONNECTIONS)),
            requests: AtomicU64::new(0),
            limited: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        })
    }

    /// Replaces the document and version (the next request sees them); the document's answers
    /// are serialised here, once, not per request ([`answers`]).
    pub fn set(&self, doc: Value, version: MetadataVersion) {
        let doc = Arc::new(Document::new(doc));
        if let Ok(mut s) = self.served.write() {
            *s = Served { doc, version };
        }
    }

    /// The document served now.
    #[must_use]
    pub fn document(&self) -> Arc<Document> {
        self.served.read().map_or_else(
            |_| Arc::new(Document::new(Value::Null)),
            |s| Arc::clone(&s.doc),
        )
    }

    /// Answers one request (rate limit, then [`mmds::respond_document`]).
    pub fn answer<B>(&self, req: &hyper::Request<B>) -> mmds::MmdsResponse {
        let now = Instant::now();
        let allowed = self.bucket.lock().is_ok_and(|mut b| b.take(now));
        self.requests.fetch_add(1, Ordering::Relaxed);
        if !allowed {
            self.limited.fetch_add(1, Ordering::Relaxed);
        }
        let (doc, version) = self.served.read().map_or_else(
            |_| {
                (
                    Arc::new(Document::new(Value::Null)),
                    MetadataVersion::default(),
                )
            },
            |s| (Arc::clone(&s.doc), s.version),
        );
        mmds::respond_document(
            &doc,
            version,
            &self.tokens,
            allowed,
            mmds::Asked {
                method: req.method(),
                path: req.uri().path(),
                headers: req.headers(),
                now,
            },
        )
    }
}

/// Serves `listener` for `meta` until the returned task is aborted, which also ends every open
/// connection: each watches the accept task's channel, which closes with it.
///
/// # Panics
/// When called outside a tokio runtime.
#[must_use]
pub fn serve(listener: tokio::net::TcpListener, meta: Arc<VmMeta>) -> JoinHandle<()> {
    tokio::spawn(async move {
        // Never sent on; dropped with this task, which completes every connection's `changed()`.
        let (alive, _) = tokio::sync::watch::channel(());
        loop {
            let stream = match fds::accept(&listener).await {
                Ok(s) => s,
                Err(e) => {
                    // E.g. EMFILE: back off instead of spinning.
                    tracing::warn!("metadata: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Ok(permit) = Arc::clone(&meta.conns).try_acquire_owned() else {
                meta.refused.fetch_add(1, Ordering::Relaxed);
                drop(stream);
                continue;
            };
            let m = Arc::clone(&meta);
            let mut gone = alive.subscribe();
            tokio::spawn(async move {
                let _permit = permit;
                let svc = service_fn(move |req| {
                    let r = m.answer(&req);
                    async move { Ok::<_, Infallible>(r) }
                });
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(Duration::from_secs(limits::HEADER_TIMEOUT_SECS))
                    .max_buf_size(16 * 1024)
                    .serve_connection(TokioIo::new(stream), svc);
                tokio::pin!(conn);
                let life =
                    tokio::time::sleep(Duration::from_secs(limits::CONNECTION_LIFETIME_SECS));
                tokio::select! {
                    _ = conn.as_mut() => return,
                    () = life => {}
                    _ = gone.changed() => return,
                }
                // The lifetime is over: answer the request in flight, if any, then close (an
                // idle keep-alive connection closes at once; the guest reconnects).
                conn.as_mut().graceful_shutdown();
                let _ =
                    tokio::time::timeout(Duration::from_secs(limits::HEADER_TIMEOUT_SECS), conn)
                        .await;
            });
        }
    })
}

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

/// Binds `169.254.169.254:80` inside the netns `netns` and returns the listener (registered
/// with the current tokio runtime, its descriptor at [`fds::FD_MIN`] or above where the
/// open-files limit allows) and the netns inode it lives in.
///
/// # Errors
/// A message when the netns cannot be entered or the address cannot be bound (e.g. it is not
/// on the tap yet).
///
/// # Panics
/// When called outside a tokio runtime.
pub fn bind_in(netns: &str) -> Result<(tokio::net::TcpListener, u64), String> {
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
    let l = tokio::net::TcpListener::from_std(std_listener).map_err(|e| format!("{netns}: {e}"))?;
    Ok((l, ino))
}

fn netns_inode(netns: &str) -> Result<u64, String> {
    std::fs::metadata(vmnet_kernel::netns::path(netns))
        .map(|m| m.ino())
        .map_err(|e| format!("{netns}: {e}"))
}

struct Listener {
    netns: String,
    ino: u64,
    meta: Arc<VmMeta>,
    task: JoinHandle<()>,
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Every VM's listener, by VM id.
pub struct MetadataService {
    default_version: MetadataVersion,
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
    /// A service with no listeners; VMs without a `metadata.version` speak `default_version`.
    #[must_use]
    pub fn new(default_version: MetadataVersion) -> Arc<Self> {
        Arc::new(Self {
            default_version,
            vms: Mutex::new(HashMap::new()),
        })
    }

    /// The host's default version.
    #[must_use]
    pub fn default_version(&self) -> MetadataVersion {
        self.default_version
    }

    /// Makes VM `plan.vm_id` serve `plan`'s document in `plan.netns` (call after a successful
    /// apply): updates it in place, or (re)creates the listener when the VM has none or its
    /// netns changed.
    ///
    /// # Errors
    /// A message naming the netns when the listener cannot be created (the VM keeps no
    /// listener; the next call retries).
    ///
    /// # Panics
    /// When called outside a tokio runtime.
    pub fn sync(&self, plan: &VmPlan) -> Result<(), String> {
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
                && !l.task.is_finished()
            {
                l.meta.set(doc, version);
                return Ok(());
            }
        }
        // Close the old listener first: a re-created netns with the same name needs no port
        // of the old one, but the old socket must not outlive the VM's change.
        self.remove(&plan.vm_id);
        let (listener, ino) = bind_in(&plan.netns)?;
        let meta = VmMeta::new(doc, version);
        let task = serve(listener, Arc::clone(&meta));
        if let Ok(mut vms) = self.vms.lock() {
            vms.insert(
                plan.vm_id.clone(),
                Listener {
                    netns: plan.netns.clone(),
                    ino,
                    meta,
                    task,
                },
            );
        }
        Ok(())
    }

    /// Closes VM `vm_id`'s listener and every connection on it (no-op without one).
    pub fn remove(&self, vm_id: &str) {
        let gone = self.vms.lock().ok().and_then(|mut v| v.remove(vm_id));
        drop(gone);
    }

    /// Closes the listeners of every VM not in `keep`.
    pub fn retain(&self, keep: &std::collections::BTreeSet<String>) {
        let gone: Vec<Listener> = match self.vms.lock() {
            Ok(mut v) => {
                let ids: Vec<String> = v.keys().filter(|k| !keep.contains(*k)).cloned().collect();
                ids.iter().filter_map(|k| v.remove(k)).collect()
            }
            Err(_) => Vec::new(),
        };
        drop(gone);
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

    /// VM `vm_id`'s served state, when it has a listener.
    #[must_use]
    pub fn vm(&self, vm_id: &str) -> Option<Arc<VmMeta>> {
        self.vms
            .lock()
            .ok()
            .and_then(|v| v.get(vm_id).map(|l| Arc::clone(&l.meta)))
    }
}
