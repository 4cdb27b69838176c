//! Pure planners and renderers: the desired kernel state for one host and the documents guests
//! and VMMs read. No I/O, no clock, no randomness: every function here is deterministic in its
//! inputs and unit-tested without root.

pub mod nftdiff;
pub mod ns;
pub mod pool;
