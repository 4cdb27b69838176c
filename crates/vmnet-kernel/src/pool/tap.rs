//! Persistent instance taps on the host bridge (spec: "The guest's network configuration").
//!
//! A tap `bc<10 hex>n<index>` is created persistent (TUNSETIFF + TUNSETPERSIST, owner
//! configurable) in the host namespace, put on the named bridge as a locked port with learning
//! off and a static FDB entry for the NIC's MAC, and brought up — all before the VMM starts. The
//! VMM opens the same name again; a guest reboot reopens the same tap. A tap that cannot be
//! attached is deleted again and the VM does not start. The taps are deleted when the VM stops
//! or is destroyed.
//!
//! # Design
//! The tap ioctls ([`crate::tap`]) run on a thread inside the target namespace
//! ([`crate::netns::run_in`]); links
//! are changed through an rtnetlink handle opened in that namespace. The locked port is a second
//! line against MAC spoofing that does not depend on nftables: a flushed ruleset leaves it in
//! place.
//!
//! # Limitations
//! Single-queue taps (the kernel refuses to reattach a multi-queue opener to a single-queue
//! tap); IFF_VNET_HDR is chosen by the VMM when it opens the tap.

use futures::TryStreamExt;
use netlink_packet_route::link::{InfoKind, LinkAttribute, LinkInfo, LinkMessage};
use netlink_packet_route::neighbour::{NeighbourFlags, NeighbourState};
use rtnetlink::{Handle, LinkBridgePort, LinkUnspec};
use vmnet_model::nic::{IfName, MacAddr};

use crate::tap::TapOwner;

/// Errors of tap handling; each names the tap.
#[derive(Debug, thiserror::Error)]
pub enum TapError {
    /// The namespace could not be entered.
    #[error("tap {tap}: namespace")]
    Netns {
        /// The tap.
        tap: String,
        /// Cause.
        #[source]
        source: crate::netns::NetnsError,
    },
    /// Creating the persistent tap failed.
    #[error("tap {tap}: create")]
    Create {
        /// The tap.
        tap: String,
        /// Cause.
        #[source]
        source: crate::tap::TapIoError,
    },
    /// The bridge does not exist.
    #[error("tap {tap}: bridge {bridge} does not exist")]
    NoBridge {
        /// The tap.
        tap: String,
        /// The bridge.
        bridge: String,
    },
    /// The network named as the bridge is another kind of link.
    #[error("tap {tap}: network {bridge} is not a bridge")]
    NotBridge {
        /// The tap.
        tap: String,
        /// The link.
        bridge: String,
    },
    /// A netlink request failed.
    #[error("tap {tap}: {op}")]
    Netlink {
        /// The tap.
        tap: String,
        /// What was attempted.
        op: &'static str,
        /// Cause.
        #[source]
        source: rtnetlink::Error,
    },
}

/// Whether [`Taps::ensure`] made the tap or found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TapAction {
    /// The tap was created.
    Created,
    /// The tap existed (a reboot or a restarted agent) and was (re)attached.
    Reused,
}

/// The taps of one host namespace.
#[derive(Debug, Clone)]
pub struct Taps {
    ns: String,
    handle: Handle,
}

fn nl(tap: &IfName, op: &'static str) -> impl FnOnce(rtnetlink::Error) -> TapError {
    let tap = tap.to_string();
    move |source| TapError::Netlink { tap, op, source }
}

fn is_enodev(e: &rtnetlink::Error) -> bool {
    matches!(e, rtnetlink::Error::NetlinkError(m) if m.raw_code() == -libc::ENODEV)
}

impl Taps {
    /// Taps in namespace `ns`, changed through `handle` (opened in `ns`, e.g.
    /// [`crate::netns::netlink_in`]).
    #[must_use]
    pub fn new(ns: &str, handle: Handle) -> Self {
        Self {
            ns: ns.to_owned(),
            handle,
        }
    }

    /// Taps in the calling process's own namespace (an agent that already lives in its host
    /// namespace), changed through `handle` (opened in that namespace).
    #[must_use]
    pub fn here(handle: Handle) -> Self {
        Self {
            ns: String::new(),
            handle,
        }
    }

    /// The link named `name`, if any.
    ///
    /// # Errors
    /// A netlink error other than "no such device".
    pub async fn link(&self, name: &IfName) -> Result<Option<LinkMessage>, TapError> {
        match self
            .handle
            .link()
            .get()
            .match_name(name.as_str())
            .execute()
            .try_next()
            .await
        {
            Ok(m) => Ok(m),
            Err(e) if is_enodev(&e) => Ok(None),
            Err(e) => Err(nl(name, "look up")(e)),
        }
    }

    /// The bridge index a link is attached to, if any.
    ///
    /// # Errors
    /// As [`Self::link`].
    pub async fn controller(&self, name: &IfName) -> Result<Option<u32>, TapError> {
        Ok(self.link(name).await?.and_then(|m| {
            m.attributes.iter().find_map(|a| match a {
                LinkAttribute::Controller(i) => Some(*i),
                _ => None,
            })
        }))
    }

    fn create_persistent(&self, tap: &IfName, owner: TapOwner) -> Result<(), TapError> {
        let name = tap.as_str();
        let make = || crate::tap::create_persistent(name, owner);
        // An empty namespace name is the calling thread's own namespace (see `Taps::here`).
        let made = if self.ns.is_empty() {
            Ok(make())
        } else {
            crate::netns::run_in(&self.ns, make)
        };
        made.map_err(|source| TapError::Netns {
            tap: tap.to_string(),
            source,
        })?
        .map_err(|source| TapError::Create {
            tap: tap.to_string(),
            source,
        })
    }

    /// Makes the tap exist, persistent, on `bridge` as a locked port (learning off, a static FDB
    /// entry for `mac`) and up. An existing tap is reused. A `bridge` that is missing or not a
    /// bridge fails before any tap is touched (moving an existing tap to a link that cannot take
    /// it would take it off its bridge). When attaching fails, a tap created here is deleted
    /// again.
    ///
    /// # Errors
    /// [`TapError::NoBridge`] when the bridge is missing, [`TapError::NotBridge`] when it is
    /// another kind of link; creation or netlink errors otherwise.
    pub async fn ensure(
        &self,
        tap: &IfName,
        bridge: &IfName,
        mac: MacAddr,
        owner: TapOwner,
    ) -> Result<TapAction, TapError> {
        let Some(br) = self.link(bridge).await? else {
            return Err(TapError::NoBridge {
                tap: tap.to_string(),
                bridge: bridge.to_string(),
            });
        };
        let is_bridge = br.attributes.iter().any(|a| {
            matches!(a, LinkAttribute::LinkInfo(infos)
                if infos.iter().any(|i| matches!(i, LinkInfo::Kind(InfoKind::Bridge))))
        });
        if !is_bridge {
            return Err(TapError::NotBridge {
                tap: tap.to_string(),
                bridge: bridge.to_string(),
            });
        }
        let action = if self.link(tap).await?.is_some() {
            TapAction::Reused
        } else {
            self.create_persistent(tap, owner)?;
            TapAction::Created
        };
        let attached = self.attach(tap, br.header.index, mac).await;
        if let Err(e) = attached {
            if action == TapAction::Created {
                let _ = self.delete(tap).await;
            }
            return Err(e);
        }
        Ok(action)
    }

    async fn attach(&self, tap: &IfName, bridge: u32, mac: MacAddr) -> Result<(), TapError> {
        let idx = self
            .link(tap)
            .await?
            .ok_or_else(|| TapError::NoBridge {
                tap: tap.to_string(),
                bridge: "(tap vanished)".into(),
            })?
            .header
            .index;
        let h = &self.handle;
        h.link()
            .change(LinkUnspec::new_with_index(idx).controller(bridge).build())
            .execute()
            .await
            .map_err(nl(tap, "attach to bridge"))?;
        h.link()
            .change(
                LinkBridgePort::new(idx)
                    .learning(false)
                    .locked(true)
                    .build(),
            )
            .execute()
            .await
            .map_err(nl(tap, "lock bridge port"))?;
        h.neighbours()
            .add_bridge(idx, &mac.octets())
            .state(NeighbourState::Noarp)
            .flags(NeighbourFlags::Controller)
            .replace()
            .execute()
            .await
            .map_err(nl(tap, "add static fdb entry"))?;
        h.link()
            .change(LinkUnspec::new_with_index(idx).up().build())
            .execute()
            .await
            .map_err(nl(tap, "set up"))?;
        Ok(())
    }

    /// Deletes the tap; `false` when it did not exist.
    ///
    /// # Errors
    /// A netlink error other than "no such device".
    pub async fn delete(&self, tap: &IfName) -> Result<bool, TapError> {
        let Some(m) = self.link(tap).await? else {
            return Ok(false);
        };
        match self.handle.link().del(m.header.index).execute().await {
            Ok(()) => Ok(true),
            Err(e) if is_enodev(&e) => Ok(false),
            Err(e) => Err(nl(tap, "delete")(e)),
        }
    }

    /// Names of all links whose name starts with `bc` (instance taps), for audits and cleanup.
    ///
    /// # Errors
    /// A netlink error.
    pub async fn list_taps(&self) -> Result<Vec<String>, TapError> {
        let mut out = Vec::new();
        let mut s = self.handle.link().get().execute();
        let any: IfName = "bc".parse().map_err(|_| TapError::NoBridge {
            tap: "bc".into(),
            bridge: String::new(),
        })?;
        while let Some(m) = s.try_next().await.map_err(nl(&any, "list links"))? {
            for a in &m.attributes {
                if let LinkAttribute::IfName(n) = a
                    && n.starts_with(vmnet_model::nic::TAP_PREFIX)
                {
                    out.push(n.clone());
                }
            }
        }
        Ok(out)
    }
}
