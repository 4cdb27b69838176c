//! Wake on packet: a sleeping VM's first packets are held, reported at once, and delivered when
//! its VMM attaches (docs: activity.md, "Wake on packet").
//!
//! # Design
//! - Asleep is observed, never declared: a VM whose tap has no VMM has no carrier, and the
//!   kernel drops what is queued on it. The activity program copies each such frame that came
//!   from the host side ([`vmnet_kernel::activity::HeldReader`]); the kernel still drops the
//!   frame itself. Frames the VM's firewall drops never reach the tap, so they are never held.
//! - [`run`] reads the copies as they come and keeps them per VM ([`hold::VmHold`]: bounded
//!   by frames, bytes and time, the oldest dropped and counted first). A frame that counts as
//!   activity (TCP from the host side) makes a `vm_wake` event with its flow, at most one per VM
//!   per interval, and the same JSON is posted to the operator's hook socket when one is set.
//! - While a VM holds frames, its tap's port is open ([`vmnet_kernel::wake::TapPort`]: a
//!   netlink socket in the VM's namespace that hears the carrier come on, and a packet socket).
//!   When the VMM attaches, the perf buffers are read once more (frames the kernel queued just
//!   before), and every held frame is sent to the tap, oldest first, its transport checksum
//!   finished where the kernel had left it to the device; a `held_delivered` event reports the
//!   count. The port is closed. No socket is open for a VM that holds nothing.
//! - An awake VM costs nothing here: the program only copies while the tap's queue is
//!   deactivated.
//!
//! # Limitations
//! - Frames that arrive between the VMM attaching and the held ones being sent (the time the
//!   agent takes to hear the carrier, well under a millisecond on an idle host) reach the guest
//!   first.
//! - Frames longer than the largest held (GSO frames of an established flow) are counted, not
//!   held. What the VM's namespace sends itself (ARP, neighbour discovery, metadata answers) is
//!   not held: the kernel sends it again.

pub mod hold;

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;
use vmnet_kernel::activity::HeldReader;
use vmnet_kernel::wake::TapPort;
use vmnet_kernel::wake::frame::{complete_checksum, flow};
use vmnet_plan::ns::names::{NameKind, name};

use crate::agent::Agent;
use crate::events::EventBody;
use hold::{Counters, Limits, VmHold};

/// The operator's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WakeSettings {
    /// The bounds of each VM's hold.
    pub limits: Limits,
    /// The longest frame held (longer ones are counted).
    pub max_frame: u32,
    /// The least time between two wake events of one VM.
    pub interval: Duration,
    /// When held frames are delivered.
    pub deliver: Deliver,
    /// Where each wake event is also posted (`POST` of its JSON over HTTP/1.1 to this unix
    /// socket, at path [`HOOK_PATH`]).
    pub hook: Option<PathBuf>,
}

/// When a VM's held frames are delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Deliver {
    /// When the VMM opens the tap (its carrier comes on): for VMMs that keep what is queued on
    /// the tap until the guest reads it (Firecracker).
    #[default]
    Attach,
    /// When the guest sends its first frame after the VMM opened the tap (a restored guest
    /// announces itself): for VMMs that drop what reached the tap before they resumed the
    /// guest (qemu restoring a saved state).
    FirstFrame,
}

/// The path the hook is called at.
pub const HOOK_PATH: &str = "/v1/wake";

/// How often held frames are checked for their age.
const TICK: Duration = Duration::from_millis(100);

/// How long the hook may take to answer.
const HOOK_TIMEOUT: Duration = Duration::from_secs(1);

/// Agent-wide counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Totals {
    /// Wake events sent.
    pub wakes: u64,
    /// Frames held.
    pub held: u64,
    /// Held frames delivered.
    pub delivered: u64,
    /// Frames dropped (every reason).
    pub dropped: u64,
    /// Samples the kernel could not hand over (its buffers full).
    pub lost: u64,
    /// Hook calls that failed.
    pub hook_failures: u64,
}

struct Port {
    port: TapPort,
    task: tokio::task::AbortHandle,
    /// The VMM opened the tap; with [`Deliver::FirstFrame`], delivery waits for the guest.
    attached: bool,
}

#[derive(Default)]
struct State {
    /// VM ids by user id, read from the store when one is missing.
    ids: HashMap<u32, String>,
    vms: HashMap<u32, VmHold>,
    /// What VMs no longer here counted (the totals never go back).
    gone: Totals,
    ports: HashMap<u32, Port>,
    lost: u64,
    hook_failures: u64,
}

/// Wake on packet (see the module docs).
pub struct Wake {
    settings: WakeSettings,
    prefix: String,
    state: Mutex<State>,
}

impl std::fmt::Debug for Wake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wake")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl Wake {
    /// Wake on packet for VMs named under `prefix`.
    #[must_use]
    pub fn new(settings: WakeSettings, prefix: &str) -> Self {
        Self {
            settings,
            prefix: prefix.to_owned(),
            state: Mutex::new(State::default()),
        }
    }

    /// The settings.
    #[must_use]
    pub fn settings(&self) -> &WakeSettings {
        &self.settings
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The counters of the VM with user id `uid` (zero when it never held anything).
    #[must_use]
    pub fn counters(&self, uid: u32) -> Counters {
        self.lock()
            .vms
            .get(&uid)
            .map(|h| h.counters)
            .unwrap_or_default()
    }

    /// The agent-wide counters.
    #[must_use]
    pub fn totals(&self) -> Totals {
        let st = self.lock();
        let mut t = Totals {
            lost: st.lost,
            hook_failures: st.hook_failures,
            ..st.gone
        };
        for h in st.vms.values() {
            let c = h.counters;
            t.wakes += c.wakes;
            t.held += c.held;
            t.delivered += c.delivered;
            t.dropped +=
                c.dropped_overflow + c.dropped_expired + c.dropped_too_big + c.dropped_send;
        }
        t
    }

    /// The id of the VM with user id `uid` (empty when the store has none).
    async fn id_of(&self, agent: &Agent, uid: u32) -> String {
        if let Some(id) = self.lock().ids.get(&uid) {
            return id.clone();
        }
        match agent.vm_ids().await {
            Ok(ids) => {
                let mut st = self.lock();
                st.ids = ids;
                st.ids.get(&uid).cloned().unwrap_or_default()
            }
            Err(e) => {
                tracing::warn!(user_id = uid, "wake: reading the VM ids failed: {e}");
                String::new()
            }
        }
    }

    /// The VM with user id `uid` is gone (deleted, or given another user id): what it held is
    /// dropped, its port closed.
    pub fn forget(&self, uid: u32) {
        let mut st = self.lock();
        st.ids.remove(&uid);
        if let Some(h) = st.vms.remove(&uid) {
            // The totals are counters: what a gone VM counted stays in them, and what it held
            // is dropped.
            let c = h.counters;
            st.gone.wakes += c.wakes;
            st.gone.held += c.held;
            st.gone.delivered += c.delivered;
            st.gone.dropped += c.dropped_overflow
                + c.dropped_expired
                + c.dropped_too_big
                + c.dropped_send
                + c.held_now;
            if c.held_now > 0 {
                tracing::info!(
                    user_id = uid,
                    frames = c.held_now,
                    "wake: the VM is gone; its held frames are dropped"
                );
            }
        }
        if let Some(p) = st.ports.remove(&uid) {
            p.task.abort();
        }
    }
}

/// A wake event's fields, from a frame.
fn wake_body(frame: &[u8], held: u64) -> EventBody {
    let f = flow(frame);
    EventBody::VmWake {
        protocol: f.map_or(0, |f| f.proto),
        src: f.map(|f| f.src.to_string()).unwrap_or_default(),
        src_port: f.map_or(0, |f| f.sport),
        dst: f.map(|f| f.dst.to_string()).unwrap_or_default(),
        dst_port: f.map_or(0, |f| f.dport),
        held,
    }
}

/// Runs wake on packet until aborted: reads held frames, keeps them, reports wakes, delivers
/// on attach, expires the old ones.
pub async fn run(agent: Arc<Agent>, wake: Arc<Wake>, mut reader: HeldReader) {
    let (attach_tx, mut attach_rx) = mpsc::unbounded_channel::<u32>();
    // The ids now, so that the first wake reports its VM without reading the store.
    let _ = wake.id_of(&agent, u32::MAX).await;
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            r = reader.wait() => {
                if let Err(e) = r {
                    tracing::error!("wake on packet stopped: polling the held frames failed: {e}");
                    return;
                }
                take_frames(&agent, &wake, &mut reader, &attach_tx).await;
            }
            Some(uid) = attach_rx.recv() => {
                if port_says_deliver(&wake, uid) {
                    deliver(&agent, &wake, &mut reader, &attach_tx, uid).await;
                }
            }
            _ = tick.tick() => expire(&wake),
        }
    }
}

/// Reads what the port of `uid` heard (its tap's carrier, and with [`Deliver::FirstFrame`] the
/// frames on the tap): whether its held frames are to be delivered now.
fn port_says_deliver(wake: &Wake, uid: u32) -> bool {
    let mode = wake.settings.deliver;
    let mut st = wake.lock();
    let Some(p) = st.ports.get_mut(&uid) else {
        return false;
    };
    match p.port.carrier() {
        Ok(Some(true)) if !p.attached => {
            p.attached = true;
            if mode == Deliver::Attach {
                return true;
            }
            if let Err(e) = p.port.listen() {
                tracing::warn!(
                    user_id = uid,
                    "wake: listening for the guest failed, delivering now: {e}"
                );
                return true;
            }
        }
        Ok(Some(false)) => p.attached = false,
        Ok(_) => {}
        Err(e) => tracing::warn!(user_id = uid, "wake: reading the tap's state failed: {e}"),
    }
    if mode == Deliver::FirstFrame && p.attached {
        match p.port.guest_sent() {
            Ok(sent) => return sent,
            Err(e) => {
                tracing::warn!(
                    user_id = uid,
                    "wake: reading the tap's frames failed, delivering now: {e}"
                );
                return true;
            }
        }
    }
    false
}

fn expire(wake: &Wake) {
    let now = Instant::now();
    let l = wake.settings.limits;
    let mut st = wake.lock();
    let mut empty = Vec::new();
    for (uid, h) in &mut st.vms {
        if h.expire(now, l) > 0 && !h.holding() {
            empty.push(*uid);
        }
    }
    for uid in empty {
        if let Some(p) = st.ports.remove(&uid) {
            p.task.abort();
        }
    }
}

/// Reads the perf buffers and keeps what they held; wakes where due.
async fn take_frames(
    agent: &Arc<Agent>,
    wake: &Arc<Wake>,
    reader: &mut HeldReader,
    attach_tx: &mpsc::UnboundedSender<u32>,
) {
    let drained = reader.drain();
    let now = Instant::now();
    let l = wake.settings.limits;
    let mut wakes = Vec::new();
    let mut opens = Vec::new();
    {
        let mut st = wake.lock();
        st.lost += drained.lost;
        for f in drained.frames {
            let uid = f.uid;
            let has_port = st.ports.contains_key(&uid);
            let h = st.vms.entry(uid).or_default();
            if f.bytes.is_empty() {
                h.too_big();
                continue;
            }
            let wake_now = f.tcp && h.wake_due(now, wake.settings.interval);
            let flow_of = wake_now.then(|| f.bytes.clone());
            h.push(now, f.bytes, l);
            if let Some(head) = flow_of {
                wakes.push((uid, wake_body(&head, h.counters.held_now)));
            }
            if !has_port && !opens.contains(&uid) {
                opens.push(uid);
            }
        }
    }
    for (uid, body) in wakes {
        publish_wake(agent, wake, uid, body).await;
    }
    for uid in opens {
        open_port(wake, uid, attach_tx);
    }
}

async fn publish_wake(agent: &Arc<Agent>, wake: &Arc<Wake>, uid: u32, body: EventBody) {
    let id = wake.id_of(agent, uid).await;
    tracing::info!(vm = %id, user_id = uid, "wake: a packet for a sleeping VM");
    if let Some(sock) = wake.settings.hook.clone() {
        let json = serde_json::json!({
            "kind": "vm_wake",
            "vm": id,
            "user_id": uid,
            "at": crate::activity::rfc3339(std::time::SystemTime::now()),
            "event": body,
        });
        let wake = Arc::clone(wake);
        tokio::spawn(async move {
            let bytes = serde_json::to_vec(&json).unwrap_or_default();
            let failed = match tokio::time::timeout(HOOK_TIMEOUT, call_hook(&sock, bytes)).await {
                Ok(Ok(status)) if status.is_success() => None,
                Ok(Ok(status)) => Some(format!("answered {status}")),
                Ok(Err(e)) => Some(e),
                Err(_) => Some(format!("no answer within {HOOK_TIMEOUT:?}")),
            };
            if let Some(why) = failed {
                wake.lock().hook_failures += 1;
                tracing::warn!(hook = %sock.display(), user_id = uid, "wake hook failed: {why}");
            }
        });
    }
    agent.emit_vm(&id, uid, body);
}

/// Posts `body` (JSON) to [`HOOK_PATH`] over HTTP/1.1 on the unix socket `sock`; the answer's
/// status, or what failed.
async fn call_hook(sock: &std::path::Path, body: Vec<u8>) -> Result<hyper::StatusCode, String> {
    let stream = tokio::net::UnixStream::connect(sock)
        .await
        .map_err(|e| format!("cannot connect: {e}"))?;
    let (mut tx, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| format!("handshake: {e}"))?;
    let conn = tokio::spawn(async move {
        let _ = conn.await;
    });
    let req = hyper::Request::post(HOOK_PATH)
        .header("host", "vmnet-wake")
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(hyper::body::Bytes::from(body)))
        .map_err(|e| format!("request: {e}"))?;
    let r = tx
        .send_request(req)
        .await
        .map_err(|e| format!("request: {e}"));
    conn.abort();
    Ok(r?.status())
}

/// Opens the tap port of `uid` and forwards its notifications as `uid` on `attach_tx`.
fn open_port(wake: &Arc<Wake>, uid: u32, attach_tx: &mpsc::UnboundedSender<u32>) {
    let netns = name(&wake.prefix, NameKind::Netns, uid);
    let tap = name(&wake.prefix, NameKind::Tap, uid);
    let port = match TapPort::open(&netns, &tap) {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(user_id = uid, "wake: cannot watch the tap: {e}");
            return;
        }
    };
    let fds: Result<Vec<OwnedFd>, _> = [port.notifications(), port.frames()]
        .into_iter()
        .map(|fd| fd.try_clone_to_owned())
        .collect();
    let fds = match fds {
        Ok(fds) => fds,
        Err(e) => {
            tracing::warn!(user_id = uid, "wake: {e}");
            return;
        }
    };
    let tx = attach_tx.clone();
    let task = tokio::spawn(async move {
        let mut afds = Vec::new();
        for fd in fds {
            // SAFETY: the descriptor is owned by the AsyncFd from here on.
            match unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) } {
                Ok(a) => afds.push(a),
                Err(_) => return,
            }
        }
        // The answer to the port's first question may be there already.
        if tx.send(uid).is_err() {
            return;
        }
        loop {
            let (ready, _, _) =
                futures::future::select_all(afds.iter().map(|a| Box::pin(a.readable()))).await;
            let Ok(mut g) = ready else {
                return;
            };
            g.clear_ready();
            drop(g);
            if tx.send(uid).is_err() {
                return;
            }
        }
    });
    wake.lock().ports.insert(
        uid,
        Port {
            port,
            task: task.abort_handle(),
            attached: false,
        },
    );
}

/// The VMM of `uid` attached: sends what it held.
async fn deliver(
    agent: &Arc<Agent>,
    wake: &Arc<Wake>,
    reader: &mut HeldReader,
    attach_tx: &mpsc::UnboundedSender<u32>,
    uid: u32,
) {
    // Frames queued just before the queue came back.
    take_frames(agent, wake, reader, attach_tx).await;
    let (frames, first, port) = {
        let mut st = wake.lock();
        let port = st.ports.remove(&uid);
        let (frames, first) = st.vms.get_mut(&uid).map(VmHold::take).unwrap_or_default();
        (frames, first, port)
    };
    let Some(port) = port else { return };
    port.task.abort();
    let (mut sent, mut refused) = (0u64, 0u64);
    for mut f in frames {
        complete_checksum(&mut f);
        match port.port.send(&f) {
            Ok(()) => sent += 1,
            Err(e) => {
                refused += 1;
                tracing::debug!(user_id = uid, "wake: a held frame was refused: {e}");
            }
        }
    }
    if let Some(h) = wake.lock().vms.get_mut(&uid) {
        h.counters.delivered += sent;
        h.counters.dropped_send += refused;
    }
    let waited_ms = first.map_or(0, |t| {
        u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX)
    });
    let id = wake.id_of(agent, uid).await;
    tracing::info!(vm = %id, user_id = uid, delivered = sent, refused, waited_ms, "wake: the VMM attached; held frames delivered");
    agent.emit_vm(
        &id,
        uid,
        EventBody::HeldDelivered {
            delivered: sent,
            refused,
            waited_ms,
        },
    );
}
