//! WireGuard without a kernel module: `wireguard-go` as the device ([`daemon`]), configured over
//! its UAPI socket ([`uapi`]), its UDP sockets' buffers sized by the agent ([`sockbuf`]), and the link, address and /128 routes of the mesh's interface
//! over netlink ([`link`]), all in the calling process's network namespace.

pub mod daemon;
pub mod link;
pub mod sockbuf;
pub mod uapi;

/// What can go wrong with the WireGuard interface.
#[derive(Debug, thiserror::Error)]
pub enum WgError {
    /// A socket, file or process operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was attempted.
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The UAPI answered something unexpected or refused a request.
    #[error("wireguard uapi: {0}")]
    Protocol(String),
    /// A netlink request failed.
    #[error("{what}: {source}")]
    Netlink {
        /// What was attempted.
        what: String,
        /// The cause.
        #[source]
        source: rtnetlink::Error,
    },
    /// The device did not come up.
    #[error("{0}")]
    Device(String),
}
