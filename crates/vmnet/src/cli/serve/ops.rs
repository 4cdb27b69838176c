//! What `vmnet serve` runs for the operator: the metrics listener (`--metrics-listen`) and the
//! systemd notifications ([`vmnet_agent::notify`]).

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use vmnet_agent::agent::Agent;
use vmnet_agent::api::error::from_server;
use vmnet_agent::server;
use vmnet_model::Error;

/// Binds `--metrics-listen`, if given, before the agent serves (a taken port fails the start).
///
/// # Errors
/// `UNAVAILABLE` naming the address when it cannot be bound.
pub(super) async fn bind_metrics(addr: Option<SocketAddr>) -> Result<Option<TcpListener>, Error> {
    let Some(addr) = addr else { return Ok(None) };
    let l = server::tcp::bind(addr).await.map_err(from_server)?;
    tracing::info!(%addr, "metrics listener on (GET /metrics, /healthz, /readyz)");
    Ok(Some(l))
}

/// The running tasks.
pub(super) struct Ops {
    tasks: Vec<JoinHandle<()>>,
}

/// Starts the metrics listener (when bound) and the systemd notifications (under systemd).
pub(super) fn start(agent: &Arc<Agent>, metrics: Option<TcpListener>) -> Ops {
    let mut tasks = vec![tokio::spawn(vmnet_agent::notify::run(Arc::clone(agent)))];
    if let Some(l) = metrics {
        let router = vmnet_agent::api::ops::ops_router(Arc::clone(agent));
        tasks.push(tokio::spawn(server::tcp::serve(
            router,
            l,
            std::future::pending(),
        )));
    }
    Ops { tasks }
}

impl Ops {
    /// Stops them (the agent is stopping).
    pub(super) fn stop(self) {
        for t in self.tasks {
            t.abort();
        }
    }
}

/// Completes on SIGTERM or SIGINT, after telling systemd the agent is stopping.
pub(super) async fn shutdown() {
    server::shutdown_signal().await;
    vmnet_agent::notify::stopping();
}
