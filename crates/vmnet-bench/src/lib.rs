//! The benchmarks behind `vmnet-lab bench …`; each prints a table (or JSON).
//!
//! - [`ipam`]: lease and release latency and throughput on SQLite and PostgreSQL;
//! - [`vms`]: a namespace-mode VM's setup and teardown against the shell `ip`/`nft` baseline;
//! - [`nft`]: pool mode's nftables full replace and per-instance add/remove;
//! - [`agent`]: the agent process under N VMs put over its API, and ([`boot`]) its start with N
//!   stored VMs after a host reboot and an agent restart;
//! - [`drift`]: how fast the agent repairs changes to what it owns, on the kernel's change
//!   notifications, at N VMs, and a storm of the same change;
//! - [`mesh`]: `POST /v1/sync` of the mesh's WireGuard peers against the real agent, and
//!   ([`mesh_forward`]) the data plane's TCP throughput VM to VM against host to host and
//!   ([`mesh_cost`]) its programs' cost per packet, and
//!   ([`mesh_propagation`]) how fast a VM registration reaches another host;
//! - [`metadata`]: the metadata service's listeners in N namespaces polled every 250 ms;
//! - [`activity`] and [`guard`]: iperf3 through a VM's path with and without the
//!   packet-activity program, and with and without the guest guard;
//! - [`wake`]: connect to a sleeping VM with and without wake on packet's hold, and iperf3
//!   through an awake VM with and without it;
//! - [`guests`]: real guests: boot to network-ready in namespace mode and ([`guests_pool`]) in
//!   pool mode, TCP throughput through vmnet's path against a bare tap, and with a limit.

pub mod activity;
pub mod agent;
pub mod agent_load;
pub mod agent_scrape;
pub mod boot;
pub mod drift;
pub mod guard;
pub mod guests;
pub mod guests_pool;
pub mod ipam;
pub mod iperf;
pub mod mesh;
pub mod mesh_cost;
pub mod mesh_forward;
pub mod mesh_propagation;
pub mod metadata;
pub mod nft;
pub mod procstat;
pub mod vms;
pub mod wake;

use clap::Subcommand;
use vmnet_ipam::IpamError;
use vmnet_model::{Error, ValidationError};

/// A benchmark's failure. The CLI maps it to a documented code at its edge.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The store under test failed.
    #[error(transparent)]
    Ipam(#[from] IpamError),
    /// A config the bench built does not validate.
    #[error(transparent)]
    Invalid(#[from] ValidationError),
    /// A failure that already carries its documented code (set-up, the kernel, the agent).
    #[error(transparent)]
    Coded(#[from] Error),
}

/// `vmnet-lab bench …`
#[derive(Debug, Subcommand)]
pub enum BenchCmd {
    /// IPAM lease/release latency and throughput.
    Ipam(ipam::IpamBenchArgs),
    /// Per-VM namespace-mode setup/teardown against the shell baseline.
    Vms(vms::VmsBenchArgs),
    /// Pool-mode nftables apply and per-instance add/remove.
    Nft(nft::NftBenchArgs),
    /// The agent process (`vmnet serve`) under N VMs put over its API: PUT latency, RSS, fds.
    Agent(agent::AgentBenchArgs),
    /// The agent's start with N stored VMs: to ready after a host reboot and after a restart.
    Boot(boot::BootBenchArgs),
    /// Changes to what the agent owns at N VMs: change to repair by kind, CPU, a storm.
    Drift(drift::DriftBenchArgs),
    /// `POST /v1/sync` of N WireGuard peers: from empty, one change, no-op.
    Mesh(mesh::MeshBenchArgs),
    /// The metadata service: N VMs' listeners polled every 250 ms (CPU, latency, RSS).
    Metadata(metadata::MetadataBenchArgs),
    /// iperf3 through a VM's path with and without the packet-activity program.
    Activity(activity::ActivityBenchArgs),
    /// iperf3 from a VM's guest with and without the guest guard.
    Guard(guard::GuardBenchArgs),
    /// Real guests (qemu): boot to network-ready per mode, throughput against a bare tap.
    Guests(guests::GuestsBenchArgs),
    /// Wake on packet: connect() to a sleeping VM with and without the hold; its awake cost.
    Wake(wake::WakeBenchArgs),
}

/// Runs `vmnet-lab bench …`; `json` prints JSON instead of a table where the bench supports it.
///
/// # Errors
/// Each bench's own (`UNAVAILABLE` when it cannot set up, `INVALID_INPUT` for bad arguments).
pub async fn run(json: bool, c: BenchCmd) -> Result<(), BenchError> {
    match c {
        BenchCmd::Ipam(a) => ipam::run(a).await,
        BenchCmd::Vms(a) => Ok(vms::run(a).await?),
        BenchCmd::Nft(a) => Ok(nft::run(json, a).await?),
        BenchCmd::Agent(a) => Ok(agent::run(a).await?),
        BenchCmd::Boot(a) => Ok(boot::run(a).await?),
        BenchCmd::Drift(a) => Ok(drift::run(a).await?),
        BenchCmd::Mesh(a) => Ok(mesh::run(a).await?),
        BenchCmd::Metadata(a) => Ok(metadata::run(a).await?),
        BenchCmd::Activity(a) => Ok(activity::run(a).await?),
        BenchCmd::Guard(a) => Ok(guard::run(a).await?),
        BenchCmd::Guests(a) => Ok(guests::run(a).await?),
        BenchCmd::Wake(a) => Ok(wake::run(a).await?),
    }
}
