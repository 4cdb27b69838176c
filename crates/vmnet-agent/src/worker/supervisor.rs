//! The agent's side of the worker: it starts the worker process, hands it every VM's listener
//! and document, sends it provider polls and checks their answers, and starts it again when it
//! dies.
//!
//! # Design
//! - What the worker should serve is a table in the agent ([`Worker::listen`],
//!   [`Worker::document`], [`Worker::forget`]): per VM its listening socket (the agent keeps its
//!   own descriptor), MMDS version and document. A change marks the VM dirty and wakes the pump
//!   task, which sends that VM's message only: one VM's change costs one message, whatever the
//!   number of VMs. Each batch ends with a `sync` the worker confirms, so a caller can wait
//!   until its change is served ([`super::table`]).
//! - The pump task owns the worker process and the socket. When the worker exits (or breaks
//!   the protocol, and is then killed), the pump logs how it ended, fails the polls in flight,
//!   starts a new worker (after [`RESTART_DELAY`], longer while it keeps dying at once), says
//!   hello again and marks every VM dirty: the new worker gets every listener and document.
//!   The listeners never closed in between, so guests' new connections wait in their queues.
//! - Polls go to the pump through a queue and come back by id; each answer is checked against
//!   the job it answers ([`super::check`]) before the poller writes anything.

use std::collections::{BTreeSet, HashMap};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use secrecy::{ExposeSecret, SecretString};
use serde_json::Value;
use tokio::sync::{Notify, mpsc, oneshot};
use vmnet_model::Error;
use vmnet_model::vm::metadata::MetadataVersion;

use super::check;
pub use super::launch::WorkerSettings;
use super::proto::{Channel, FromWorker, HttpWire, ProtoError, ToWorker, WireSecret, decode};
use super::table::{Change, Settled, Table};
use crate::metadata::tokens::TokenKey;
use crate::provider::fetch::{FetchError, FetchJob, Fetcher};
use crate::provider::{PollError, PollReport};
use crate::status::{WorkerStatus, now_ms};

/// How long a new worker may take to say it is ready.
pub const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// The wait before a worker is started again.
pub const RESTART_DELAY: Duration = Duration::from_millis(20);
/// The longest wait between restarts of a worker that keeps dying at once.
pub const MAX_RESTART_DELAY: Duration = Duration::from_secs(5);
/// A worker that ran this long before it died is restarted after [`RESTART_DELAY`] again.
pub const STABLE_AFTER: Duration = Duration::from_secs(10);
/// The longest the agent waits for the worker's answer to one poll.
pub const POLL_DEADLINE: Duration = Duration::from_secs(300);

/// The polls sent to the running worker, by id: the instances each asked for, and where its
/// answer goes.
type Inflight = HashMap<
    u64,
    (
        BTreeSet<String>,
        oneshot::Sender<Result<PollReport, FetchError>>,
    ),
>;

struct PollRequest {
    job: FetchJob,
    reply: oneshot::Sender<Result<PollReport, FetchError>>,
}

/// The worker as the agent sees it (see the module docs).
pub struct Worker {
    settings: WorkerSettings,
    key: Arc<TokenKey>,
    table: Mutex<Table>,
    wake: Notify,
    polls: mpsc::UnboundedSender<PollRequest>,
    status: Mutex<WorkerStatus>,
    ready: Notify,
    /// The metadata requests every worker reported, by status, and the refused connections.
    counts: Mutex<crate::metadata::serve::Counts>,
    /// The newest table change a worker confirmed.
    settled: Settled,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("settings", &self.settings)
            .field("status", &self.status())
            .finish_non_exhaustive()
    }
}

/// Why one run of the worker ended.
enum Ended {
    /// It exited (or was killed) with this status.
    Exited(String),
    /// The socket failed or the worker broke the protocol; it was killed.
    Broken(String),
}

impl Worker {
    /// Starts the worker and waits until it is ready (at most [`READY_TIMEOUT`]); from then on
    /// it runs until the agent exits, restarted whenever it dies. Call inside a tokio runtime.
    ///
    /// # Errors
    /// `UNAVAILABLE` when the key cannot be made or the first worker is not ready in time.
    pub async fn start(settings: WorkerSettings) -> Result<Arc<Self>, Error> {
        let key = Arc::new(TokenKey::random().map_err(Error::unavailable)?);
        let (tx, rx) = mpsc::unbounded_channel();
        let w = Arc::new(Self {
            status: Mutex::new(WorkerStatus {
                user: settings.user.name.clone(),
                uid: settings.user.uid,
                gid: settings.user.gid,
                ..WorkerStatus::default()
            }),
            settings,
            key,
            table: Mutex::new(Table::default()),
            wake: Notify::new(),
            polls: tx,
            ready: Notify::new(),
            counts: Mutex::default(),
            settled: Settled::default(),
        });
        let ready = w.ready.notified();
        tokio::spawn(Arc::clone(&w).pump(rx));
        if tokio::time::timeout(READY_TIMEOUT, ready).await.is_err() {
            let st = w.status();
            return Err(Error::unavailable(format!(
                "the metadata worker (user {}) was not ready within {READY_TIMEOUT:?}: {}",
                st.user,
                st.last_exit.unwrap_or_else(|| "no exit seen".into())
            )));
        }
        Ok(w)
    }

    /// What the status shows of the worker.
    #[must_use]
    pub fn status(&self) -> WorkerStatus {
        let mut st = self
            .status
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        st.vms = self.lock().vms.len() as u64;
        st
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn set_status(&self, f: impl FnOnce(&mut WorkerStatus)) {
        f(&mut self
            .status
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner));
    }

    /// Serves VM `vm` on `listener` (the agent keeps it) with `document`, replacing any
    /// listener the VM had; the change to wait for with [`Worker::settled`].
    pub fn listen(
        &self,
        vm: &str,
        listener: OwnedFd,
        version: MetadataVersion,
        document: Value,
    ) -> Change {
        let c = self.lock().listen(vm, listener, version, document);
        self.wake.notify_one();
        c
    }

    /// VM `vm`'s new document; `None` (nothing to wait for) for a VM without a listener or
    /// when the document is the same.
    pub fn document(&self, vm: &str, version: MetadataVersion, document: Value) -> Option<Change> {
        let c = self.lock().document(vm, version, document)?;
        self.wake.notify_one();
        Some(c)
    }

    /// Stops serving VM `vm` and closes the agent's copy of its listener.
    pub fn forget(&self, vm: &str) {
        if self.lock().forget(vm).is_some() {
            self.wake.notify_one();
        }
    }

    /// Waits until a running worker serves change `c`, at most `within`; whether it does. A
    /// worker that is dead or starting again is waited for only that long.
    pub async fn settled(&self, c: Change, within: Duration) -> bool {
        self.settled.has(c) || self.settled.wait(c, within).await
    }

    /// Whether VM `vm` has a listener.
    #[must_use]
    pub fn serves(&self, vm: &str) -> bool {
        self.lock().vms.contains_key(vm)
    }

    /// The metadata requests the workers answered since the agent started, by HTTP status, and
    /// the connections they refused.
    #[must_use]
    pub fn metadata_counts(&self) -> crate::metadata::serve::Counts {
        self.counts.lock().map(|c| c.clone()).unwrap_or_default()
    }

    /// The running worker's pid, if one runs.
    #[must_use]
    pub fn pid(&self) -> Option<u32> {
        self.status().pid
    }

    fn hello(&self) -> ToWorker {
        let h = &self.settings.http;
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        ToWorker::Hello {
            token_key: WireSecret(SecretString::from(hex::encode(self.key.expose()))),
            http: HttpWire {
                request_timeout_ms: ms(h.request_timeout),
                connect_timeout_ms: ms(h.connect_timeout),
                rate_limit_attempts: h.rate_limit_attempts,
                max_retry_wait_ms: ms(h.max_retry_wait),
                concurrency: u32::try_from(h.concurrency).unwrap_or(u32::MAX),
            },
        }
    }

    /// Runs workers one after the other for as long as the agent runs.
    async fn pump(self: Arc<Self>, mut polls: mpsc::UnboundedReceiver<PollRequest>) {
        let mut delay = RESTART_DELAY;
        loop {
            let started = Instant::now();
            let ended = match super::launch::spawn(&self.settings) {
                Ok((mut child, sock)) => {
                    let pid = child.id().unwrap_or(0);
                    self.set_status(|s| {
                        s.pid = Some(pid);
                        s.starts += 1;
                        s.last_start_at_unix_ms = Some(now_ms());
                    });
                    tracing::info!(
                        pid,
                        user = %self.settings.user.name,
                        uid = self.settings.user.uid,
                        "metadata worker started"
                    );
                    let ended = self.serve(&mut child, sock, &mut polls).await;
                    if matches!(ended, Ended::Broken(_)) {
                        // Our own child, not reaped yet: the pid cannot be another process's.
                        let _ = child.start_kill();
                    }
                    let status = child
                        .wait()
                        .await
                        .map_or_else(|e| format!("not reaped: {e}"), |s| s.to_string());
                    let why = match ended {
                        Ended::Exited(s) => s,
                        Ended::Broken(why) => format!("{why}; killed: {status}"),
                    };
                    tracing::warn!(pid, "metadata worker ended ({why}); starting it again");
                    why
                }
                Err(e) => {
                    tracing::error!("the metadata worker cannot be started: {e}");
                    format!("cannot be started: {e}")
                }
            };
            self.set_status(|s| {
                s.pid = None;
                s.last_exit = Some(ended);
                s.last_exit_at_unix_ms = Some(now_ms());
            });
            delay = if started.elapsed() >= STABLE_AFTER {
                RESTART_DELAY
            } else {
                (delay * 2).min(MAX_RESTART_DELAY)
            };
            tokio::time::sleep(delay).await;
        }
    }

    /// Serves one worker until it ends.
    async fn serve(
        &self,
        child: &mut tokio::process::Child,
        sock: tokio::net::UnixStream,
        polls: &mut mpsc::UnboundedReceiver<PollRequest>,
    ) -> Ended {
        let mut chan = Channel::new(sock);
        let mut inflight: Inflight = HashMap::new();
        let ended = self.run(child, &mut chan, polls, &mut inflight).await;
        let why = match &ended {
            Ended::Exited(s) | Ended::Broken(s) => s.clone(),
        };
        for (_, (_, reply)) in inflight {
            let _ = reply.send(Err((
                PollError::Unreachable {
                    what: "the metadata worker".into(),
                    why: format!("it ended during the poll: {why}"),
                },
                0,
            )));
        }
        ended
    }

    async fn run(
        &self,
        child: &mut tokio::process::Child,
        chan: &mut Channel,
        polls: &mut mpsc::UnboundedReceiver<PollRequest>,
        inflight: &mut Inflight,
    ) -> Ended {
        let broken = |e: ProtoError| Ended::Broken(e.to_string());
        if let Err(e) = chan.send_msg(&self.hello(), &[]).await {
            return broken(e);
        }
        match tokio::time::timeout(READY_TIMEOUT, chan.recv()).await {
            Ok(Ok(Some((body, fds)))) if fds.is_empty() => {
                if !matches!(decode::<FromWorker>(&body), Ok(FromWorker::Ready {})) {
                    return Ended::Broken("its first message is not ready".into());
                }
            }
            Ok(Ok(Some(_))) => return Ended::Broken("it sent descriptors".into()),
            Ok(Ok(None)) => {
                let st = child.wait().await;
                return Ended::Exited(st.map_or_else(|e| e.to_string(), |s| s.to_string()));
            }
            Ok(Err(e)) => return broken(e),
            Err(_) => return Ended::Broken(format!("not ready within {READY_TIMEOUT:?}")),
        }
        self.ready.notify_waiters();
        // Everything the worker should serve, again.
        let mut sent: HashMap<String, u64> = HashMap::new();
        self.lock().all_dirty();
        let mut next_id: u64 = 0;
        // The newest change number this worker was sent a `sync` for.
        let mut synced_upto = Change(0);
        let mut first = true;
        loop {
            match self.flush(chan, &mut sent, first).await {
                Ok(Some(upto)) => synced_upto = upto,
                Ok(None) => {}
                Err(e) => return broken(e),
            }
            first = false;
            tokio::select! {
                () = self.wake.notified() => {}
                req = polls.recv() => {
                    let Some(req) = req else {
                        return Ended::Exited("the agent stopped".into());
                    };
                    next_id += 1;
                    let asked: BTreeSet<String> =
                        req.job.machines.iter().map(|(id, _)| id.clone()).collect();
                    let msg = poll_message(next_id, req.job);
                    if let Err(e) = chan.send_msg(&msg, &[]).await {
                        let _ = req.reply.send(Err((
                            PollError::Unreachable {
                                what: "the metadata worker".into(),
                                why: e.to_string(),
                            },
                            0,
                        )));
                        return broken(e);
                    }
                    inflight.insert(next_id, (asked, req.reply));
                }
                got = chan.recv() => match got {
                    Ok(Some((body, fds))) => {
                        if !fds.is_empty() {
                            return Ended::Broken("it sent descriptors".into());
                        }
                        let sync = (&self.settled, synced_upto);
                        if let Err(why) = answer(&body, inflight, &self.counts, sync) {
                            return Ended::Broken(why);
                        }
                    }
                    Ok(None) => {
                        let st = child.wait().await;
                        return Ended::Exited(st.map_or_else(|e| e.to_string(), |s| s.to_string()));
                    }
                    Err(e) => return broken(e),
                },
                st = child.wait() => {
                    return Ended::Exited(st.map_or_else(|e| e.to_string(), |s| s.to_string()));
                }
            }
        }
    }

    /// Sends the worker what changed for every dirty VM: a new listener, a new document, or
    /// forget; then a `sync` of the newest change when anything was sent (or `always`, for a
    /// new worker), whose number it answers.
    async fn flush(
        &self,
        chan: &Channel,
        sent: &mut HashMap<String, u64>,
        always: bool,
    ) -> Result<Option<Change>, ProtoError> {
        let (work, upto) = self.lock().take_dirty();
        if work.is_empty() && !always {
            return Ok(None);
        }
        for (vm, entry) in work {
            match entry {
                Some(e) if sent.get(&vm) == Some(&e.generation) => {
                    let msg = ToWorker::Document {
                        vm: vm.clone(),
                        version: e.version,
                        document: (*e.document).clone(),
                    };
                    chan.send_msg(&msg, &[]).await?;
                }
                Some(e) => {
                    let msg = ToWorker::Listen {
                        vm: vm.clone(),
                        version: e.version,
                        document: (*e.document).clone(),
                    };
                    chan.send_msg(&msg, &[e.listener.as_fd()]).await?;
                    sent.insert(vm, e.generation);
                }
                None => {
                    if sent.remove(&vm).is_some() {
                        chan.send_msg(&ToWorker::Forget { vm }, &[]).await?;
                    }
                }
            }
        }
        chan.send_msg(&ToWorker::Sync { upto: upto.0 }, &[]).await?;
        Ok(Some(upto))
    }
}

/// The `poll` message of job `id`.
fn poll_message(id: u64, job: FetchJob) -> ToWorker {
    let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    ToWorker::Poll {
        id,
        provider: job.provider,
        api_url: job.api_url,
        authorization: WireSecret(SecretString::from(job.authorization.expose_secret())),
        machines: job.machines,
        rate_limit_attempts: job.http.rate_limit_attempts,
        max_retry_wait_ms: ms(job.http.max_retry_wait),
        concurrency: u32::try_from(job.http.concurrency).unwrap_or(u32::MAX),
    }
}

/// Takes one message of the worker: `polled`, for a poll in flight, that matches its job, the
/// metadata counts (added to `counts`), or `synced` (recorded in `sync.0`; it may not name a
/// change beyond `sync.1`, the newest one the worker was sent).
#[allow(clippy::type_complexity)]
fn answer(
    body: &[u8],
    inflight: &mut Inflight,
    counts: &Mutex<crate::metadata::serve::Counts>,
    sync: (&Settled, Change),
) -> Result<(), String> {
    let msg = decode::<FromWorker>(body).map_err(|e| e.to_string())?;
    if let FromWorker::Synced { upto } = msg {
        let (settled, sent) = sync;
        if upto > sent.0 {
            return Err(format!(
                "it confirmed change {upto}, beyond the newest it was sent ({})",
                sent.0
            ));
        }
        settled.confirm(Change(upto));
        return Ok(());
    }
    if let FromWorker::MetadataCounts { requests, refused } = &msg {
        if requests.len() > super::proto::MAX_STATUSES
            || requests.iter().any(|(s, _)| !(100..=599).contains(s))
        {
            return Err(
                "its metadata counts name more statuses than allowed, or a status out of range"
                    .into(),
            );
        }
        if let Ok(mut c) = counts.lock() {
            for (s, n) in requests {
                let e = c.requests.entry(*s).or_default();
                *e = e.saturating_add(*n);
            }
            c.refused = c.refused.saturating_add(*refused);
        }
        return Ok(());
    }
    let FromWorker::Polled {
        id,
        report,
        error,
        requests,
    } = msg
    else {
        return Err("it sent ready twice".into());
    };
    let Some((asked, reply)) = inflight.remove(&id) else {
        return Err(format!("it answered poll {id}, which is not in flight"));
    };
    let outcome = match (report, error) {
        (Some(r), None) => {
            let asked: BTreeSet<&str> = asked.iter().map(String::as_str).collect();
            match check::report(&asked, r) {
                Ok(r) => Ok(r),
                Err(why) => {
                    let _ = reply.send(Err((
                        PollError::Malformed {
                            what: "the metadata worker's report".into(),
                            why: why.clone(),
                        },
                        0,
                    )));
                    return Err(format!("poll {id}: {why}"));
                }
            }
        }
        (None, Some(e)) => Err((check::error(e), requests)),
        _ => return Err(format!("poll {id}: neither a report nor an error, or both")),
    };
    let _ = reply.send(outcome);
    Ok(())
}

impl Fetcher for Worker {
    fn fetch(&self, job: FetchJob) -> BoxFuture<'_, Result<PollReport, FetchError>> {
        Box::pin(async move {
            let (tx, rx) = oneshot::channel();
            if self.polls.send(PollRequest { job, reply: tx }).is_err() {
                return Err((
                    PollError::Unreachable {
                        what: "the metadata worker".into(),
                        why: "the agent is stopping".into(),
                    },
                    0,
                ));
            }
            match tokio::time::timeout(POLL_DEADLINE, rx).await {
                Ok(Ok(r)) => r,
                Ok(Err(_)) => Err((
                    PollError::Unreachable {
                        what: "the metadata worker".into(),
                        why: "it ended during the poll".into(),
                    },
                    0,
                )),
                Err(_) => Err((
                    PollError::Timeout {
                        what: "the metadata worker's poll".into(),
                        timeout_ms: u64::try_from(POLL_DEADLINE.as_millis()).unwrap_or(u64::MAX),
                    },
                    0,
                )),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_may_confirm_only_changes_it_was_sent() {
        let settled = Settled::default();
        let counts = Mutex::default();
        let mut inflight = Inflight::new();
        let body = |upto: u64| super::super::proto::encode(&FromWorker::Synced { upto }).unwrap();
        answer(&body(4), &mut inflight, &counts, (&settled, Change(5))).unwrap();
        assert!(settled.has(Change(4)) && !settled.has(Change(5)));
        let e = answer(&body(6), &mut inflight, &counts, (&settled, Change(5))).unwrap_err();
        assert!(e.contains("change 6"), "{e}");
        assert!(!settled.has(Change(6)));
    }
}
