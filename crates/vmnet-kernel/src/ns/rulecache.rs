//! The host's IPv6 rules that have an input interface (one per VM with a host table,
//! `iif <host veth> lookup <table>`), kept in memory from one dump and the kernel's rule
//! notifications, so a VM's observe reads its rules without dumping every VM's.
//!
//! # Why
//! The kernel cannot filter a rule dump (`fib_nl_dumprule` takes no selector) and has no
//! request for one rule, so reading one VM's rule meant reading all of them: at 1,000 VMs,
//! thousands of rules per apply (an apply observes twice), the largest cost that grew with
//! the number of VMs.
//!
//! # Design
//! - The cache has its own rtnetlink socket in the host namespace, subscribed to
//!   `RTNLGRP_IPV6_RULE`: the kernel sends every rule added or deleted there, by vmnet or by
//!   anyone else, to it.
//! - Before each read, a round trip on that socket (a `link get` of `lo`): notifications and
//!   replies share the socket's receive queue in order, so once the reply is in, every
//!   notification of a change made before the read began has been queued. They are applied
//!   in order, and the read returns what the kernel holds at that moment: drift made by hand
//!   (a rule deleted with `ip rule del`) is seen by the next observe, as with a dump.
//! - The first read, and any read after the socket failed (a receive-buffer overrun closes the
//!   connection: notifications were lost), dumps the rules again. Notifications already queued
//!   when the dump ends are applied on top of it: each rule ends in the state of its last
//!   notification, which is the kernel's.
//! - A rule is a set member: two identical rules added by hand count once.

use std::collections::BTreeSet;

use futures::TryStreamExt;
use futures::channel::mpsc::UnboundedReceiver;
use netlink_packet_core::{NetlinkMessage, NetlinkPayload};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::SocketAddr;
use rtnetlink::{Handle, MulticastGroup};

use super::NsError;
use super::host::HostNs;
use super::rules::{self, KRule};
use crate::netns;

type Events = UnboundedReceiver<(NetlinkMessage<RouteNetlinkMessage>, SocketAddr)>;

/// The cache's socket: its request handle and the notifications it receives.
struct Conn {
    handle: Handle,
    events: Events,
}

#[derive(Default)]
struct State {
    conn: Option<Conn>,
    rules: BTreeSet<KRule>,
}

/// The host's IPv6 rules with an input interface (see the module docs). Reads are serialized.
pub(super) struct RuleCache {
    host_ns: HostNs,
    state: tokio::sync::Mutex<State>,
}

impl RuleCache {
    /// A cache of the rules of `host_ns`; it opens its socket at the first read.
    pub(super) fn new(host_ns: HostNs) -> Self {
        Self {
            host_ns,
            state: tokio::sync::Mutex::new(State::default()),
        }
    }

    /// The rules the kernel holds now whose input interface is `iif`.
    ///
    /// # Errors
    /// [`NsError::Netlink`] when the socket cannot be opened or the dump fails.
    pub(super) async fn of(&self, iif: &str) -> Result<Vec<KRule>, NsError> {
        let st = self.current().await?;
        Ok(st.rules.iter().filter(|r| r.iif == iif).cloned().collect())
    }

    /// Every rule with an input interface the kernel holds now.
    ///
    /// # Errors
    /// As [`Self::of`].
    pub(super) async fn all(&self) -> Result<Vec<KRule>, NsError> {
        Ok(self.current().await?.rules.iter().cloned().collect())
    }

    async fn current(&self) -> Result<tokio::sync::MutexGuard<'_, State>, NsError> {
        let mut guard = self.state.lock().await;
        let st = &mut *guard;
        if let Some(c) = st.conn.as_mut() {
            if round_trip(&c.handle).await.is_ok() && apply_queued(&mut c.events, &mut st.rules) {
                return Ok(guard);
            }
            tracing::info!(
                "{}: rule notifications were lost; reading the rules again",
                self.host_ns.label()
            );
            st.conn = None;
        }
        let mut c = self.open()?;
        st.rules = rules::dump_rules(&c.handle).await?.into_iter().collect();
        apply_queued(&mut c.events, &mut st.rules);
        st.conn = Some(c);
        Ok(guard)
    }

    fn open(&self) -> Result<Conn, NsError> {
        let rt = tokio::runtime::Handle::current();
        let opened = self.host_ns.run(|| {
            let _guard = rt.enter();
            rtnetlink::new_multicast_connection(&[MulticastGroup::Ipv6Rule]).map(
                |(conn, handle, events)| {
                    rt.spawn(conn);
                    Conn { handle, events }
                },
            )
        })?;
        opened.map_err(|source| {
            NsError::Netns(netns::NetnsError::Io {
                name: self.host_ns.label().to_owned(),
                op: "open rtnetlink socket for rule notifications",
                source,
            })
        })
    }
}

/// One request and its reply on a notification cache's socket (`lo` always exists in a
/// namespace): once the reply is in, every notification of a change made before it is queued.
pub(super) async fn round_trip(h: &Handle) -> Result<(), rtnetlink::Error> {
    h.link().get().match_index(1).execute().try_next().await?;
    Ok(())
}

/// Applies the queued notifications to `rules`, in order; `false` when the connection has
/// closed (notifications may be missing).
fn apply_queued(events: &mut Events, rules: &mut BTreeSet<KRule>) -> bool {
    loop {
        match events.try_recv() {
            Ok((msg, _)) => match msg.payload {
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewRule(m)) => {
                    if let Some(r) = rules::krule(&m) {
                        rules.insert(r);
                    }
                }
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelRule(m)) => {
                    if let Some(r) = rules::krule(&m) {
                        rules.remove(&r);
                    }
                }
                _ => {}
            },
            Err(futures::channel::mpsc::TryRecvError::Empty) => return true,
            Err(_) => return false,
        }
    }
}
