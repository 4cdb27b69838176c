//! Pool mode in the agent (spec: hosted-pool-networking.md, "bcd's nftables tables"):
//!
//! - [`helper`]: the root helper process (it applies only what
//!   [`vmnet_plan::pool::validate`] accepts) and the agent's client to it over a socketpair.
//! - [`audit`]: the 5-second drift audit of the three tables.
//! - [`runtime`]: all of it together as the agent runs it ([`runtime::PoolRuntime`]).
//! - [`desired`]: what the store wants on this host, as NIC specs (pure data).
//! - [`node`]: the instances the store places on this host, realised as NICs and seeds
//!   ([`node::PoolNode`]), converged on every reconcile pass and API change.
//! - [`taps`]: the link side (taps on the bridge, host addresses) behind a trait.
//! - [`seeds`]: the NoCloud seed files and `cidata` images under the state directory.

pub mod audit;
pub mod desired;
pub mod helper;
pub mod node;
pub mod runtime;
pub mod seeds;
pub mod taps;
