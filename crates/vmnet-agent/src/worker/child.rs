//! The worker process: confined first ([`super::confine`]), then it serves the agent's socket
//! (descriptor [`WORKER_FD`]) until the agent closes it: every VM's metadata listener
//! ([`crate::metadata::serve`]) and the provider polls the agent asks for
//! ([`crate::provider::fetch::Direct`]).

use std::collections::HashMap;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use secrecy::ExposeSecret;
use tokio::task::JoinHandle;

use super::confine::{self, WorkerUser};
use super::proto::{
    Channel, FromWorker, HttpWire, ProtoError, ToWorker, WireMachine, WireReport, decode,
};
use crate::metadata::serve::{VmMeta, serve};
use crate::metadata::tokens::{TokenKey, Tokens};
use crate::provider::fetch::{Direct, FetchJob, Fetcher};
use crate::provider::http::HttpSettings;

/// The descriptor number the worker finds its socket on.
pub const WORKER_FD: i32 = 3;

/// The HTTP settings a `hello` carries.
#[must_use]
pub fn http_settings(w: &HttpWire) -> HttpSettings {
    HttpSettings {
        request_timeout: Duration::from_millis(w.request_timeout_ms),
        connect_timeout: Duration::from_millis(w.connect_timeout_ms),
        rate_limit_attempts: w.rate_limit_attempts,
        max_retry_wait: Duration::from_millis(w.max_retry_wait_ms),
        concurrency: usize::try_from(w.concurrency).unwrap_or(1).max(1),
    }
}

/// The worker's entry point, on the process's only thread: takes descriptor [`WORKER_FD`],
/// closes every other descriptor above stderr, becomes `uid:gid` with no capability, installs
/// the seccomp filter, then serves on a single-threaded runtime until the agent closes the
/// socket.
///
/// # Errors
/// A message when the confinement, the runtime or the socket fails.
pub fn main(ids: &str) -> Result<(), String> {
    let (uid, gid) = ids
        .split_once(':')
        .and_then(|(u, g)| Some((u.parse().ok()?, g.parse().ok()?)))
        .ok_or_else(|| format!("--worker-serve {ids}: expected UID:GID"))?;
    let user = WorkerUser {
        name: ids.to_owned(),
        uid,
        gid,
    };
    // SAFETY: the agent passed the socket as descriptor 3 and nothing else in this process owns
    // it.
    let sock = unsafe { OwnedFd::from_raw_fd(WORKER_FD) };
    confine::close_above(WORKER_FD)?;
    confine::drop_privileges(&user)?;
    confine::install_seccomp()?;
    // Timers and I/O only: no signal or process driver (their socketpair is not in the filter,
    // and the worker handles no signal and starts no process).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .max_blocking_threads(4)
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    rt.block_on(run(sock))
}

/// A VM being served: its state and accept task.
struct Vm {
    meta: Arc<VmMeta>,
    task: JoinHandle<()>,
}

impl Drop for Vm {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn run(sock: OwnedFd) -> Result<(), String> {
    let std = std::os::unix::net::UnixStream::from(sock);
    std.set_nonblocking(true).map_err(|e| e.to_string())?;
    let sock = tokio::net::UnixStream::from_std(std).map_err(|e| e.to_string())?;
    let mut chan = Channel::new(sock);
    let fail = |e: ProtoError| e.to_string();
    let Some((body, fds)) = chan.recv().await.map_err(fail)? else {
        return Ok(());
    };
    if !fds.is_empty() {
        return Err("hello: descriptors came with it".into());
    }
    let ToWorker::Hello { token_key, http } = decode::<ToWorker>(&body).map_err(fail)? else {
        return Err("the first message is not hello".into());
    };
    let mut key = Box::new([0u8; 32]);
    hex::decode_to_slice(token_key.0.expose_secret(), key.as_mut())
        .map_err(|e| format!("hello: token key: {e}"))?;
    let key = Arc::new(TokenKey::from_bytes(key));
    drop(token_key);
    let http = http_settings(&http);
    let fetcher = Arc::new(Direct::new(&http).map_err(|e| e.to_string())?);
    chan.send_msg(&FromWorker::Ready {}, &[])
        .await
        .map_err(fail)?;
    tracing::info!(
        pid = std::process::id(),
        uid = nix::unistd::getuid().as_raw(),
        "metadata worker serving"
    );
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<FromWorker>();
    let mut vms: HashMap<String, Vm> = HashMap::new();
    let mut report = tokio::time::interval(super::proto::COUNTS_PERIOD);
    report.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = report.tick() => {
                let c = crate::metadata::serve::take_counts();
                if !c.requests.is_empty() || c.refused > 0 {
                    let requests = c.requests.into_iter().collect();
                    let msg = FromWorker::MetadataCounts { requests, refused: c.refused };
                    chan.send_msg(&msg, &[]).await.map_err(fail)?;
                }
            }
            got = chan.recv() => {
                let Some((body, fds)) = got.map_err(fail)? else {
                    tracing::info!("the agent closed the worker's socket; stopping");
                    return Ok(());
                };
                let msg = decode::<ToWorker>(&body).map_err(fail)?;
                drop(body);
                handle(msg, fds, &mut vms, &key, &fetcher, &http, &tx)?;
            }
            Some(out) = rx.recv() => {
                chan.send_msg(&out, &[]).await.map_err(fail)?;
            }
        }
    }
}

/// Handles one message of the agent.
fn handle(
    msg: ToWorker,
    mut fds: Vec<OwnedFd>,
    vms: &mut HashMap<String, Vm>,
    key: &Arc<TokenKey>,
    fetcher: &Arc<Direct>,
    http: &HttpSettings,
    tx: &tokio::sync::mpsc::UnboundedSender<FromWorker>,
) -> Result<(), String> {
    let want_fds = usize::from(matches!(msg, ToWorker::Listen { .. }));
    if fds.len() != want_fds {
        return Err(format!(
            "a message came with {} descriptors, {want_fds} expected",
            fds.len()
        ));
    }
    match msg {
        ToWorker::Hello { .. } => return Err("a second hello".into()),
        ToWorker::Listen {
            vm,
            version,
            document,
        } => {
            let fd = fds.pop().ok_or("listen: no descriptor")?;
            let l = std::net::TcpListener::from(fd);
            l.set_nonblocking(true).map_err(|e| e.to_string())?;
            let l = tokio::net::TcpListener::from_std(l).map_err(|e| format!("vm {vm}: {e}"))?;
            let meta = VmMeta::new(document, version, Tokens::new(Arc::clone(key), &vm));
            let task = serve(l, Arc::clone(&meta));
            vms.insert(vm, Vm { meta, task });
        }
        ToWorker::Document {
            vm,
            version,
            document,
        } => match vms.get(&vm) {
            Some(v) => v.meta.set(document, version),
            None => tracing::warn!(vm, "a document for a VM without a listener; ignored"),
        },
        ToWorker::Forget { vm } => {
            vms.remove(&vm);
        }
        ToWorker::Sync { upto } => {
            let _ = tx.send(FromWorker::Synced { upto });
        }
        ToWorker::Poll {
            id,
            provider,
            api_url,
            authorization,
            machines,
            rate_limit_attempts,
            max_retry_wait_ms,
            concurrency,
        } => {
            let job = FetchJob {
                provider,
                api_url,
                authorization: authorization.0,
                machines,
                http: HttpSettings {
                    rate_limit_attempts,
                    max_retry_wait: Duration::from_millis(max_retry_wait_ms),
                    concurrency: usize::try_from(concurrency).unwrap_or(1).max(1),
                    ..http.clone()
                },
            };
            let fetcher = Arc::clone(fetcher);
            let tx = tx.clone();
            tokio::spawn(async move {
                let out = match fetcher.fetch(job).await {
                    Ok(r) => FromWorker::Polled {
                        id,
                        report: Some(WireReport {
                            results: r
                                .results
                                .into_iter()
                                .map(|m| WireMachine {
                                    instance_id: m.instance_id,
                                    addresses: m.addresses,
                                })
                                .collect(),
                            missing: r.missing,
                            errors: r.errors,
                            requests: r.requests,
                        }),
                        error: None,
                        requests: 0,
                    },
                    Err((e, requests)) => FromWorker::Polled {
                        id,
                        report: None,
                        error: Some(e),
                        requests,
                    },
                };
                let _ = tx.send(out);
            });
        }
    }
    Ok(())
}
