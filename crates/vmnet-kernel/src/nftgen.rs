//! The nf_tables generation of a network namespace (`NFT_MSG_GETGEN`), read over netlink in
//! process: a cheap "has any table of this namespace changed?" test.
//!
//! # Design
//! The kernel counts every committed nf_tables transaction of a namespace (its base sequence,
//! which `NFT_MSG_GETGEN` answers as `NFTA_GEN_ID`): any rule, chain, set, element or table
//! change, by anyone, moves it. A table found equal to its plan at generation G is therefore
//! still equal while the namespace's generation is G, and reading the generation (one request,
//! no ruleset) replaces listing and comparing the whole table. The namespace is named by its
//! cookie (`SO_NETNS_COOKIE`, unique while the system runs), so a namespace deleted and made
//! again under the same name, whose count starts again, is never taken for the old one.
//!
//! Closing a netfilter socket makes the kernel wait for pending nf_tables releases (an RCU
//! grace period, 10–15 ms here, after any deletion on the host): sockets are closed on a
//! background thread ([`close_later`]), never on the caller's path.

use std::sync::OnceLock;
use std::sync::mpsc::{Sender, channel};

use netlink_packet_core::{NLM_F_ACK, NLM_F_REQUEST};
use netlink_packet_netfilter::nftables::{GenAttribute, GenMessage, NfTablesMessage};
use netlink_packet_netfilter::{NetfilterMessageInner, NetfilterProtoFamily};

use crate::nfnl::{NetfilterError, NfnlSocket};

/// One reading: the namespace (its cookie) and its nf_tables generation there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NftGeneration {
    /// `SO_NETNS_COOKIE` of the namespace.
    pub netns_cookie: u64,
    /// `NFTA_GEN_ID`: the count of committed nf_tables transactions in it.
    pub id: u32,
}

/// Reads the generation of the calling thread's network namespace (call from a thread inside
/// it, e.g. [`crate::netns::run_in`]).
///
/// # Errors
/// The socket failing, the kernel refusing the request, or an answer without a generation.
pub fn read_here() -> Result<NftGeneration, NetfilterError> {
    let mut sock = NfnlSocket::open()?;
    let cookie = netns_cookie(sock.raw_fd()).map_err(|source| NetfilterError::Io {
        op: "SO_NETNS_COOKIE",
        source,
    });
    let read = cookie.and_then(|netns_cookie| {
        let seq = sock.send(
            NetfilterProtoFamily::Unspec,
            NfTablesMessage::GetGen(GenMessage { attributes: vec![] }),
            NLM_F_REQUEST | NLM_F_ACK,
        )?;
        let mut id = None;
        sock.receive(seq, "get generation", |m| {
            if let NetfilterMessageInner::NfTables(NfTablesMessage::NewGen(g)) = m {
                id = g.attributes.iter().find_map(|a| match a {
                    GenAttribute::Id(id) => Some(*id),
                    _ => None,
                });
            }
        })?;
        id.map(|id| NftGeneration { netns_cookie, id })
            .ok_or_else(|| NetfilterError::Decode("generation answer without NFTA_GEN_ID".into()))
    });
    close_later(sock);
    read
}

fn netns_cookie(fd: i32) -> std::io::Result<u64> {
    let mut cookie: u64 = 0;
    let mut len = libc::socklen_t::try_from(std::mem::size_of::<u64>()).unwrap_or(8);
    // SAFETY: getsockopt(2) writes at most `len` bytes into `cookie`, which is that large.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_NETNS_COOKIE,
            std::ptr::from_mut(&mut cookie).cast(),
            &raw mut len,
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cookie)
}

/// Closes `sock` on the closer thread (started on first use); closes it here when that thread
/// cannot be started.
pub(crate) fn close_later(sock: NfnlSocket) {
    static CLOSER: OnceLock<Option<Sender<NfnlSocket>>> = OnceLock::new();
    let closer = CLOSER.get_or_init(|| {
        let (tx, rx) = channel::<NfnlSocket>();
        std::thread::Builder::new()
            .name("nfnl-closer".into())
            .spawn(move || {
                for s in rx {
                    drop(s);
                }
            })
            .ok()
            .map(|_| tx)
    });
    if let Some(tx) = closer {
        // A send fails only once the thread is gone; the socket then comes back and is closed
        // here.
        let _ = tx.send(sock);
    }
}
