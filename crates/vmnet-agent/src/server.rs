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
use vmnet_model::Error;

/// The unix socket's file mode: owner and group read/write.
pub const SOCKET_MODE: u32 = 0o660;

/// Binds the agent's unix socket at `path`: creates the parent directory, removes a stale socket
/// file, binds and sets mode 0660.
///
/// # Errors
/// `CONFLICT` when another agent answers on the socket or the path is not a socket;
/// `UNAVAILABLE` when the directory, bind or chmod fails.
pub async fn bind_unix(path: &Path) -> Result<UnixListener, Error> {
    let shown = path.display();
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| {
            Error::unavailable(format!(
                "socket {shown}: cannot create {}: {e}",
                dir.display()
            ))
        })?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if UnixStream::connect(path).await.is_ok() {
                return Err(Error::conflict(format!(
                    "socket {shown}: another agent is listening on it"
                )));
            }
            std::fs::remove_file(path).map_err(|e| {
                Error::unavailable(format!(
                    "socket {shown}: cannot remove the stale socket: {e}"
                ))
            })?;
        }
        Ok(_) => {
            return Err(Error::conflict(format!(
                "socket {shown}: the path exists and is not a socket"
            )));
        }
        Err(_) => {}
    }
    let listener = UnixListener::bind(path)
        .map_err(|e| Error::unavailable(format!("socket {shown}: bind failed: {e}")))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(SOCKET_MODE))
        .map_err(|e| Error::unavailable(format!("socket {shown}: chmod failed: {e}")))?;
    Ok(listener)
}

/// Binds the optional TCP listener; only loopback addresses are accepted.
///
/// # Errors
/// `INVALID_INPUT` for a non-loopback address; `UNAVAILABLE` when bind fails.
pub async fn bind_tcp(addr: SocketAddr) -> Result<TcpListener, Error> {
    if !addr.ip().is_loopback() {
        return Err(Error::invalid(format!(
            "--listen {addr}: only loopback addresses (127.0.0.0/8, ::1) are allowed; the API has no authentication"
        )));
    }
    TcpListener::bind(addr)
        .await
        .map_err(|e| Error::unavailable(format!("--listen {addr}: bind failed: {e}")))
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
) -> Result<(), Error> {
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
        result = Err(Error::unavailable(format!(
            "socket {}: server failed: {e}",
            socket_path.display()
        )));
    }
    if let Some(t) = tcp_task
        && let Ok(Err(e)) | Err(e) = t.await.map_err(std::io::Error::other)
    {
        result = Err(Error::unavailable(format!(
            "tcp listener: server failed: {e}"
        )));
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
