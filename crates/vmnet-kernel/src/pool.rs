//! Pool mode kernel drivers (spec: hosted-pool-networking.md, "The guest's network
//! configuration" and "bcd's nftables tables"):
//!
//! - [`libnft`]: nft JSON through libnftables with a context bound to a namespace.
//! - [`firewall`]: the three bcd tables: full replace, per-instance element changes, the drift
//!   audit.
//! - [`tap`]: persistent taps on the host bridge.
//! - [`seed_image`]: the `cidata` VFAT image of a NoCloud seed.

pub mod firewall;
pub mod host;
pub mod libnft;
pub mod seed_image;
pub mod tap;
