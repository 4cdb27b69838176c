//! Pool mode in the agent (spec: hosted-pool-networking.md, "bcd's nftables tables"):
//!
//! - [`helper`]: the root helper process (it applies only what
//!   [`vmnet_plan::pool::validate`] accepts) and the agent's client to it over a socketpair.
//! - [`audit`]: the 5-second drift audit of the three tables.
//! - [`runtime`]: all of it together as the agent runs it ([`runtime::PoolRuntime`]).

pub mod audit;
pub mod helper;
pub mod runtime;
