//! The metrics listener (`vmnet serve --metrics-listen ADDR`): a TCP port serving `GET
//! /metrics`, `GET /healthz` and `GET /readyz` only ([`crate::api::ops::ops_router`]), for a
//! Prometheus server and health probes that cannot use the unix socket.
//!
//! # Design
//! - Nothing else is served on it: the API stays on the unix socket, where the peer's
//!   credentials are checked. Every path but the three answers 404.
//! - Bounded: at most [`MAX_CONNECTIONS`] connections are open at once (a further one is
//!   closed at accept); a client must send its request headers within [`HEADER_TIMEOUT`]; a
//!   connection lives at most [`CONNECTION_LIFETIME`] (the request in flight is answered
//!   first). A half-open or slow client therefore holds one slot for seconds, not forever.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use super::ServerError;

/// The most connections open at once.
pub const MAX_CONNECTIONS: usize = 32;

/// How long a client has to send a request's headers.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// How long one connection may stay open.
pub const CONNECTION_LIFETIME: Duration = Duration::from_secs(30);

/// Binds the metrics listener.
///
/// # Errors
/// `UNAVAILABLE` naming the address when the bind fails (in use, not an address of this host).
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, ServerError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| ServerError::Io {
            what: format!("--metrics-listen {addr}: bind failed"),
            source,
        })
}

/// Serves `router` on `listener` until `shutdown` completes (see the module docs).
pub async fn serve(
    router: Router,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => return,
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!("metrics listener: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            tracing::debug!(%peer, "metrics listener: {MAX_CONNECTIONS} connections open; closed this one");
            continue;
        };
        let svc = TowerToHyperService::new(router.clone());
        tokio::spawn(async move {
            let _slot = slot;
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                // A client that shuts down its sending side after its request still gets the answer.
                .half_close(true)
                .max_buf_size(16 * 1024)
                .serve_connection(TokioIo::new(stream), svc);
            tokio::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(%peer, "metrics connection ended: {e}");
                    }
                    return;
                }
                () = tokio::time::sleep(CONNECTION_LIFETIME) => {}
            }
            conn.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(HEADER_TIMEOUT, conn).await;
        });
    }
}
