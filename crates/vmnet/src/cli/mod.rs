//! Subcommands, one module per area (each owned by one area of the product).

mod guard;
pub mod ipam;
pub mod mesh;
pub mod serve;
pub mod trust;
pub mod vm;
pub mod vm_text;
