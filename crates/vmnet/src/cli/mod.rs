//! Subcommands, one module per area.

pub mod bench;
pub mod ipam;
