//! `vmnet-guest`: the guest agent. Every 250 ms it reads `meta-data/mesh-ipv6` and
//! `meta-data/host-routes` from the metadata service at 169.254.169.254 and, when they change,
//! applies what differs on the interface over rtnetlink, nothing else ([`plan`]), and records
//! it for systemd-networkd in a drop-in, then resets the resolver and time sync (see
//! [`networkd`]); with `--apply netlink`, the interface only ([`netlink`]). A
//! missing or bad document keeps the last good configuration and is logged (once per distinct
//! error); the agent never exits on one.
//!
//! Spec: namespaced-vm-networking.md, the MMDS paragraph of "Atlas WG Mesh" (there
//! `atlas-metadata.service`).

mod doc;
mod fetch;
mod kernel;
mod netlink;
mod networkd;
mod plan;
mod poll;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};

use crate::doc::GuestNet;
use crate::fetch::Mmds;
use crate::kernel::Rtnl;
use crate::networkd::Applied;
use crate::poll::{Apply, Outcome, Poller};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// A systemd-networkd drop-in, reloaded.
    Networkd,
    /// Directly over rtnetlink (images without networkd).
    Netlink,
}

/// Applies the mesh address and host routes the metadata service gives this VM.
#[derive(Debug, Parser)]
#[command(name = "vmnet-guest", version)]
struct Args {
    /// How to apply.
    #[arg(long, value_enum, default_value = "networkd")]
    apply: Mode,
    /// The guest interface.
    #[arg(long, default_value = "eth0")]
    interface: String,
    /// networkd: the directory of the interface's `.network` file.
    #[arg(long, default_value = "/etc/systemd/network")]
    network_dir: PathBuf,
    /// networkd: the `.network` file the drop-in extends (`<file>.d/50-vmnet-guest.conf`).
    #[arg(long, default_value = "10-eth0.network")]
    network_file: String,
    /// The metadata service.
    #[arg(long, default_value = "169.254.169.254:80")]
    metadata: SocketAddr,
    /// Milliseconds between polls.
    #[arg(long, default_value_t = 250, value_parser = clap::value_parser!(u64).range(10..=60_000))]
    interval_ms: u64,
}

struct NetworkdApply(networkd::Networkd<networkd::RealSystem, Rtnl>);

impl Apply for NetworkdApply {
    async fn apply(&mut self, net: &GuestNet) -> Result<Applied, String> {
        let done = self.0.apply(net).await?;
        for e in &done.failed_resets {
            eprintln!("vmnet-guest: applied; a reset failed (not retried): {e}");
        }
        Ok(done)
    }
}

impl Apply for netlink::Netlink<Rtnl> {
    async fn apply(&mut self, net: &GuestNet) -> Result<Applied, String> {
        netlink::Netlink::apply(self, net).await
    }
}

fn describe(n: &GuestNet) -> String {
    let routes: Vec<String> = n.host_routes.iter().map(ToString::to_string).collect();
    format!("mesh {} host routes [{}]", n.mesh_ipv6, routes.join(", "))
}

async fn run<A: Apply>(mut p: Poller<Mmds, A>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_problem: Option<String> = None;
    loop {
        tick.tick().await;
        let problem = match p.poll().await {
            Outcome::Unchanged => None,
            Outcome::Applied(n, done) => {
                eprintln!("vmnet-guest: applied {}: {done}", describe(&n));
                None
            }
            Outcome::InPlace(n) => {
                eprintln!(
                    "vmnet-guest: {} in place already (disk and kernel); nothing changed",
                    describe(&n)
                );
                None
            }
            Outcome::Kept(e) => Some(format!("keeping the last configuration: {e}")),
            Outcome::ApplyFailed(e) => Some(format!("apply failed (retrying): {e}")),
        };
        if problem.is_some() && problem != last_problem {
            eprintln!("vmnet-guest: {}", problem.as_deref().unwrap_or_default());
        }
        last_problem = problem;
    }
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("vmnet-guest: no runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let every = Duration::from_millis(args.interval_ms);
    let fetch = Mmds::new(args.metadata);
    rt.block_on(async {
        match args.apply {
            Mode::Networkd => match Rtnl::new(&args.interface) {
                Ok(k) => {
                    let n = networkd::Networkd::new(
                        networkd::RealSystem,
                        k,
                        &args.network_dir,
                        &args.network_file,
                    );
                    run(Poller::new(fetch, NetworkdApply(n)), every).await;
                }
                Err(e) => eprintln!("vmnet-guest: {e}"),
            },
            Mode::Netlink => match Rtnl::new(&args.interface) {
                Ok(k) => run(Poller::new(fetch, netlink::Netlink::new(k)), every).await,
                Err(e) => eprintln!("vmnet-guest: {e}"),
            },
        }
    });
    std::process::ExitCode::FAILURE
}
