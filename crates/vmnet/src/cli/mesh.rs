//! `vmnet mesh show` and `vmnet mesh sync FILE`: the mesh's WireGuard interface through the
//! agent's API (`GET /v1/mesh`, `POST /v1/sync`).

use std::path::PathBuf;

use clap::Subcommand;
use vmnet_agent::client::Client;
use vmnet_agent::mesh::view::{MeshView, SyncOutcome, VmSyncOutcome};
use vmnet_agent::table::render;
use vmnet_model::Error;

use super::io::{print_json, read_file};
use crate::{Global, Output};

/// `vmnet mesh …`
#[derive(Debug, Subcommand)]
pub enum MeshCmd {
    /// Show this host's mesh interface: key, port, mesh address, MTU, and every peer (managed
    /// peers with their last handshake and counters, foreign peers marked foreign).
    Show,
    /// Apply a complete managed peer set and whitelist from a JSON file (`-` for stdin), the
    /// body of `POST /v1/sync`.
    Sync {
        /// The sync file: `{"peers": [{"public_key", "endpoint", "mesh_address"}, …],
        /// "whitelist": […]}`.
        file: PathBuf,
    },
    /// This host's VM registrations.
    #[command(subcommand)]
    Vm(MeshVmCmd),
}

/// `vmnet mesh vm …`
#[derive(Debug, Subcommand)]
pub enum MeshVmCmd {
    /// Register the complete local state again: this host's rows in the registration store
    /// made equal to its VMs, and the locations rewritten (`POST /v1/mesh/vms/sync`).
    Sync,
}

/// The largest peer list read: the largest sync body the agent accepts.
const SYNC_FILE_LIMIT: u64 = vmnet_agent::api::mesh::SYNC_BODY_LIMIT_BYTES as u64;

/// Reads a JSON document from `path` (`-`: stdin), at most the agent's sync body limit; an
/// object that repeats a key is refused, as the agent refuses it.
fn read(path: &PathBuf) -> Result<serde_json::Value, Error> {
    let (name, bytes) = read_file(path, SYNC_FILE_LIMIT)?;
    vmnet_model::json::from_slice(&bytes)
        .map_err(|e| Error::invalid(format!("{name}: not a JSON document: {e}")))
}

/// Runs `vmnet mesh …`.
pub fn mesh(g: &Global, c: MeshCmd) -> Result<(), Error> {
    let client = Client::new(&g.socket);
    match c {
        MeshCmd::Show => {
            let v: MeshView = client.get_blocking("/v1/mesh")?;
            if g.output == Output::Json {
                return print_json(&v);
            }
            vmnet_cli::outln!("interface     {}", v.interface)?;
            vmnet_cli::outln!("public key    {}", v.public_key)?;
            vmnet_cli::outln!("listen port   {}", v.listen_port)?;
            vmnet_cli::outln!("mesh address  {}", v.mesh_address.as_deref().unwrap_or("-"))?;
            vmnet_cli::outln!("mtu           {}", v.mtu)?;
            vmnet_cli::outln!(
                "wireguard-go  {}",
                v.daemon_pid
                    .map_or("not running".to_owned(), |p| format!("pid {p}"))
            )?;
            for b in &v.socket_buffers {
                vmnet_cli::outln!(
                    "udp socket    {} rb {} tb {}",
                    b.family,
                    b.receive_bytes,
                    b.send_bytes
                )?;
            }
            vmnet_cli::outln!("whitelist     {}", v.whitelist.len())?;
            let now = vmnet_agent::status::now_ms() / 1000;
            let rows: Vec<Vec<String>> = v
                .peers
                .iter()
                .map(|p| {
                    vec![
                        p.public_key.clone(),
                        if p.foreign {
                            "foreign"
                        } else if p.leaving {
                            "leaving"
                        } else {
                            "managed"
                        }
                        .to_owned(),
                        p.endpoint.clone().unwrap_or_else(|| "-".to_owned()),
                        p.mesh_address
                            .clone()
                            .unwrap_or_else(|| p.allowed_ips.join(",")),
                        match p.route {
                            Some(true) => "yes".to_owned(),
                            Some(false) => "MISSING".to_owned(),
                            None => "-".to_owned(),
                        },
                        p.last_handshake_unix_secs.map_or("never".to_owned(), |s| {
                            format!("{}s ago", u64::try_from(now).unwrap_or(0).saturating_sub(s))
                        }),
                        p.rx_bytes.to_string(),
                        p.tx_bytes.to_string(),
                    ]
                })
                .collect();
            vmnet_cli::out(format_args!(
                "{}",
                render(
                    &[
                        "PUBLIC KEY",
                        "KIND",
                        "ENDPOINT",
                        "MESH/ALLOWED",
                        "ROUTE",
                        "HANDSHAKE",
                        "RX",
                        "TX"
                    ],
                    &rows
                )
            ))?;
            Ok(())
        }
        MeshCmd::Sync { file } => {
            let body = read(&file)?;
            let o: SyncOutcome = client.post_blocking("/v1/sync", Some(&body))?;
            if g.output == Output::Json {
                return print_json(&o);
            }
            vmnet_cli::outln!(
                "synced {} peers: {} added, {} updated, {} removed; routes {} added, {} removed; whitelist {}",
                o.peers,
                o.added,
                o.updated,
                o.removed,
                o.routes_added,
                o.routes_removed,
                o.whitelist
            )?;
            Ok(())
        }
        MeshCmd::Vm(MeshVmCmd::Sync) => {
            let o: VmSyncOutcome = client.post_blocking("/v1/mesh/vms/sync", None::<&()>)?;
            if g.output == Output::Json {
                return print_json(&o);
            }
            vmnet_cli::outln!(
                "registrations: {} written, {} removed",
                o.written.len(),
                o.removed.len()
            )?;
            Ok(())
        }
    }
}
