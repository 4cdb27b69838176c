//! The two notification sockets of one namespace, opened on a thread inside it.

use std::io;

use netlink_sys::Socket;
use netlink_sys::protocols::{NETLINK_NETFILTER, NETLINK_ROUTE};

use super::parse::{self, Note};
use crate::netns;
use crate::nftgen::NsId;

/// The rtnetlink groups: links, neighbours, tc, IPv4/IPv6 addresses, routes and rules.
const ROUTE_GROUPS: [u32; 9] = [
    1,  // RTNLGRP_LINK
    3,  // RTNLGRP_NEIGH
    4,  // RTNLGRP_TC
    5,  // RTNLGRP_IPV4_IFADDR
    7,  // RTNLGRP_IPV4_ROUTE
    8,  // RTNLGRP_IPV4_RULE
    9,  // RTNLGRP_IPV6_IFADDR
    11, // RTNLGRP_IPV6_ROUTE
    19, // RTNLGRP_IPV6_RULE
];

/// `NFNLGRP_NFTABLES`.
const NFT_GROUP: u32 = 7;

/// The receive buffer asked for (the kernel caps it at `net.core.rmem_max`); it is only
/// memory while notifications wait in it.
const RCVBUF: usize = 1 << 20;

/// Which protocol a socket speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Proto {
    Route,
    Nft,
}

impl Proto {
    pub(super) fn notes(self, buf: &[u8]) -> Vec<Note> {
        match self {
            Self::Route => parse::route_notes(buf),
            Self::Nft => parse::nft_notes(buf),
        }
    }
}

/// Opens a non-blocking socket of `proto` in the calling thread's namespace, subscribed to
/// its groups.
fn open_here(proto: Proto) -> io::Result<Socket> {
    let (protocol, groups): (isize, &[u32]) = match proto {
        Proto::Route => (NETLINK_ROUTE, &ROUTE_GROUPS),
        Proto::Nft => (NETLINK_NETFILTER, &[NFT_GROUP]),
    };
    let mut s = Socket::new(protocol)?;
    s.bind_auto()?;
    s.set_non_blocking(true)?;
    let _ = s.set_rx_buf_sz(RCVBUF);
    for g in groups {
        s.add_membership(*g)?;
    }
    // Two per VM namespace: kept above the descriptors libnftables needs.
    Ok(crate::keptfd::move_above(s))
}

/// The route and nf_tables sockets of one namespace and which namespace that is.
pub struct Pair {
    pub(super) id: NsId,
    pub(super) route: Socket,
    pub(super) nft: Socket,
}

impl std::fmt::Debug for Pair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pair")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl Pair {
    /// Opens the pair in the calling thread's namespace (a thread that entered or made the
    /// namespace to watch, e.g. a create's).
    ///
    /// # Errors
    /// A socket cannot be opened or subscribed.
    pub fn open_here() -> io::Result<Self> {
        Ok(Self {
            id: NsId::here()?,
            route: open_here(Proto::Route)?,
            nft: open_here(Proto::Nft)?,
        })
    }
}

/// The pair of a namespace: the named one (`Some`), checked to be the namespace the path names
/// when they were opened, or the calling process's own (`None`).
pub(super) fn open_pair(netns: Option<&str>) -> io::Result<Pair> {
    match netns {
        None => Pair::open_here(),
        Some(name) => {
            let want = NsId::of_path(&netns::path(name))?;
            let pair = netns::run_in(name, Pair::open_here).map_err(io::Error::other)??;
            if pair.id != want {
                return Err(io::Error::other(format!(
                    "netns {name}: the sockets were opened in another namespace"
                )));
            }
            Ok(pair)
        }
    }
}
