//! The nf_tables generation of a network namespace (`NFT_MSG_GETGEN`), read over a netfilter
//! socket opened there once and kept: a cheap "has any nf_tables object of this namespace
//! changed?" test.
//!
//! # Design
//! - The kernel counts every committed nf_tables transaction of a namespace (its base
//!   sequence, which `NFT_MSG_GETGEN` answers as `NFTA_GEN_ID`): any table, chain, rule, set or
//!   element change there, by anyone, moves it by one. A table found equal to its plan at
//!   generation G is therefore still equal while the namespace's generation is G.
//! - A [`GenSocket`] is opened on a thread inside the namespace and stays bound to it; it is
//!   read from any thread afterwards, without entering the namespace again. It records the
//!   namespace's identity ([`NsId`], the nsfs inode), so a caller can tell that the name now
//!   mounts another namespace (deleted and made again) and never takes the old count for the
//!   new one's.
//! - The socket holds a reference to its namespace: while it is open, a deleted namespace (and
//!   the devices in it, e.g. a veth whose other end is on the host) is not destroyed. Close it
//!   (drop it) when the namespace is deleted. Closing a netfilter socket that sent requests
//!   runs the kernel's `NETLINK_URELEASE` handling, which first waits for pending nf_tables
//!   releases (an RCU grace period when a commit released objects shortly before): drop it
//!   where that wait is acceptable, never while holding a lock others wait on.
//!
//! - The socket's descriptor is moved to 1024 or above where the open-files limit allows
//!   (`crate::keptfd`).
//!
//! # Limitations
//! The generation says *whether* something changed, not what: any commit in the namespace
//! (another table's too) counts as a change.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use netlink_packet_core::{NLM_F_ACK, NLM_F_REQUEST};
use netlink_packet_netfilter::nftables::{GenAttribute, GenMessage, NfTablesMessage};
use netlink_packet_netfilter::{NetfilterMessageInner, NetfilterProtoFamily};

use crate::nfnl::{NetfilterError, NfnlSocket};

/// The identity of a network namespace while it lives: its nsfs device and inode number (as
/// `stat` gives them for `/run/netns/<name>` or `/proc/thread-self/ns/net`). The kernel does
/// not reuse an inode number while the namespace holding it exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NsId {
    /// `st_dev` (the nsfs instance).
    pub dev: u64,
    /// `st_ino` (the namespace's inode number).
    pub ino: u64,
}

impl NsId {
    /// The namespace mounted (or linked) at `path`.
    ///
    /// # Errors
    /// The `stat` failing (e.g. no such file).
    pub fn of_path(path: &Path) -> std::io::Result<Self> {
        let m = std::fs::metadata(path)?;
        Ok(Self {
            dev: m.dev(),
            ino: m.ino(),
        })
    }

    /// The calling thread's network namespace.
    ///
    /// # Errors
    /// The `stat` of `/proc/thread-self/ns/net` failing.
    pub fn here() -> std::io::Result<Self> {
        Self::of_path(Path::new("/proc/thread-self/ns/net"))
    }
}

/// The largest answer a generation read gets: one `NFT_MSG_NEWGEN` (id, pid, process name)
/// and the acknowledgement, each under 100 bytes; a page is room to spare.
const ANSWER_BUFFER: usize = 4096;

/// A netfilter socket kept in one namespace for generation reads (see the module docs).
pub struct GenSocket {
    sock: NfnlSocket,
    netns: NsId,
    cookie: Option<u64>,
}

impl std::fmt::Debug for GenSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GenSocket")
            .field("netns", &self.netns)
            .finish_non_exhaustive()
    }
}

impl GenSocket {
    /// Opens one in the calling thread's network namespace (call it on a thread inside the
    /// namespace, e.g. in [`crate::netns::run_in`]).
    ///
    /// # Errors
    /// The socket failing to open or bind, or the namespace's identity unreadable.
    pub fn open_here() -> Result<Self, NetfilterError> {
        let netns = NsId::here().map_err(|source| NetfilterError::Io {
            op: "stat the thread's netns",
            source,
        })?;
        let sock = NfnlSocket::open_with_buffer(ANSWER_BUFFER)?.kept();
        let cookie = sock.netns_cookie().ok();
        Ok(Self {
            sock,
            netns,
            cookie,
        })
    }

    /// The namespace the socket is bound to.
    #[must_use]
    pub fn netns(&self) -> NsId {
        self.netns
    }

    /// The namespace's cookie, unique since the host's boot (`None` when the kernel did not
    /// give it): what tells it apart from a later namespace of the same name and inode number
    /// after this process ended.
    #[must_use]
    pub fn cookie(&self) -> Option<u64> {
        self.cookie
    }

    /// The socket, for a transaction in its namespace (e.g. an element batch).
    pub(crate) fn nfnl(&mut self) -> &mut NfnlSocket {
        &mut self.sock
    }

    /// The namespace's nf_tables generation now: the count of its committed transactions.
    ///
    /// # Errors
    /// The socket failing, the kernel refusing the request, or an answer without a generation.
    pub fn read(&mut self) -> Result<u32, NetfilterError> {
        let seq = self.sock.send(
            NetfilterProtoFamily::Unspec,
            NfTablesMessage::GetGen(GenMessage { attributes: vec![] }),
            NLM_F_REQUEST | NLM_F_ACK,
        )?;
        let mut id = None;
        self.sock.receive(seq, "get generation", |m| {
            if let NetfilterMessageInner::NfTables(NfTablesMessage::NewGen(g)) = m {
                id = g.attributes.iter().find_map(|a| match a {
                    GenAttribute::Id(id) => Some(*id),
                    _ => None,
                });
            }
        })?;
        id.ok_or_else(|| NetfilterError::Decode("generation answer without NFTA_GEN_ID".into()))
    }
}
