//! `vmnet serve`: run the agent (HTTP API on a unix socket and optionally a loopback TCP port,
//! the reconcile loop) over the store, applying namespace mode through the netlink driver.
//!
//! With `--netns NAME` the whole process moves into that named network namespace on the main
//! thread *before* the tokio runtime starts ([`enter_netns`], called from `main`), so every
//! thread of the agent lives there; the agent never forks.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ipnet::Ipv4Net;
use vmnet_agent::agent::{Agent, DEFAULT_RECONCILE_INTERVAL_SECS};
use vmnet_agent::server;
use vmnet_ipam::Db;
use vmnet_kernel::ns::NetlinkNsDriver;
use vmnet_model::Error;
use vmnet_plan::ns::NsSettings;

use crate::Global;

/// Arguments of this command.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Also listen on this loopback TCP address (e.g. 127.0.0.1:7070). Non-loopback addresses
    /// are refused: the API has no authentication.
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// The prefix of every kernel object name (netns, links, nft tables): 1-10 bytes, a lowercase
    /// letter then lowercase letters or digits.
    #[arg(long, default_value = "vmn")]
    pub name_prefix: String,
    /// The transit range: VM user id N gets the /30 at offset 4·N (a /14 covers every user id).
    #[arg(long, default_value = "10.200.0.0/14")]
    pub transit_cidr: Ipv4Net,
    /// Owner of each VM's tap, the VMM's user: `UID` or `UID:GID`. Default: root only.
    #[arg(long, value_parser = parse_owner)]
    pub tap_owner: Option<(u32, Option<u32>)>,
    /// Seconds between periodic reconcile passes (a pass also runs after every change).
    #[arg(long, default_value_t = DEFAULT_RECONCILE_INTERVAL_SECS, value_parser = clap::value_parser!(u64).range(1..=86400))]
    pub reconcile_interval_secs: u64,
    /// Run inside this named network namespace (`/run/netns/NAME`): the namespace is the
    /// agent's host namespace. Entered on the main thread before any other thread starts.
    #[arg(long)]
    pub netns: Option<String>,
}

fn parse_owner(s: &str) -> Result<(u32, Option<u32>), String> {
    let (u, g) = match s.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (s, None),
    };
    let uid = u
        .parse::<u32>()
        .map_err(|_| format!("{s:?}: expected UID or UID:GID (numbers)"))?;
    let gid = g
        .map(|g| {
            g.parse::<u32>()
                .map_err(|_| format!("{s:?}: GID must be a number"))
        })
        .transpose()?;
    Ok((uid, gid))
}

/// Moves the calling (main) thread into `--netns`, if given. Call before the runtime starts.
///
/// # Errors
/// `INVALID_INPUT` when the namespace does not exist or cannot be entered.
pub fn enter_netns(args: &ServeArgs) -> Result<(), Error> {
    match &args.netns {
        Some(name) => vmnet_kernel::netns::enter_current_thread(name)
            .map_err(|e| Error::invalid(format!("--netns {name}: {e}"))),
        None => Ok(()),
    }
}

impl ServeArgs {
    /// The namespace-mode settings these flags describe.
    ///
    /// # Errors
    /// `INVALID_INPUT` naming the flag.
    pub fn settings(&self) -> Result<NsSettings, Error> {
        let s = NsSettings {
            name_prefix: self.name_prefix.clone(),
            transit_ipv4: self.transit_cidr,
            tap_owner_uid: self.tap_owner.map(|(u, _)| u),
            tap_owner_gid: self.tap_owner.and_then(|(_, g)| g),
            ..NsSettings::default()
        };
        s.validate()?;
        Ok(s)
    }
}

/// Runs the command until SIGTERM or SIGINT.
pub async fn run(g: &Global, args: ServeArgs) -> Result<(), Error> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let settings = args.settings()?;
    let tcp = match args.listen {
        Some(addr) => Some(server::bind_tcp(addr).await?),
        None => None,
    };
    let db = Db::connect(&g.database_url()).await?;
    let driver = Arc::new(NetlinkNsDriver::new(settings.clone(), None).map_err(Error::from)?);
    let agent = Agent::new(
        db,
        driver,
        settings,
        Duration::from_secs(args.reconcile_interval_secs),
    )?;
    let unix = server::bind_unix(&g.socket).await?;
    tracing::info!(
        socket = %g.socket.display(),
        listen = ?args.listen,
        netns = ?args.netns,
        prefix = %agent.settings().name_prefix,
        "vmnet agent listening"
    );
    let reconciler = tokio::spawn(Arc::clone(&agent).run_loop());
    let router = vmnet_agent::api::router(Arc::clone(&agent));
    let result = server::serve(router, unix, &g.socket, tcp, server::shutdown_signal()).await;
    agent.stop_loop(reconciler).await;
    tracing::info!("vmnet agent stopped");
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tap_owner_forms() {
        assert_eq!(parse_owner("1000").unwrap(), (1000, None));
        assert_eq!(parse_owner("1000:100").unwrap(), (1000, Some(100)));
        assert!(parse_owner("kvm").is_err());
    }
}
