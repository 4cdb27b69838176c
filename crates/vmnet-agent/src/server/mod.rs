//! Listening: the agent's unix socket, created with its final mode and group, and the serve loop
//! that checks each connection's peer ([`access`]) before serving it.
//!
//! # Design
//! - The socket is bound inside a private directory (mode 0700, next to the socket's path), set
//!   to mode 0660 and its group (`--socket-group`), and only then renamed into place: no process
//!   can connect while it still has the mode the umask gave it.
//! - A stale socket file left by a killed agent is removed before binding, but a socket some
//!   live agent still answers on is never stolen (nor replaced by a racing agent: the rename
//!   refuses to replace a file).
//! - Every connection's peer credentials are checked before it is served ([`access::Access`]);
//!   a refusal is logged with the peer's uid, gid and pid, and the connection closed unread.
//! - Each connection is served by hyper in its own task. A connection that fails (the client
//!   hung up while its answers were being written, a malformed request) ends that connection
//!   only and is logged with its peer; the process ignores `SIGPIPE`, so a write to a vanished
//!   client is an `EPIPE` for that connection and nothing else.
//! - Bounded, so no local client can use up the agent's descriptors (libnftables ends the
//!   process when it cannot open its netlink socket): at most [`MAX_CONNECTIONS`] connections
//!   are open at once (a further one is closed at accept, and the refusals are logged once per
//!   [`REFUSED_LOG_INTERVAL`] with their count, as are the connections that end with an error); a client must send each request's headers
//!   within [`HEADER_TIMEOUT`] of the connection becoming ready for one, so a connection that
//!   sends nothing, or sends a head slowly, or idles between requests, is closed after it. A
//!   response in progress (an event stream) is not limited by it.
//! - Every request carries its connection's [`ConnCut`]: an event stream whose reader stopped
//!   reading fires it, and the connection is closed ([`crate::events::stream`]).
//! - The API is served on this socket only (a TCP port cannot tell which local user
//!   connects); the optional metrics listener ([`tcp`]) serves the metrics and the health
//!   probes, nothing else.

pub mod access;
pub mod tcp;

use std::future::Future;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;

pub use access::{Access, Peer, Verdict};

use crate::events::stream::ConnCut;

/// The unix socket's file mode: owner (root) and group read/write.
pub const SOCKET_MODE: u32 = 0o660;

/// How long a stopping agent lets open connections finish their requests.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// The most API connections open at once.
pub const MAX_CONNECTIONS: usize = 1024;

/// How long a client has to send a request's headers, from the moment its connection is ready
/// for a request (accepted, or done with the previous answer).
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// How often connections refused for [`MAX_CONNECTIONS`], or ended with an error, are logged
/// (each kind with the count of the lines held back).
pub const REFUSED_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Why the agent cannot listen or serve. Mapped to a documented code at the CLI's edge
/// ([`server_code`](crate::api::error::server_code)).
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The socket is held by a live agent, or its path is another kind of file.
    #[error("{0}")]
    InUse(String),
    /// `--socket-group` names no group.
    #[error("{0}")]
    BadGroup(String),
    /// A file, bind or serve step failed.
    #[error("{what}")]
    Io {
        /// What was attempted, naming the socket.
        what: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

fn io(what: String) -> impl FnOnce(std::io::Error) -> ServerError {
    move |source| ServerError::Io { what, source }
}

/// The agent's listening socket and who may use it.
#[derive(Debug)]
pub struct ApiListener {
    listener: UnixListener,
    path: PathBuf,
    access: Access,
}

impl ApiListener {
    /// Where the socket is.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Who may use it.
    #[must_use]
    pub fn access(&self) -> Access {
        self.access
    }
}

/// Removes the private bind directory (and the socket in it, when the rename did not happen).
struct BindDir(PathBuf);

impl Drop for BindDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Binds the agent's unix socket at `path` for `access`: creates the parent directory, removes
/// a stale socket file, binds in a private directory, sets mode 0660 and the socket group, and
/// renames it into place (see the module docs).
///
/// # Errors
/// `CONFLICT` when another agent answers on the socket or the path is not a socket;
/// `UNAVAILABLE` when the directory, bind, chmod, chown or rename fails.
pub async fn bind_unix(path: &Path, access: Access) -> Result<ApiListener, ServerError> {
    let shown = path.display();
    let dir = match path.parent().filter(|d| !d.as_os_str().is_empty()) {
        Some(d) => d.to_owned(),
        None => PathBuf::from("."),
    };
    std::fs::create_dir_all(&dir).map_err(io(format!(
        "socket {shown}: cannot create {}",
        dir.display()
    )))?;
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if UnixStream::connect(path).await.is_ok() {
                return Err(ServerError::InUse(format!(
                    "socket {shown}: another agent is listening on it"
                )));
            }
            std::fs::remove_file(path).map_err(io(format!(
                "socket {shown}: cannot remove the stale socket"
            )))?;
        }
        Ok(_) => {
            return Err(ServerError::InUse(format!(
                "socket {shown}: the path exists and is not a socket"
            )));
        }
        Err(_) => {}
    }
    let mut nonce = [0u8; 8];
    getrandom::fill(&mut nonce).map_err(|e| ServerError::Io {
        what: format!("socket {shown}: no random name for the bind directory"),
        source: std::io::Error::other(e.to_string()),
    })?;
    let private = BindDir(dir.join(format!(".vmnet-bind-{}", hex::encode(nonce))));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&private.0)
        .map_err(io(format!(
            "socket {shown}: cannot create the bind directory {}",
            private.0.display()
        )))?;
    let staged = private.0.join("s");
    let listener =
        UnixListener::bind(&staged).map_err(io(format!("socket {shown}: bind failed")))?;
    std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(SOCKET_MODE))
        .map_err(io(format!("socket {shown}: chmod failed")))?;
    if let Some(gid) = access.group {
        std::os::unix::fs::lchown(&staged, None, Some(gid))
            .map_err(io(format!("socket {shown}: chown to group {gid} failed")))?;
    }
    nix::fcntl::renameat2(
        nix::fcntl::AT_FDCWD,
        &staged,
        nix::fcntl::AT_FDCWD,
        path,
        nix::fcntl::RenameFlags::RENAME_NOREPLACE,
    )
    .map_err(|e| match e {
        nix::errno::Errno::EEXIST => ServerError::InUse(format!(
            "socket {shown}: another agent created it while this one was binding"
        )),
        e => ServerError::Io {
            what: format!("socket {shown}: rename into place failed"),
            source: e.into(),
        },
    })?;
    drop(private);
    Ok(ApiListener {
        listener,
        path: path.to_owned(),
        access,
    })
}

/// The peer of an accepted connection.
///
/// # Errors
/// When the kernel does not tell (the connection is then refused).
fn peer_of(stream: &UnixStream) -> std::io::Result<Peer> {
    let c = stream.peer_cred()?;
    Ok(Peer {
        uid: c.uid(),
        gid: c.gid(),
        pid: c.pid(),
    })
}

/// Checks `peer` against `access` (the group lookup on a blocking thread).
async fn verdict(access: Access, peer: Peer) -> Verdict {
    if peer.uid == 0 {
        return Verdict::Allowed;
    }
    tokio::task::spawn_blocking(move || access.check(&peer, access::groups_of))
        .await
        .unwrap_or_else(|e| Verdict::Refused(format!("the group lookup failed: {e}")))
}

/// Serves `router` on `api` until `shutdown` completes, then lets open connections finish (at
/// most [`SHUTDOWN_GRACE`]) and removes the socket file. Each connection is checked first
/// ([`access`]); a refused or failed connection is logged with its peer and ends alone.
///
/// # Errors
/// `UNAVAILABLE` when accepting fails for good.
pub async fn serve(
    router: Router,
    api: ApiListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    serve_with(router, api, shutdown, Limits::default()).await
}

/// The bounds of the API socket's connections ([`serve_with`]).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// The most connections open at once.
    pub max_connections: usize,
    /// How long a client has to send a request's headers.
    pub header_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: MAX_CONNECTIONS,
            header_timeout: HEADER_TIMEOUT,
        }
    }
}

/// [`serve`] with other bounds than the defaults (tests use small ones).
///
/// # Errors
/// `UNAVAILABLE` when accepting fails for good.
pub async fn serve_with(
    router: Router,
    api: ApiListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
    limits: Limits,
) -> Result<(), ServerError> {
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    let access = api.access;
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let mut refused = LogGate::default();
    let conn_errors = Arc::new(std::sync::Mutex::new(LogGate::default()));
    loop {
        let stream = tokio::select! {
            () = &mut shutdown => break,
            r = api.listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    // E.g. EMFILE: back off instead of spinning; the socket stays.
                    tracing::warn!("API socket: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            if let Some(held) = refused.pass() {
                tracing::warn!(
                    "API socket: {} connections open; closed a new one at accept ({held} more \
                     since the last such line)",
                    limits.max_connections
                );
            }
            continue;
        };
        let peer = match peer_of(&stream) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!("API connection refused: its peer credentials are unknown: {e}");
                continue;
            }
        };
        let cut = ConnCut::default();
        let conn = {
            let svc = tower::Layer::layer(&axum::Extension(cut.clone()), router.clone());
            let svc = TowerToHyperService::new(svc);
            hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                // A client that shuts down its sending side after its request still gets the answer.
                .half_close(true)
                .serve_connection(TokioIo::new(stream), svc)
        };
        let watched = graceful.watch(conn);
        let conn_errors = Arc::clone(&conn_errors);
        tokio::spawn(async move {
            let _slot = slot;
            if let Verdict::Refused(why) = verdict(access, peer).await {
                tracing::warn!(
                    peer.uid,
                    peer.gid,
                    peer.pid,
                    "API connection refused: {why}"
                );
                return;
            }
            let ended = tokio::select! {
                r = watched => r,
                () = cut.0.notified() => {
                    tracing::warn!(peer.uid, peer.gid, peer.pid, "API connection from {peer} closed: its event stream's reader stopped reading");
                    return;
                }
            };
            // A client that hangs up, sends a malformed head or is too slow ends its own
            // connection: logged with its peer, but one line per interval (the rest at debug),
            // so no client can flood the log.
            if let Err(e) = ended {
                let why = vmnet_model::error::chain(&e);
                let gate = conn_errors
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .pass();
                match gate {
                    Some(held) => tracing::warn!(
                        peer.uid,
                        peer.gid,
                        peer.pid,
                        "API connection from {peer} ended with an error: {why} ({held} more such \
                         lines since the last one held back)"
                    ),
                    None => tracing::debug!(
                        peer.uid,
                        peer.gid,
                        peer.pid,
                        "API connection from {peer} ended with an error: {why}"
                    ),
                }
            }
        });
    }
    drop(api.listener);
    let _ = std::fs::remove_file(&api.path);
    if tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            "API connections still open after {SHUTDOWN_GRACE:?}; closing them with the agent"
        );
    }
    Ok(())
}

/// Lets one log line of a kind through per [`REFUSED_LOG_INTERVAL`] and counts the others, so
/// a client cannot flood the log with lines about its own connections.
#[derive(Debug, Default)]
struct LogGate {
    last: Option<Instant>,
    held: u64,
}

impl LogGate {
    /// `Some(lines held back since the last one let through)` when this one may be logged.
    fn pass(&mut self) -> Option<u64> {
        if self
            .last
            .is_some_and(|t| t.elapsed() < REFUSED_LOG_INTERVAL)
        {
            self.held += 1;
            return None;
        }
        self.last = Some(Instant::now());
        Some(std::mem::take(&mut self.held))
    }
}

/// Completes on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    match (term, int) {
        (Ok(mut t), Ok(mut i)) => {
            tokio::select! {
                _ = t.recv() => {}
                _ = i.recv() => {}
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
