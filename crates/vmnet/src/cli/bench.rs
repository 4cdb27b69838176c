//! `vmnet bench …`: benchmarks that print a table.

use clap::Subcommand;
use vmnet_model::Error;

use crate::Global;

/// `vmnet bench …`
#[derive(Debug, Subcommand)]
pub enum BenchCmd {
    /// IPAM lease/release latency and throughput (issue: pool IPAM).
    Ipam(super::bench_ipam::IpamBenchArgs),
    /// Per-VM namespace-mode setup/teardown against the shell baseline.
    Vms(super::bench_vms::VmsBenchArgs),
    /// Pool-mode nftables apply and per-instance add/remove.
    Nft(super::bench_nft::NftBenchArgs),
    /// The agent process (`vmnet serve`) under N VMs put over its API: PUT latency, RSS, fds.
    Agent(super::bench_agent::AgentBenchArgs),
}

/// Runs `vmnet bench …`.
pub async fn run(g: &Global, c: BenchCmd) -> Result<(), Error> {
    match c {
        BenchCmd::Ipam(a) => super::bench_ipam::run(g, a).await,
        BenchCmd::Vms(a) => super::bench_vms::run(g, a).await,
        BenchCmd::Nft(a) => super::bench_nft::run(g, a).await,
        BenchCmd::Agent(a) => super::bench_agent::run(g, a).await,
    }
}
