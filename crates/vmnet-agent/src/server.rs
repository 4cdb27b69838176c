//! Listening: the unix socket (mode 0660) and an optional loopback TCP port.
//!
//! # Design
//! The unix socket is the primary endpoint; its file mode is the access control (root and the
//! socket's group). A stale socket file left by a killed agent is removed before binding, but a
//! socket some live agent still answers on is never stolen. The TCP listener only binds
//! loopback addresses: the API has no authentication.

use std::future::Future;
use std::net::SocketAddr;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;

use axum::Router;
use tokio::net::{TcpListener, UnixListener, UnixStream};
/// The unix socket's file mode: owner and group read/write.
pub const SOCKET_MODE: u32 = 0o660;

/// Why the agent cannot listen or serve. Mapped to a documented code at the CLI's edge
/// ([`server_code`](crate::api::error::server_code)).
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The socket is held by a live agent, or its path is another kind of file.
    #[error("{0}")]
    InUse(String),
    /// `--listen` names an address that is not loopback.
    #[error(
        "--listen {0}: only loopback addresses (127.0.0.0/8, ::1) are allowed; the API has no authentication"
    )]
    NotLoopback(SocketAddr),
    /// A file, bind or serve step failed.
    #[error("{what}")]
    Io {
        /// What was attempted, naming the socket or address.
        what: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

fn io(what: String) -> impl FnOnce(std::io::Error) -> ServerError {
    move |source| ServerError::Io { what, source }
}

/// Binds the agent's unix socket at `path`: creates the parent directory, removes a stale socket
/// file, binds and sets mode 0660.
///
/// # Errors
/// `CONFLICT` when another agent answers on the socket or the path is not a socket;
/// `UNAVAILABLE` when the directory, bind or chmod fails.
pub async fn bind_unix(path: &Path) -> Result<UnixListener, ServerError> {
    let shown = path.display();
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io(format!(
            "socket {shown}: cannot create {}",
            dir.display()
        )))?;
    }
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
    let listener = UnixListener::bind(path).map_err(io(format!("socket {shown}: bind failed")))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(SOCKET_MODE))
        .map_err(io(format!("socket {shown}: chmod failed")))?;
    Ok(listener)
}

/// Binds the optional TCP listener; only loopback addresses are accepted.
///
/// # Errors
/// `INVALID_INPUT` for a non-loopback address; `UNAVAILABLE` when bind fails.
pub async fn bind_tcp(addr: SocketAddr) -> Result<TcpListener, ServerError> {
    if !addr.ip().is_loopback() {
        return Err(ServerError::NotLoopback(addr));
    }
    TcpListener::bind(addr)
        .await
        .map_err(io(format!("--listen {addr}: bind failed")))
}

/// Serves `router` on the unix listener (and the TCP listener, if any) until `shutdown`
/// completes, then removes the socket file.
///
/// # Errors
/// `UNAVAILABLE` when a server fails.
pub async fn serve(
    router: Router,
    unix: UnixListener,
    socket_path: &Path,
    tcp: Option<TcpListener>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let tcp_task = tcp.map(|l| {
        let router = router.clone();
        let mut rx = stop_rx.clone();
        tokio::spawn(async move {
            axum::serve(l, router)
                .with_graceful_shutdown(async move {
                    let _ = rx.wait_for(|v| *v).await;
                })
                .await
        })
    });
    let mut rx = stop_rx.clone();
    let unix_task = tokio::spawn(async move {
        axum::serve(unix, router)
            .with_graceful_shutdown(async move {
                let _ = rx.wait_for(|v| *v).await;
            })
            .await
    });
    shutdown.await;
    let _ = stop_tx.send(true);
    let mut result = Ok(());
    let unix_res = unix_task.await;
    let _ = std::fs::remove_file(socket_path);
    if let Ok(Err(e)) | Err(e) = unix_res.map_err(std::io::Error::other) {
        result = Err(ServerError::Io {
            what: format!("socket {}: server failed", socket_path.display()),
            source: e,
        });
    }
    if let Some(t) = tcp_task
        && let Ok(Err(e)) | Err(e) = t.await.map_err(std::io::Error::other)
    {
        result = Err(ServerError::Io {
            what: "tcp listener: server failed".into(),
            source: e,
        });
    }
    result
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
