//! The serving side of the metadata service, which runs in the unprivileged worker
//! ([`crate::worker`]): each VM's document, tokens, rate limit and connection cap
//! ([`VmMeta`]), and the accept loop of one VM's listener ([`serve`]).

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::Value;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use vmnet_model::vm::metadata::MetadataVersion;

use super::answers::Document;
use super::limits::{self, TokenBucket};
use super::tokens::{Tokens, boot_secs};
use super::{fds, mmds};

/// The requests this process answered, by HTTP status, and the connections it refused, since
/// the last [`take_counts`]: the worker reports them to the agent (the metrics).
static COUNTS: Mutex<Counts> = Mutex::new(Counts {
    requests: std::collections::BTreeMap::new(),
    refused: 0,
});

/// Requests by status and refused connections ([`take_counts`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counts {
    /// Requests answered, by HTTP status.
    pub requests: std::collections::BTreeMap<u16, u64>,
    /// Connections closed on accept (the VM had [`limits::MAX_CONNECTIONS`] open).
    pub refused: u64,
}

fn count(f: impl FnOnce(&mut Counts)) {
    if let Ok(mut c) = COUNTS.lock() {
        f(&mut c);
    }
}

/// The counts since the last call (every VM's listeners in this process), reset.
#[must_use]
pub fn take_counts() -> Counts {
    COUNTS
        .lock()
        .map(|mut c| std::mem::take(&mut *c))
        .unwrap_or_default()
}

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
    tokens: Tokens,
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
    /// A VM's state serving `doc` as `version`, its session tokens `tokens`.
    #[must_use]
    pub fn new(doc: Value, version: MetadataVersion, tokens: Tokens) -> Arc<Self> {
        Arc::new(Self {
            served: RwLock::new(Served {
                doc: Arc::new(Document::new(doc)),
                version,
            }),
            tokens,
            bucket: Mutex::new(TokenBucket::new(Instant::now())),
            conns: Arc::new(Semaphore::new(limits::MAX_CONNECTIONS)),
            requests: AtomicU64::new(0),
            limited: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        })
    }

    /// Replaces the document and version (the next request sees them); the document's answers
    /// are serialised here, once, not per request ([`super::answers`]).
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
                now: boot_secs(),
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
                count(|c| c.refused += 1);
                drop(stream);
                continue;
            };
            let m = Arc::clone(&meta);
            let mut gone = alive.subscribe();
            tokio::spawn(async move {
                let _permit = permit;
                let svc = service_fn(move |req| {
                    let r = m.answer(&req);
                    let status = r.status().as_u16();
                    count(|c| *c.requests.entry(status).or_default() += 1);
                    async move { Ok::<_, Infallible>(r) }
                });
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(Duration::from_secs(limits::HEADER_TIMEOUT_SECS))
                    // A client that shuts down its sending side after its request still gets the answer.
                    .half_close(true)
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
