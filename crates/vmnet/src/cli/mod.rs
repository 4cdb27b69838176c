//! Subcommands, one module per area (each owned by one area of the product).

pub mod ipam;
pub mod mesh;
pub mod serve;
pub mod vm;
