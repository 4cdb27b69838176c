//! Where the fleet's VMs live (spec "Atlas WG Mesh"; design `design/mesh.md`, "Locations"): this
//! host's VMs registered in the shared store ([`vmnet_ipam::mesh_vms`]), and the data plane's
//! maps written from every registration.
//!
//! # Design
//! - **Registering.** A VM with a veth pair is registered (mesh address, tenant, this host, its
//!   user id, its public IPv6 block, whether it is a gateway) when the agent applied it
//!   ([`Locations::vm_up`]) and unregistered before its pair is removed ([`Locations::vm_down`]).
//!   Each full reconcile pass makes the store's rows of this host equal to the local VMs
//!   ([`Locations::converge`], writing only what differs), so a registration lost to a store
//!   outage is made again; `vmnet mesh vm sync` runs the same step at once. A host is its mesh
//!   address (`--mesh-address`): it writes only the rows naming it.
//! - **Locations.** The data plane's location map holds the winner of every registered mesh
//!   address ([`vmnet_ipam::mesh_vms::resolve`]: oldest claim, then smallest host; the losers
//!   are logged), this host's VMs taken from memory rather than from the store (so a VM applied
//!   while the store is down is reachable locally at once). Each write is a diff against the
//!   kernel map. Every full pass re-reads the whole set; on PostgreSQL a notification
//!   ([`vmnet_ipam::mesh_vms::CHANNEL`]) makes the agent re-read at once ([`Locations::refresh`]),
//!   so a peer learns a change in about one round trip.
//! - **Outage.** When the store cannot be read the maps stay as they were: forwarding goes on
//!   with what the host knew; local changes still reach the maps directly. A registration that
//!   could not be written is not lost: every (re)connection of the PostgreSQL listener first
//!   makes this host's rows equal to its VMs ([`Locations::resync`]), so the peers learn what
//!   changed during the outage as soon as the store is back, not at the next full pass. An agent
//!   started while the store is unreachable starts all the same ([`Locations::await_registry`]):
//!   until the store answers, a full pass writes the local VMs only and reports the store as
//!   unavailable, and the other hosts' locations stay as the kernel kept them.
//! - **Local VMs.** For each, the filter on its host veth is read back (an ingress filter dump
//!   of that device): one running this agent's VM-side program is left alone; a missing one,
//!   or one running another program (a previous agent's, swapped in place at start-up), gets
//!   this agent's attached, and after the first pass that counts as a repair. Its local entry
//!   (veth, tenant, next hop) is written; entries of VMs that are gone are removed.
//!
//! - **Blocks and gateways.** The winners' public IPv6 blocks go to the data plane's block map
//!   ([`super::wanted::blocks_of`]), so a VM on another host reaches a block through the mesh.
//!   Routes via a gateway VM need no map of their own: the data plane asks the host's routing
//!   for the next hop and carries the packet to the host where that gateway's mesh address
//!   lives.
//!
//! The gateway flag: a VM that routes `::/0` via the host (it can carry traffic out for others).

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv6Addr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex as StdMutex, OnceLock};

use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;
use vmnet_ipam::Db;
use vmnet_ipam::mesh_vms::{self, Conflict, MeshVmRow, Replaced};
use vmnet_kernel::mesh::{Location, MeshError, MeshPlane};
use vmnet_model::Error;

use super::dataplane::unavailable;
pub use super::localvm::LocalReg;
use super::localvm::{FilterState, filter_state};
use super::wanted::{blocks_of, gateways_of, locations_of, set_locations};
use crate::agent::store_tx;
use crate::status::now_ms;

/// `GET /v1/mesh`'s `registrations`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegistrationsView {
    /// This host (its mesh address), as its rows name it.
    pub host: String,
    /// Registrations known: every row of the last read (this host's from memory).
    pub known: usize,
    /// Of them, this host's VMs.
    pub local: usize,
    /// Mesh addresses claimed by more than one host (`winner` and `losers` are hosts).
    pub conflicts: Vec<ConflictView>,
    /// Milliseconds since the Unix epoch of the last successful read of the store.
    pub last_read_at_unix_ms: Option<i64>,
    /// The last read or write failure, cleared by the next success.
    pub last_error: Option<String>,
}

/// One conflict of [`RegistrationsView`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConflictView {
    /// The mesh address.
    pub mesh_address: String,
    /// The host whose claim is in force.
    pub winner: String,
    /// The hosts whose claims are not.
    pub losers: Vec<String>,
}

#[derive(Debug, Default)]
struct State {
    /// This host's VMs by mesh address, with the time of their first registration.
    locals: BTreeMap<Ipv6Addr, (LocalReg, i64)>,
    /// The other hosts' rows of the last read.
    others: Vec<MeshVmRow>,
    /// This host's rows of the last read, used only until the first full pass gave `locals`
    /// (an agent that just started keeps its VMs' locations).
    own_stored: Vec<MeshVmRow>,
    /// Whether a full pass set `locals`.
    seeded: bool,
    conflicts: Vec<Conflict>,
}

/// This host's VM registrations and the locations the data plane holds.
#[derive(Debug)]
pub struct Locations {
    host: Ipv6Addr,
    registry: OnceLock<Db>,
    /// A store is configured but not connected yet ([`Locations::await_registry`]).
    awaiting: AtomicBool,
    /// The last store request failed and none has succeeded since: a VM's own registration
    /// write is skipped instead of waiting for the store (the next resync or pass writes it).
    store_down: AtomicBool,
    state: Mutex<State>,
    view: StdMutex<RegistrationsView>,
}

fn plane_err(e: &MeshError) -> Error {
    unavailable(e)
}

impl Locations {
    /// The locations of host `host` (its mesh address); registrations wait for
    /// [`Locations::set_registry`].
    #[must_use]
    pub fn new(host: Ipv6Addr) -> Self {
        Self {
            host,
            registry: OnceLock::new(),
            awaiting: AtomicBool::new(false),
            store_down: AtomicBool::new(false),
            state: Mutex::new(State::default()),
            view: StdMutex::new(RegistrationsView {
                host: host.to_string(),
                ..RegistrationsView::default()
            }),
        }
    }

    /// Sets the shared store of registrations (once; later calls are ignored).
    pub fn set_registry(&self, db: Db) {
        let _ = self.registry.set(db);
        self.awaiting.store(false, Ordering::Release);
    }

    /// Marks the shared store as configured but not reachable yet (the agent started during a
    /// store outage and keeps connecting). Until [`Locations::set_registry`], reads fail with
    /// `UNAVAILABLE`, so no pass rewrites the maps without the other hosts' rows.
    pub fn await_registry(&self) {
        if self.registry.get().is_none() {
            self.awaiting.store(true, Ordering::Release);
        }
    }

    /// The shared store, once set.
    #[must_use]
    pub fn registry(&self) -> Option<&Db> {
        self.registry.get()
    }

    /// The store for one VM's registration write: `None` without one, or while the last store
    /// request failed (the write is made by the next [`Locations::resync`] or full pass
    /// instead, so an apply never waits for a store that is down).
    fn store(&self) -> Option<&Db> {
        if self.store_down.load(Ordering::Acquire) {
            tracing::debug!(host = %self.host, "mesh registrations: store down; this write waits for the resync");
            return None;
        }
        self.registry.get()
    }

    fn note(&self, f: impl FnOnce(&mut RegistrationsView)) {
        if let Ok(mut v) = self.view.lock() {
            f(&mut v);
        }
    }

    fn failed(&self, what: &str, e: &Error) {
        self.store_down.store(true, Ordering::Release);
        tracing::warn!(host = %self.host, "mesh registrations: {what}: {}", e.message);
        let msg = format!("{what}: {}", e.message);
        self.note(|v| v.last_error = Some(msg));
    }

    /// The view for `GET /v1/mesh`.
    #[must_use]
    pub fn view(&self) -> RegistrationsView {
        self.view.lock().map(|v| v.clone()).unwrap_or_default()
    }

    fn put_local(&self, plane: &MeshPlane, l: &LocalReg) -> Result<(), Error> {
        tokio::task::block_in_place(|| {
            plane.attach_veth(&l.veth)?;
            plane.put_local(&l.local())
        })
        .map_err(|e| plane_err(&e))
    }

    /// The host that holds `mesh` by an older claim than this host's (from the last read of the
    /// shared store; `None` when no other host registered it, or this host's own claim is the
    /// older). A VM given such an address would lose the conflict and be unreachable over the
    /// mesh, so its PUT is refused instead ([`crate::Agent::put_vm`]).
    pub async fn claimed_elsewhere(&self, mesh: Ipv6Addr) -> Option<String> {
        let st = self.state.lock().await;
        let text = mesh.to_string();
        let mine = st
            .locals
            .get(&mesh)
            .map(|(_, at)| (*at, self.host.to_string()));
        st.others
            .iter()
            .filter(|r| r.mesh_address == text)
            .filter(|r| {
                mine.as_ref()
                    .is_none_or(|m| (r.registered_at, &r.host) < (m.0, &m.1))
            })
            .min_by_key(|r| (r.registered_at, r.host.clone()))
            .map(|r| r.host.clone())
    }

    /// After `vm` was applied: the VM-side program on its veth, its local entry and location,
    /// its registration. A store failure is logged (the next full pass registers it).
    ///
    /// # Errors
    /// `UNAVAILABLE` when the data plane fails.
    pub async fn vm_up(&self, plane: &MeshPlane, vm: LocalReg) -> Result<(), Error> {
        let mut st = self.state.lock().await;
        // A VM that changed its mesh address leaves its old one.
        let old: Vec<Ipv6Addr> = st
            .locals
            .iter()
            .filter(|(m, (l, _))| **m != vm.mesh && l.user_id == vm.user_id)
            .map(|(m, _)| *m)
            .collect();
        for m in old {
            st.locals.remove(&m);
            self.unregister(plane, m).await;
        }
        self.put_local(plane, &vm)?;
        let at = st.locals.get(&vm.mesh).map_or_else(now_ms, |(_, at)| *at);
        let loc = Location {
            host: self.host,
            user_id: vm.user_id,
            tenant: vm.tenant,
        };
        let older_elsewhere = st
            .conflicts
            .iter()
            .any(|c| c.mesh_address == vm.mesh.to_string() && c.winner != self.host.to_string());
        if !older_elsewhere {
            tokio::task::block_in_place(|| plane.put_location(vm.mesh, &loc))
                .map_err(|e| plane_err(&e))?;
        }
        let row = vm.row(self.host, at);
        st.locals.insert(vm.mesh, (vm, at));
        if let Some(db) = self.store() {
            match store_tx!(db, tx => mesh_vms::register(tx, &row).await) {
                Ok(_) => self.store_down.store(false, Ordering::Release),
                Err(e) => self.failed(&format!("register {}", row.mesh_address), &e),
            }
        }
        let n = st.locals.len();
        self.note(|v| v.local = n);
        Ok(())
    }

    async fn unregister(&self, plane: &MeshPlane, mesh: Ipv6Addr) {
        let own = self.host;
        let r = tokio::task::block_in_place(|| -> Result<(), MeshError> {
            if plane.locations()?.get(&mesh).is_some_and(|l| l.host == own) {
                plane.remove_location(mesh)?;
            }
            Ok(())
        });
        if let Err(e) = r {
            self.failed(&format!("location of {mesh}"), &plane_err(&e));
        }
        if let Some(db) = self.store() {
            let (h, m) = (self.host.to_string(), mesh.to_string());
            match store_tx!(db, tx => mesh_vms::unregister(tx, &h, &m).await) {
                Ok(_) => self.store_down.store(false, Ordering::Release),
                Err(e) => self.failed(&format!("unregister {mesh}"), &e),
            }
        }
    }

    /// Before the veth pair of VM `user_id` (mesh address `mesh`) goes: its registration, its
    /// location (when it points here) and its local entry. A store failure is logged (the next
    /// full pass removes the row).
    ///
    /// # Errors
    /// `UNAVAILABLE` when the data plane fails.
    pub async fn vm_down(
        &self,
        plane: &MeshPlane,
        mesh: Ipv6Addr,
        user_id: u32,
    ) -> Result<(), Error> {
        let mut st = self.state.lock().await;
        st.locals.remove(&mesh);
        self.unregister(plane, mesh).await;
        tokio::task::block_in_place(|| plane.remove_local(user_id)).map_err(|e| plane_err(&e))?;
        let n = st.locals.len();
        self.note(|v| v.local = n);
        Ok(())
    }

    /// A full pass (and `vmnet mesh vm sync`): `vms` are all of this host's VMs. Every one's
    /// program and local entry are written, stale local entries removed, this host's rows in
    /// the store made equal to `vms`, and the locations rewritten from the whole set. Returns
    /// what the store write changed and one line per repair.
    ///
    /// # Errors
    /// `UNAVAILABLE` when the data plane or the store fails (the maps then keep what they had,
    /// local VMs written).
    pub async fn converge(
        &self,
        plane: &MeshPlane,
        nl: &rtnetlink::Handle,
        vms: Vec<LocalReg>,
    ) -> Result<(Replaced, Vec<String>), Error> {
        let mut st = self.state.lock().await;
        let mut repaired = Vec::new();
        let ours =
            tokio::task::block_in_place(|| plane.vm_program_id()).map_err(|e| plane_err(&e))?;
        for vm in &vms {
            match filter_state(plane, nl, &vm.veth, ours).await {
                FilterState::Ours => {
                    tokio::task::block_in_place(|| plane.put_local(&vm.local()))
                        .map_err(|e| plane_err(&e))?;
                }
                found => {
                    self.put_local(plane, vm)?;
                    // Before the first pass, another program is the previous agent's: swapping
                    // it is the start-up, not a repair.
                    if st.seeded || found == FilterState::Missing {
                        let what = format!(
                            "mesh: VM-side filter on {} {}; attached this agent's",
                            vm.veth,
                            match found {
                                FilterState::Missing => "was missing",
                                _ => "ran another program",
                            }
                        );
                        tracing::warn!(vm_user_id = vm.user_id, "{what}");
                        repaired.push(what);
                    }
                }
            }
        }
        let keep: BTreeSet<u32> = vms.iter().map(|v| v.user_id).collect();
        let stale: Vec<u32> = tokio::task::block_in_place(|| plane.local_user_ids())
            .map_err(|e| plane_err(&e))?
            .into_iter()
            .filter(|u| !keep.contains(u))
            .collect();
        for u in stale {
            tokio::task::block_in_place(|| plane.remove_local(u)).map_err(|e| plane_err(&e))?;
            repaired.push(format!("mesh: stale local vm {u} removed"));
        }
        // The store's rows first: a VM registered before this agent started keeps its age.
        self.read(&mut st).await?;
        let now = now_ms();
        let stored: BTreeMap<String, i64> = st
            .own_stored
            .iter()
            .map(|r| (r.mesh_address.clone(), r.registered_at))
            .collect();
        let locals: BTreeMap<Ipv6Addr, (LocalReg, i64)> = vms
            .into_iter()
            .map(|v| {
                let at = st
                    .locals
                    .get(&v.mesh)
                    .map(|(_, at)| *at)
                    .or_else(|| stored.get(&v.mesh.to_string()).copied())
                    .unwrap_or(now);
                (v.mesh, (v, at))
            })
            .collect();
        st.locals = locals;
        st.seeded = true;
        let replaced = self.write_own(&st).await?;
        repaired.extend(
            replaced
                .written
                .iter()
                .map(|a| format!("mesh: registration {a} written")),
        );
        repaired.extend(
            replaced
                .removed
                .iter()
                .map(|a| format!("mesh: stale registration {a} removed")),
        );
        repaired.extend(self.write_maps(plane, &mut st)?);
        Ok((replaced, repaired))
    }

    /// Makes this host's rows in the store equal to `st.locals` (writing only what differs);
    /// nothing without a store.
    async fn write_own(&self, st: &State) -> Result<Replaced, Error> {
        let Some(db) = self.registry.get() else {
            return Ok(Replaced::default());
        };
        let host = self.host.to_string();
        let own: Vec<MeshVmRow> = st
            .locals
            .values()
            .map(|(l, at)| l.row(self.host, *at))
            .collect();
        let r =
            store_tx!(db, tx => mesh_vms::replace_host(tx, &host, &own).await).map_err(|e| {
                self.failed("write this host's registrations", &e);
                e
            })?;
        self.store_down.store(false, Ordering::Release);
        Ok(r)
    }

    /// After the store (re)connected: this host's rows made equal to its VMs (once a full pass
    /// has seeded them; registrations that failed during an outage are written now), then every
    /// registration re-read and the locations rewritten. Returns one line per row written or
    /// removed.
    ///
    /// # Errors
    /// `UNAVAILABLE` when the store or a map fails (the maps then keep what they had).
    pub async fn resync(&self, plane: &MeshPlane) -> Result<Vec<String>, Error> {
        let mut st = self.state.lock().await;
        let mut done = Vec::new();
        if st.seeded {
            let r = self.write_own(&st).await?;
            done.extend(
                r.written
                    .iter()
                    .map(|a| format!("registration {a} written")),
            );
            done.extend(
                r.removed
                    .iter()
                    .map(|a| format!("registration {a} removed")),
            );
        }
        self.read(&mut st).await?;
        self.write_maps(plane, &mut st)?;
        Ok(done)
    }

    /// Re-reads every registration and rewrites the locations (after a notification).
    ///
    /// # Errors
    /// `UNAVAILABLE` when the store or a map fails (the maps then keep what they had).
    pub async fn refresh(&self, plane: &MeshPlane) -> Result<Vec<String>, Error> {
        let mut st = self.state.lock().await;
        self.read(&mut st).await?;
        self.write_maps(plane, &mut st)
    }

    /// Reads every registration into `st`.
    async fn read(&self, st: &mut State) -> Result<(), Error> {
        let Some(db) = self.registry.get() else {
            if self.awaiting.load(Ordering::Acquire) {
                let e = Error::unavailable(
                    "the registration store (--mesh-registry) is not connected yet",
                );
                self.failed("read the registrations", &e);
                return Err(e);
            }
            return Ok(());
        };
        match store_tx!(db, tx => mesh_vms::list(tx).await) {
            Ok(rows) => {
                self.store_down.store(false, Ordering::Release);
                let own = self.host.to_string();
                let (mine, others) = rows.into_iter().partition(|r| r.host == own);
                st.others = others;
                st.own_stored = mine;
                self.note(|v| {
                    v.last_read_at_unix_ms = Some(now_ms());
                    v.last_error = None;
                });
                Ok(())
            }
            Err(e) => {
                self.failed("read the registrations", &e);
                Err(e)
            }
        }
    }

    /// Rewrites the location map from `st`: the other hosts' rows and this host's VMs (before
    /// the first full pass, this host's stored rows too).
    fn write_maps(&self, plane: &MeshPlane, st: &mut State) -> Result<Vec<String>, Error> {
        let mut rows = st.others.clone();
        if !st.seeded {
            rows.extend(
                st.own_stored
                    .iter()
                    .filter(|r| !st.locals.keys().any(|m| m.to_string() == r.mesh_address))
                    .cloned(),
            );
        }
        rows.extend(st.locals.values().map(|(l, at)| l.row(self.host, *at)));
        let (winners, conflicts) = mesh_vms::resolve(&rows);
        for c in conflicts.iter().filter(|c| !st.conflicts.contains(c)) {
            tracing::warn!(
                mesh_address = %c.mesh_address, winner = %c.winner, losers = ?c.losers,
                "mesh: conflicting registrations of one address; the oldest claim wins"
            );
        }
        let desired = locations_of(&winners)?;
        let blocks = blocks_of(&winners)?;
        let gateways = gateways_of(&winners)?;
        let (known, local) = (rows.len(), st.locals.len());
        let cv = conflicts
            .iter()
            .map(|c| ConflictView {
                mesh_address: c.mesh_address.clone(),
                winner: c.winner.clone(),
                losers: c.losers.clone(),
            })
            .collect();
        st.conflicts = conflicts;
        self.note(|v| {
            v.known = known;
            v.local = local;
            v.conflicts = cv;
        });
        tokio::task::block_in_place(|| {
            set_locations(plane, &desired)?;
            plane.set_blocks(&blocks)?;
            plane.set_gateways(&gateways)
        })
        .map_err(|e| plane_err(&e))?;
        Ok(Vec::new())
    }
}
