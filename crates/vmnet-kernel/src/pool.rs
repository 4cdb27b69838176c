//! Pool mode kernel drivers (spec: hosted-pool-networking.md, "The guest's network
//! configuration" and "bcd's nftables tables"):
//!
//! - [`libnft`]: nft JSON through libnftables with a context bound to a namespace.
//! - [`firewall`]: the three bcd tables: full replace, per-instance element changes, the drift
//!   audit.
//! - [`tap`]: persistent taps on the host bridge.
//! - [`guard`]: the tap guard, BPF filters on each tap that hold when the nft tables are gone.
//! - [`seed_image`]: the `cidata` ISO image of a NoCloud seed.
//! - [`host`]: rules then taps on start, taps then rules on stop; a failed start undoes only
//!   what it made. The one orchestrator of an instance's steps, for the agent and the tests.

pub mod firewall;
pub mod guard;
pub mod host;
pub mod libnft;
pub mod seed_image;
pub mod tap;
