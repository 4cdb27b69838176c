//! The kernel's change notifications in every namespace vmnet manages, as a stream of
//! "namespace X changed (kind)" events for the agent's repair of drift.
//!
//! # Design
//! - Per watched namespace (the host's, and each VM's netns) two sockets: a `NETLINK_ROUTE`
//!   socket in the groups of links, IPv4/IPv6 addresses, routes and rules, neighbours and tc
//!   (qdiscs, classes, filters: BPF attachments are filters), and a `NETLINK_NETFILTER` socket in
//!   `NFNLGRP_NFTABLES` (tables, chains, rules, sets, elements). A netlink socket belongs to the
//!   namespace of the thread that opens it: a new VM's pair is opened by the create's own thread
//!   inside the new netns ([`Pair::open_here`], no thread of its own), an existing VM's on a
//!   short-lived thread inside its netns ([`crate::netns::run_in`]); either way the namespace
//!   is checked to be the one the path names (by device and inode) before the sockets are kept.
//!   One socket pair per namespace rather than one socket listening to all namespaces
//!   (`NETLINK_LISTEN_ALL_NSID`): that one needs a namespace id assigned in the host for every
//!   VM netns and hands out events by id; per-namespace sockets name their namespace
//!   themselves and cost two file descriptors per VM, no thread. Neither is free in the kernel:
//!   it hands every notification, in any namespace, to each socket in the protocol's groups in
//!   turn (at 1,000 VMs with every feature on, 9 % of the agent's CPU while VMs were created
//!   went to `netlink_broadcast_filtered`), and a socket listening to all namespaces costs a
//!   look-up of the sender's id per notification that walks every id of the host (`peernet2id`,
//!   twice per notification: 13 % in the same bench, `vmnet-lab bench agent --count 1000
//!   --all-features` under `perf`). Both grow with the VMs; the pair per namespace less so.
//! - Every socket is registered with one `epoll` instance of the watcher (level-triggered);
//!   that instance is the one descriptor registered with tokio, read by one task. A ready
//!   socket is read until it is empty; only the netlink header and the attributes that
//!   attribute a change are parsed ([`parse`]): the events say which namespace, what kind of
//!   object, and the interface, routing table or nf_tables table it belongs to. They carry
//!   when they were read, so the caller can time its repair from the change.
//! - Proxy ARP/NDP entries have no notifications: the watcher reads them periodically and
//!   reports one gone as a changed proxy entry ([`Watcher::poll_proxies`], [`proxypoll`]).
//! - A receive-buffer overrun (`ENOBUFS`) means notifications of that namespace were lost:
//!   it becomes an [`What::Lost`] event (the caller checks the whole namespace).
//! - The caller's own changes: while the caller changes namespaces it holds a [`Quiet`] naming
//!   them ([`Watcher::quiet`]; the host is `None`); what is read from their sockets meanwhile is
//!   discarded, and dropping the `Quiet` reads what is still queued and discards theirs too.
//!   Netlink notifications are queued before the request that caused them is answered, so when
//!   the caller's change returns, everything it caused is on the sockets already: none of it
//!   reaches the caller as a change. What the kernel does later on its own (a carrier coming
//!   on in its link-watch work) does, and costs one check that finds nothing. The quiet
//!   namespaces are counted by name, not by socket: a VM netns named before it exists (a
//!   create quiets it before making it) is quiet from the moment its sockets are adopted, and
//!   a holder that finds out what else it changes adds it ([`Quiet::also`]). The notifications
//!   of every other namespace are read and sent while a `Quiet` is held: a foreign change in
//!   another VM's netns reaches the caller at once. A foreign change in a quiet namespace is
//!   discarded with the caller's own: notifications carry nothing that tells them apart (link
//!   changes carry port id 0, `nft` changes the port of whoever made them). The host is the
//!   namespace this costs most: every VM change touches it (host veth end, routes, rules, proxy
//!   entries, host nft), so a foreign host change made during any VM change is lost; the
//!   periodic pass, which stays, repairs it. [`Watcher::quiet_all`] quiets every namespace,
//!   for a caller that cannot name what it changes.
//! - A VM's sockets are closed when it is removed ([`Watcher::unwatch`]), before its netns is
//!   deleted: a socket holds its namespace, and a kept one would keep a deleted netns (and the
//!   veth pair in it) alive. [`Watcher::watch`] of a path that names another namespace now
//!   (deleted and made again) replaces the sockets.

mod parse;
mod proxypoll;
mod quiet;
mod sock;

use std::collections::{HashMap, HashSet};
use std::io;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use netlink_sys::Socket;
use rustix::event::epoll;
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;

pub use parse::{Kind, Note};
pub use quiet::Quiet;
pub use sock::Pair;
use sock::Proto;

use crate::nftgen::NsId;

/// What happened in a namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum What {
    /// An object changed (added, changed or deleted).
    Changed(Note),
    /// Notifications were lost (the receive buffer overran): check everything there.
    Lost,
}

/// One event.
#[derive(Debug, Clone)]
pub struct Event {
    /// The namespace: a VM netns by name, `None` for the host.
    pub netns: Option<String>,
    /// What happened.
    pub what: What,
    /// When the watcher read it.
    pub at: Instant,
}

struct Entry {
    netns: Option<String>,
    proto: Proto,
    sock: Socket,
}

struct Space {
    id: NsId,
    keys: [u64; 2],
}

#[derive(Default)]
struct State {
    socks: HashMap<u64, Entry>,
    spaces: HashMap<Option<String>, Space>,
    next: u64,
    /// The namespaces quiet now ([`Quiet`]).
    quieted: quiet::Quieted,
}

struct Inner {
    epoll: AsyncFd<OwnedFd>,
    state: Mutex<State>,
    tx: mpsc::UnboundedSender<Event>,
    task: Mutex<Option<tokio::task::AbortHandle>>,
    /// The proxy entries' reads ([`Watcher::poll_proxies`]).
    polls: Mutex<Vec<tokio::task::AbortHandle>>,
}

/// The watcher (see the module docs). Cloning shares it.
#[derive(Clone)]
pub struct Watcher(Arc<Inner>);

impl std::fmt::Debug for Watcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watcher").finish_non_exhaustive()
    }
}

/// How often the host's proxy entries are read in proxy mode ([`Watcher::poll_proxies`]): one
/// dump each time.
pub const PROXY_POLL: std::time::Duration = std::time::Duration::from_millis(250);

/// The largest datagram read at once: notifications are far smaller.
const BUF: usize = 64 * 1024;

impl Watcher {
    /// Starts watching the host namespace (`host`: a named one, or the calling process's own
    /// when `None`) and returns the watcher and its events. The reading task runs on the
    /// current tokio runtime until [`Self::stop`].
    ///
    /// # Errors
    /// The epoll instance, the registration or the host's sockets failing.
    pub fn start(host: Option<&str>) -> io::Result<(Self, mpsc::UnboundedReceiver<Event>)> {
        let ep = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        let (tx, rx) = mpsc::unbounded_channel();
        // SAFETY: `ep` is an open epoll descriptor owned by the `AsyncFd` from here on: it stays
        // open, and names the same instance, until the `AsyncFd` drops.
        let epoll = unsafe { AsyncFd::register_with_interest(ep, tokio::io::Interest::READABLE) }
            .map_err(io::Error::from)?;
        let inner = Arc::new(Inner {
            epoll,
            state: Mutex::new(State::default()),
            tx,
            task: Mutex::new(None),
            polls: Mutex::new(Vec::new()),
        });
        let w = Self(inner);
        w.add(None, host)?;
        let task = tokio::spawn(read_loop(w.clone()));
        if let Ok(mut t) = w.0.task.lock() {
            *t = Some(task.abort_handle());
        }
        Ok((w, rx))
    }

    /// Stops the reading task; the sockets close when the last clone of the watcher drops.
    pub fn stop(&self) {
        if let Some(t) = self.0.task.lock().ok().and_then(|mut t| t.take()) {
            t.abort();
        }
        if let Ok(mut p) = self.0.polls.lock() {
            for t in p.drain(..) {
                t.abort();
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.0
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Opens the sockets of `key` (`None`: the host) in namespace `path_name` and registers
    /// them, replacing any kept for `key`.
    fn add(&self, key: Option<String>, path_name: Option<&str>) -> io::Result<()> {
        let pair = sock::open_pair(path_name)?;
        self.insert(key, pair)
    }

    /// Watches the VM netns `netns` with `pair`, opened inside it by the caller (a create's
    /// thread in the new netns): checked to be the namespace the path names now.
    ///
    /// # Errors
    /// The path names another namespace, or the registration fails.
    pub fn adopt(&self, netns: &str, pair: Pair) -> io::Result<()> {
        if NsId::of_path(&crate::netns::path(netns))? != pair.id {
            return Err(io::Error::other(format!(
                "netns {netns}: the sockets were opened in another namespace"
            )));
        }
        self.insert(Some(netns.to_owned()), pair)
    }

    fn insert(&self, key: Option<String>, pair: Pair) -> io::Result<()> {
        let Pair { id, route, nft } = pair;
        let mut st = self.lock();
        let stale = st.spaces.remove(&key);
        let mut closed = Vec::new();
        if let Some(s) = stale {
            for k in s.keys {
                if let Some(e) = st.socks.remove(&k) {
                    let _ = epoll::delete(self.0.epoll.get_ref(), &e.sock);
                    closed.push(e);
                }
            }
        }
        let mut keys = [0; 2];
        for (i, (proto, s)) in [(Proto::Route, route), (Proto::Nft, nft)]
            .into_iter()
            .enumerate()
        {
            st.next += 1;
            let k = st.next;
            epoll::add(
                self.0.epoll.get_ref(),
                &s,
                epoll::EventData::new_u64(k),
                epoll::EventFlags::IN,
            )?;
            st.socks.insert(
                k,
                Entry {
                    netns: key.clone(),
                    proto,
                    sock: s,
                },
            );
            keys[i] = k;
        }
        st.spaces.insert(key, Space { id, keys });
        drop(st);
        drop(closed);
        Ok(())
    }

    /// Watches the VM netns `netns` (idempotent: a netns watched already is only checked to
    /// be the namespace its path names now).
    ///
    /// # Errors
    /// The netns cannot be entered or the sockets opened.
    pub fn watch(&self, netns: &str) -> io::Result<()> {
        let now = NsId::of_path(&crate::netns::path(netns))?;
        let key = Some(netns.to_owned());
        if self.lock().spaces.get(&key).is_some_and(|s| s.id == now) {
            return Ok(());
        }
        self.add(key, Some(netns))
    }

    /// Stops watching `netns` and closes its sockets (before it is deleted: see the module
    /// docs). Unknown names are ignored.
    pub fn unwatch(&self, netns: &str) {
        let mut st = self.lock();
        let Some(s) = st.spaces.remove(&Some(netns.to_owned())) else {
            return;
        };
        let closed: Vec<Entry> = s.keys.iter().filter_map(|k| st.socks.remove(k)).collect();
        for e in &closed {
            let _ = epoll::delete(self.0.epoll.get_ref(), &e.sock);
        }
        drop(st);
        drop(closed);
    }

    /// The VM netns watched now.
    #[must_use]
    pub fn watched(&self) -> Vec<String> {
        self.lock().spaces.keys().flatten().cloned().collect()
    }

    /// Reads every ready socket until empty; sends the events of the namespaces not quiet.
    /// Returns whether any socket was ready.
    fn drain(&self, st: &mut State) -> bool {
        let mut evs = Vec::with_capacity(64);
        let zero = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        let keys: Vec<u64> = match epoll::wait(
            self.0.epoll.get_ref(),
            rustix::buffer::spare_capacity(&mut evs),
            Some(&zero),
        ) {
            Ok(_) => evs.iter().map(|e| e.data.u64()).collect(),
            Err(_) => Vec::new(),
        };
        let mut buf = vec![0u8; BUF];
        let mut out: Vec<Event> = Vec::new();
        let mut seen: HashSet<(Option<String>, Note)> = HashSet::new();
        let any = !keys.is_empty();
        let mut failed = Vec::new();
        for k in keys {
            let Some(e) = st.socks.get(&k) else { continue };
            let quiet = st.quieted.is_quiet(&e.netns);
            loop {
                let mut b: &mut [u8] = &mut buf[..];
                match e.sock.recv(&mut b, libc::MSG_DONTWAIT) {
                    Ok(n) => {
                        if quiet {
                            continue;
                        }
                        let at = Instant::now();
                        for note in e.proto.notes(&buf[..n.min(BUF)]) {
                            if note.kind.is_some() && seen.insert((e.netns.clone(), note.clone())) {
                                out.push(Event {
                                    netns: e.netns.clone(),
                                    what: What::Changed(note),
                                    at,
                                });
                            }
                        }
                    }
                    Err(err) if err.kind() == io::ErrorKind::WouldBlock => break,
                    Err(err) if err.raw_os_error() == Some(libc::ENOBUFS) => out.push(Event {
                        netns: e.netns.clone(),
                        what: What::Lost,
                        at: Instant::now(),
                    }),
                    Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                    Err(err) => {
                        // Not read again (the periodic pass covers the namespace); a later
                        // `watch` opens it anew.
                        tracing::warn!(netns = ?e.netns, error = %err, "notification socket failed; no longer read");
                        failed.push(k);
                        out.push(Event {
                            netns: e.netns.clone(),
                            what: What::Lost,
                            at: Instant::now(),
                        });
                        break;
                    }
                }
            }
        }
        let mut closed = Vec::new();
        for k in failed {
            let Some(ns) = st.socks.get(&k).map(|e| e.netns.clone()) else {
                continue;
            };
            if let Some(space) = st.spaces.remove(&ns) {
                for k in space.keys {
                    if let Some(e) = st.socks.remove(&k) {
                        let _ = epoll::delete(self.0.epoll.get_ref(), &e.sock);
                        closed.push(e);
                    }
                }
            }
        }
        drop(closed);
        for ev in out {
            let _ = self.0.tx.send(ev);
        }
        any
    }
}

/// The reading task: reads the ready sockets whenever the epoll instance is readable, until
/// [`Watcher::stop`].
async fn read_loop(w: Watcher) {
    loop {
        let Ok(mut guard) = w.0.epoll.readable().await else {
            return;
        };
        let any = {
            let mut st = w.lock();
            w.drain(&mut st)
        };
        if !any {
            guard.clear_ready();
        }
    }
}
