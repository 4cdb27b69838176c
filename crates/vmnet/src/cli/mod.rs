//! Subcommands, one module per area (each owned by one area of the product).

pub mod bench;
pub mod bench_agent;
pub mod bench_ipam;
pub mod bench_nft;
pub mod bench_vms;
pub mod ipam;
pub mod sandbox;
pub mod sandbox_pool;
pub mod serve;
pub mod vm;
