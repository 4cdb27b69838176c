//! The mesh data plane as the agent runs it (`vmnet serve --mesh --mesh-bpf-root DIR`): the BPF
//! programs of [`vmnet_kernel::mesh`] loaded with their maps pinned under `DIR`, the
//! decapsulating program on the WireGuard interface, this host's mesh address and the VM MTU
//! in the config map, the mesh range route with its locked MTU, and the tenant-0 whitelist of
//! the last `POST /v1/sync`. Every sync and every reconcile pass writes all of it again (each
//! step is idempotent), so a sync that removes a whitelist entry takes effect before it answers
//! and a pass repairs a program or route removed behind the agent's back.
//!
//! The VMs' part (the VM-side program on each veth, the local VMs and the locations from the
//! fleet's registrations) is [`super::locations`].

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv6Addr;
use std::path::Path;

use ipnet::Ipv6Net;
use serde::{Deserialize, Serialize};
use vmnet_kernel::mesh::{MeshError, MeshHost, MeshPlane, filter, route};
use vmnet_kernel::wg::link::Link;
use vmnet_model::Error;

/// The VM MTU the mesh carries end to end (namespace mode's link MTU).
pub const VM_MTU: u32 = 1380;

/// `GET /v1/mesh`'s `data_plane`: what the BPF maps hold and count.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataPlaneView {
    /// The bpffs directory of the pinned maps.
    pub pin_root: String,
    /// Locations known (mesh addresses with their host, user id and tenant).
    pub locations: usize,
    /// Packets dropped by reason (`tenant`, `unknown_destination`, `mtu`, `unknown_source`,
    /// `malformed`) since the maps were pinned.
    pub drops: BTreeMap<String, u64>,
    /// Packets forwarded by kind (`local`, `encapsulated`, `decapsulated`).
    pub passes: BTreeMap<String, u64>,
}

pub(crate) fn unavailable(e: &MeshError) -> Error {
    let mut msg = format!("mesh data plane: {e}");
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        msg.push_str(&format!(": {s}"));
        src = s.source();
    }
    Error::unavailable(msg)
}

/// The loaded data plane.
#[derive(Debug)]
pub struct DataPlane {
    plane: MeshPlane,
}

impl DataPlane {
    /// Loads the programs, reusing the maps pinned under `root` (a mounted bpffs directory).
    ///
    /// # Errors
    /// `UNAVAILABLE` without BPF support or when `root` is not a bpffs.
    pub fn load(root: &Path) -> Result<Self, Error> {
        MeshPlane::load(None, root)
            .map(|plane| Self { plane })
            .map_err(|e| unavailable(&e))
    }

    /// The loaded programs and maps.
    #[must_use]
    pub fn plane(&self) -> &MeshPlane {
        &self.plane
    }

    /// Writes what the data plane takes from the mesh settings and the last sync: host address
    /// and VM MTU, the whitelist, and, when `wg.2` says so, the program on the WireGuard link
    /// (`wg.0`, `wg.1`) and the mesh range route (a sync skips those netlink round trips
    /// unless it started the device; every reconcile pass checks them, each read first and
    /// written only when missing or different).
    ///
    /// # Errors
    /// `UNAVAILABLE` when a map, the attachment or the route fails; `INTERNAL` for a recorded
    /// whitelist entry that does not parse.
    pub async fn converge(
        &self,
        nl: &rtnetlink::Handle,
        wg: (&str, Link, bool),
        mesh: Option<Ipv6Addr>,
        whitelist: &[String],
    ) -> Result<(), Error> {
        let nets: BTreeSet<Ipv6Net> = whitelist
            .iter()
            .map(|w| {
                w.parse::<Ipv6Net>()
                    .or_else(|_| w.parse::<Ipv6Addr>().map(Ipv6Net::from))
                    .map_err(|_| Error::internal(format!("recorded whitelist entry {w:?}")))
            })
            .collect::<Result<_, _>>()?;
        let (ifname, link, check) = wg;
        // Read first: the filter on the WireGuard link is written only when it is missing or
        // runs another program, so a pass that finds it in place writes nothing.
        let attach = check
            && match filter::filter_program(nl, link.index).await {
                Ok(Some(id)) => Some(id) != self.plane.wg_program_id().ok(),
                Ok(None) | Err(_) => true,
            };
        tokio::task::block_in_place(|| -> Result<(), MeshError> {
            if let Some(mesh) = mesh {
                self.plane.set_host(&MeshHost {
                    mesh,
                    vm_mtu: VM_MTU,
                })?;
            }
            if attach {
                self.plane.attach_wg(ifname)?;
            }
            self.plane.set_whitelist(&nets)
        })
        .map_err(|e| unavailable(&e))?;
        if check {
            route::ensure_range_route(nl, link.index, VM_MTU)
                .await
                .map_err(|e| unavailable(&e))?;
        }
        Ok(())
    }

    /// The view for `GET /v1/mesh`.
    ///
    /// # Errors
    /// `UNAVAILABLE` when a map cannot be read.
    pub fn view(&self) -> Result<DataPlaneView, Error> {
        let named = |m: BTreeMap<&'static str, u64>| {
            m.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
        };
        tokio::task::block_in_place(|| {
            Ok(DataPlaneView {
                pin_root: self.plane.pin_root().display().to_string(),
                locations: self.plane.locations()?.len(),
                drops: named(self.plane.drops()?),
                passes: named(self.plane.passes()?),
            })
        })
        .map_err(|e: MeshError| unavailable(&e))
    }
}
