//! The driver's long-lived nf_tables sockets in the host namespace: one libnftables context
//! (element transactions of the public maps) and one [`ElementReader`] (keyed element lookups),
//! opened on first use and kept.
//!
//! # Why they are kept
//! Closing a netfilter netlink socket makes the kernel finish every pending nf_tables release
//! first, which waits for an RCU grace period whenever anything was deleted shortly before
//! (10–15 ms here): with a socket per call, every VM's public-mapping change paid it once or
//! twice. A socket is bound to the namespace it was opened in, so once opened these are used
//! from any thread without entering the host namespace again.

use std::sync::Mutex;

use super::NsError;
use super::host::HostNs;
use super::inns::NftSession;
use crate::nftelem::ElementReader;

/// The host namespace's kept sockets (see the module docs).
pub(super) struct HostNft {
    ns: HostNs,
    open: Mutex<Option<Sockets>>,
}

struct Sockets {
    nft: NftSession,
    elements: ElementReader,
}

impl HostNft {
    /// Sockets for `ns`, opened on first use.
    pub(super) fn new(ns: HostNs) -> Self {
        Self {
            ns,
            open: Mutex::new(None),
        }
    }

    /// Runs `f` with the libnftables session and the element reader of the host namespace,
    /// opening them first when needed (on a thread inside the namespace). After a failure
    /// they are closed, so the next call starts on fresh sockets.
    ///
    /// # Errors
    /// When the sockets cannot be opened, or `f`'s error.
    pub(super) fn with<T>(
        &self,
        f: impl FnOnce(&NftSession, &mut ElementReader) -> Result<T, NsError>,
    ) -> Result<T, NsError> {
        let mut open = self
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if open.is_none() {
            let label = self.ns.label().to_owned();
            *open = Some(self.ns.run(|| -> Result<Sockets, NsError> {
                Ok(Sockets {
                    nft: NftSession::here(&label)?,
                    elements: ElementReader::open().map_err(|e| NsError::Nft {
                        netns: label.clone(),
                        message: e.to_string(),
                    })?,
                })
            })??);
        }
        let s = open.as_mut().expect("opened above");
        let res = f(&s.nft, &mut s.elements);
        if res.is_err() {
            *open = None;
        }
        res
    }
}
