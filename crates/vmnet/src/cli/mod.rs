//! Subcommands, one module per area (each owned by one area of the product).

pub mod config;
pub mod events;
mod guard;
mod io;
pub mod ipam;
pub mod logs;
pub mod mesh;
pub mod serve;
pub mod shell;
pub mod trust;
pub mod vm;
pub mod vm_text;
