//! `vmnet pool range …`: a pool's ranges after the first (IPv4 and IPv6).

use clap::Subcommand;

/// `vmnet pool range …`
#[derive(Debug, Clone, Subcommand)]
pub enum RangeCmd {
    /// Append a range to the pool's list: IPv4 (after the first range, which the pool must
    /// have) or IPv6 (prefix /48 to /128; the gateway may be link-local, e.g. fe80::1). A range
    /// overlapping any pool's range of its family is refused (CONFLICT).
    Add {
        /// The pool id (created for an IPv6 range if needed).
        pool: String,
        /// The network, e.g. 2001:db8:0:1::/64 or 10.0.1.0/24.
        #[arg(long)]
        cidr: String,
        /// The gateway; never leased.
        #[arg(long)]
        gateway: String,
        /// The first address to lease (IPv6 default: the address after the gateway when it
        /// lies in the range, else the lowest usable address).
        #[arg(long)]
        first_host: Option<String>,
        /// The last address to lease (IPv6 default: the highest address below the 128 reserved
        /// subnet anycast addresses of RFC 2526).
        #[arg(long)]
        last_host: Option<String>,
    },
    /// Remove a range the pool added (not the first IPv4 range). A range holding leases stays
    /// (CONFLICT) until their instances are deleted.
    Remove {
        /// The pool id.
        pool: String,
        /// The range's network as listed, e.g. 2001:db8:0:1::/64.
        cidr: String,
    },
    /// List a pool's ranges in order: the first IPv4 range, then the added ones.
    List {
        /// The pool id.
        pool: String,
    },
}
