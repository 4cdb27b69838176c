//! [`MeshPlane`]: the loaded mesh programs of one host namespace and their pinned maps.

mod counters;

pub mod cost;

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv6Addr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{Array, HashMap as BpfHashMap, MapData, PerCpuArray};
use aya::programs::tc::{NlOptions, SchedClassifierLink, TcAttachOptions};
use aya::programs::{SchedClassifier, TcAttachType};
use aya::{Ebpf, EbpfLoader, Pod};
use ipnet::Ipv6Net;

use super::maps::{self, Config, Dest, GwKey, Local};
use super::{
    DROP_REASONS, FILTER_HANDLE, FILTER_PRIORITY, LocalVm, Location, MAX_USER_ID, MeshError,
    MeshHost, PASS_KINDS,
};

/// The compiled BPF object.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/mesh.o"));

/// The program on VM veths and the one on the WireGuard interface.
const FROM_VM: &str = "mesh_from_vm";
const FROM_WG: &str = "mesh_from_wg";
/// The read-only flag of `mesh_from_vm`'s source check.
const CHECK_SOURCES: &str = "check_sources";

fn map_err(map: &'static str) -> impl Fn(aya::maps::MapError) -> MeshError {
    move |source| MeshError::Map { map, source }
}

use crate::bpffs::ignore_missing;

/// The loaded mesh programs of one host namespace. All methods are blocking (netlink and
/// bpf(2) calls).
pub struct MeshPlane {
    ns: Option<String>,
    root: PathBuf,
    bpf: Mutex<Ebpf>,
}

impl std::fmt::Debug for MeshPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeshPlane")
            .field("ns", &self.ns)
            .field("root", &self.root)
            .finish_non_exhaustive()
    }
}

fn octets(a: Ipv6Addr) -> [u8; 16] {
    a.octets()
}

impl MeshPlane {
    /// Loads the programs, reusing the maps pinned under `pin_root` (a bpffs directory) or
    /// creating and pinning them there. `ns` is the namespace of the devices (`None`: this
    /// thread's).
    ///
    /// # Errors
    /// [`MeshError::Load`] without BPF support or privileges, or when `pin_root` is not a
    /// bpffs.
    pub fn load(ns: Option<&str>, pin_root: &Path) -> Result<Self, MeshError> {
        Self::load_object(ns, pin_root, OBJECT)
    }

    /// Like [`MeshPlane::load`], from `object`, another build of the same programs (an ELF
    /// object of `bpf/mesh.bpf.c` with the same maps): attaching its programs replaces the ones
    /// in the filters in place, as an upgrade of vmnet does.
    ///
    /// # Errors
    /// As [`MeshPlane::load`]; [`MeshError::Load`] also when `object` is not such an object.
    pub fn load_object(
        ns: Option<&str>,
        pin_root: &Path,
        object: &[u8],
    ) -> Result<Self, MeshError> {
        Self::load_with(ns, pin_root, object, true)
    }

    /// Loads `object` with its read-only `check_sources` set to `check_sources` (vmnet: always
    /// on; off only for [`MeshPlane::load_without_source_check`]).
    fn load_with(
        ns: Option<&str>,
        pin_root: &Path,
        object: &[u8],
        check_sources: bool,
    ) -> Result<Self, MeshError> {
        let load_err = |source: Box<dyn std::error::Error + Send + Sync>| MeshError::Load {
            root: pin_root.display().to_string(),
            source,
        };
        if !pin_root.is_dir() {
            return Err(load_err(
                "no such directory (make it and mount a bpffs on it: mount -t bpf bpf <dir>)"
                    .into(),
            ));
        }
        if !crate::bpffs::is_bpffs(pin_root) {
            return Err(load_err(
                "not a mounted bpffs (mount one: mount -t bpf bpf <dir>)".into(),
            ));
        }
        let check = u32::from(check_sources);
        let mut bpf = EbpfLoader::new()
            .default_map_pin_directory(pin_root)
            .override_global(CHECK_SOURCES, &check, true)
            .load(object)
            .map_err(|e| load_err(Box::new(e)))?;
        for name in [FROM_VM, FROM_WG] {
            let prog: &mut SchedClassifier = bpf
                .program_mut(name)
                .ok_or_else(|| load_err(format!("no program {name}").into()))?
                .try_into()
                .map_err(|e| load_err(Box::new(e)))?;
            prog.load().map_err(|e| load_err(Box::new(e)))?;
        }
        Ok(Self {
            ns: ns.map(str::to_owned),
            root: pin_root.to_owned(),
            bpf: Mutex::new(bpf),
        })
    }

    /// The pin root the maps live under.
    #[must_use]
    pub fn pin_root(&self) -> &Path {
        &self.root
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ebpf> {
        self.bpf
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn in_ns<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T, MeshError> {
        match &self.ns {
            Some(ns) => crate::netns::run_in(ns, f).map_err(MeshError::Netns),
            None => Ok(f()),
        }
    }

    fn ifindex(&self, dev: &str) -> Result<u32, MeshError> {
        self.in_ns(|| nix::net::if_::if_nametoindex(dev).ok())?
            .ok_or_else(|| MeshError::NoDevice(dev.to_owned()))
    }

    fn hash<K: Pod, V: Pod, T>(
        &self,
        name: &'static str,
        f: impl FnOnce(&mut BpfHashMap<&mut MapData, K, V>) -> Result<T, aya::maps::MapError>,
    ) -> Result<T, MeshError> {
        let mut bpf = self.lock();
        let map = bpf.map_mut(name).ok_or(MeshError::Map {
            map: name,
            source: aya::maps::MapError::InvalidName { name: name.into() },
        })?;
        let mut m = BpfHashMap::try_from(map).map_err(map_err(name))?;
        f(&mut m).map_err(map_err(name))
    }

    /// Sets this host's mesh address and the VM MTU. Until it is set, every mesh packet from a
    /// VM is dropped.
    ///
    /// # Errors
    /// A map error.
    pub fn set_host(&self, host: &MeshHost) -> Result<(), MeshError> {
        let mut bpf = self.lock();
        let map = bpf.map_mut(maps::CONFIG).ok_or(MeshError::Map {
            map: maps::CONFIG,
            source: aya::maps::MapError::InvalidName {
                name: maps::CONFIG.into(),
            },
        })?;
        let mut a = Array::<_, Config>::try_from(map).map_err(map_err(maps::CONFIG))?;
        let cfg = Config {
            host: octets(host.mesh),
            vm_mtu: host.vm_mtu,
            pad: 0,
        };
        // Read first: a pass that finds the entry in place writes nothing.
        if a.get(&0, 0)
            .is_ok_and(|c| (c.host, c.vm_mtu) == (cfg.host, cfg.vm_mtu))
        {
            return Ok(());
        }
        a.set(0, cfg, 0).map_err(map_err(maps::CONFIG))
    }

    /// Writes (or replaces) the location of the VM with mesh address `mesh`.
    ///
    /// # Errors
    /// [`MeshError::Invalid`] for a user id over [`MAX_USER_ID`]; a map error.
    pub fn put_location(&self, mesh: Ipv6Addr, loc: &Location) -> Result<(), MeshError> {
        if loc.user_id > MAX_USER_ID {
            return Err(MeshError::Invalid(format!(
                "location {mesh}: user_id {} does not fit the 20-bit flow label",
                loc.user_id
            )));
        }
        let v = Dest {
            host: octets(loc.host),
            user_id: loc.user_id,
            tenant: loc.tenant,
        };
        self.hash::<[u8; 16], Dest, _>(maps::DESTS, |m| m.insert(octets(mesh), v, 0))
    }

    /// Removes the location of `mesh`; a missing one is fine.
    ///
    /// # Errors
    /// A map error.
    pub fn remove_location(&self, mesh: Ipv6Addr) -> Result<(), MeshError> {
        self.hash::<[u8; 16], Dest, _>(maps::DESTS, |m| ignore_missing(m.remove(&octets(mesh))))
    }

    /// Every location in the kernel map now, by mesh address.
    ///
    /// # Errors
    /// A map error.
    pub fn locations(&self) -> Result<BTreeMap<Ipv6Addr, Location>, MeshError> {
        self.hash::<[u8; 16], Dest, _>(maps::DESTS, |m| {
            m.iter()
                .map(|r| {
                    r.map(|(k, v)| {
                        (
                            Ipv6Addr::from(k),
                            Location {
                                host: Ipv6Addr::from(v.host),
                                user_id: v.user_id,
                                tenant: v.tenant,
                            },
                        )
                    })
                })
                .collect()
        })
    }

    /// Writes the local VM `vm` (its veth must exist). Its location (this host) is written
    /// separately with [`MeshPlane::put_location`].
    ///
    /// # Errors
    /// [`MeshError::NoDevice`], [`MeshError::Invalid`] or a map error.
    pub fn put_local(&self, vm: &LocalVm) -> Result<(), MeshError> {
        if vm.user_id > MAX_USER_ID {
            return Err(MeshError::Invalid(format!(
                "local vm {}: user_id {} does not fit the 20-bit flow label",
                vm.mesh, vm.user_id
            )));
        }
        let ifindex = self.ifindex(&vm.veth)?;
        let v = Local {
            ifindex,
            tenant: vm.tenant,
            mesh: octets(vm.mesh),
            via: octets(vm.via),
        };
        self.hash::<u32, Local, _>(maps::LOCAL_VMS, |m| m.insert(vm.user_id, v, 0))?;
        for (map, on) in [
            (maps::VIA_VMS, vm.routes_via_mesh),
            (maps::GATEWAY_VMS, vm.gateway),
        ] {
            self.hash::<u32, u8, _>(map, |m| {
                if on {
                    m.insert(vm.user_id, 1, 0)
                } else {
                    ignore_missing(m.remove(&vm.user_id))
                }
            })?;
        }
        self.hash::<u32, u32, _>(maps::VETHS, |m| m.insert(ifindex, vm.user_id, 0))
    }

    /// The user ids of the local VMs in the kernel map now, sorted.
    ///
    /// # Errors
    /// A map error.
    pub fn local_user_ids(&self) -> Result<BTreeSet<u32>, MeshError> {
        self.hash::<u32, Local, _>(maps::LOCAL_VMS, |m| m.keys().collect())
    }

    /// The user ids of the local VMs with a route via a mesh address (map `mesh_via_vms`),
    /// sorted.
    ///
    /// # Errors
    /// A map error.
    pub fn via_user_ids(&self) -> Result<BTreeSet<u32>, MeshError> {
        self.hash::<u32, u8, _>(maps::VIA_VMS, |m| m.keys().collect())
    }

    /// The user ids of the local gateway VMs (map `mesh_gateway_vms`), sorted.
    ///
    /// # Errors
    /// A map error.
    pub fn gateway_user_ids(&self) -> Result<BTreeSet<u32>, MeshError> {
        self.hash::<u32, u8, _>(maps::GATEWAY_VMS, |m| m.keys().collect())
    }

    /// Removes local VM `user_id` (and its veth entry); a missing one is fine.
    ///
    /// # Errors
    /// A map error.
    pub fn remove_local(&self, user_id: u32) -> Result<(), MeshError> {
        let old = self.hash::<u32, Local, _>(maps::LOCAL_VMS, |m| match m.get(&user_id, 0) {
            Ok(v) => Ok(Some(v)),
            Err(e) => ignore_missing(Err(e)).map(|()| None),
        })?;
        if let Some(old) = old {
            self.hash::<u32, u32, _>(maps::VETHS, |m| {
                if m.get(&old.ifindex, 0).ok() == Some(user_id) {
                    ignore_missing(m.remove(&old.ifindex))
                } else {
                    Ok(())
                }
            })?;
        }
        self.hash::<u32, u8, _>(maps::VIA_VMS, |m| ignore_missing(m.remove(&user_id)))?;
        self.hash::<u32, u8, _>(maps::GATEWAY_VMS, |m| ignore_missing(m.remove(&user_id)))?;
        self.hash::<u32, Local, _>(maps::LOCAL_VMS, |m| ignore_missing(m.remove(&user_id)))
    }

    /// Replaces the tenant-0 whitelist with `nets` (new entries first, then stale ones go),
    /// diffed against the kernel map's content. A tenant-0 VM whose mesh address lies in one of
    /// them crosses tenants.
    ///
    /// # Errors
    /// A map error.
    pub fn set_whitelist(&self, nets: &BTreeSet<Ipv6Net>) -> Result<(), MeshError> {
        let mut bpf = self.lock();
        let map = bpf.map_mut(maps::WHITELIST).ok_or(MeshError::Map {
            map: maps::WHITELIST,
            source: aya::maps::MapError::InvalidName {
                name: maps::WHITELIST.into(),
            },
        })?;
        let mut m = LpmTrie::<_, [u8; 16], u8>::try_from(map).map_err(map_err(maps::WHITELIST))?;
        let have: BTreeSet<(u32, [u8; 16])> = m
            .keys()
            .map(|k| k.map(|k| (k.prefix_len(), k.data())))
            .collect::<Result<_, _>>()
            .map_err(map_err(maps::WHITELIST))?;
        let want: BTreeSet<(u32, [u8; 16])> = nets
            .iter()
            .map(|n| (u32::from(n.prefix_len()), n.network().octets()))
            .collect();
        for (len, addr) in want.difference(&have) {
            m.insert(&Key::new(*len, *addr), 1, 0)
                .map_err(map_err(maps::WHITELIST))?;
        }
        for (len, addr) in have.difference(&want) {
            ignore_missing(m.remove(&Key::new(*len, *addr))).map_err(map_err(maps::WHITELIST))?;
        }
        Ok(())
    }

    /// The whitelist in the kernel map now, sorted.
    ///
    /// # Errors
    /// A map error.
    pub fn whitelist(&self) -> Result<BTreeSet<Ipv6Net>, MeshError> {
        let bpf = self.lock();
        let map = bpf.map(maps::WHITELIST).ok_or(MeshError::Map {
            map: maps::WHITELIST,
            source: aya::maps::MapError::InvalidName {
                name: maps::WHITELIST.into(),
            },
        })?;
        let m = LpmTrie::<_, [u8; 16], u8>::try_from(map).map_err(map_err(maps::WHITELIST))?;
        m.keys()
            .map(|k| {
                k.map(|k| {
                    let len = u8::try_from(k.prefix_len()).unwrap_or(128);
                    Ipv6Net::new(Ipv6Addr::from(k.data()), len).unwrap_or_default()
                })
            })
            .collect::<Result<_, _>>()
            .map_err(map_err(maps::WHITELIST))
    }

    fn blocks_map<T>(
        &self,
        f: impl FnOnce(&mut LpmTrie<&mut MapData, [u8; 16], Dest>) -> Result<T, aya::maps::MapError>,
    ) -> Result<T, MeshError> {
        let mut bpf = self.lock();
        let map = bpf.map_mut(maps::BLOCKS).ok_or(MeshError::Map {
            map: maps::BLOCKS,
            source: aya::maps::MapError::InvalidName {
                name: maps::BLOCKS.into(),
            },
        })?;
        let mut m = LpmTrie::try_from(map).map_err(map_err(maps::BLOCKS))?;
        f(&mut m).map_err(map_err(maps::BLOCKS))
    }

    /// Makes the public-block map `blocks` (block → the VM that owns it): new and changed
    /// entries written first, then stale ones removed, diffed against the kernel map. A packet
    /// from a VM to an address in a block on another host is carried there, and one arriving
    /// for a local VM's own block passes without the tenant check.
    ///
    /// # Errors
    /// [`MeshError::Invalid`] for a user id over [`MAX_USER_ID`]; a map error.
    pub fn set_blocks(&self, blocks: &BTreeMap<Ipv6Net, Location>) -> Result<(), MeshError> {
        if let Some((n, l)) = blocks.iter().find(|(_, l)| l.user_id > MAX_USER_ID) {
            return Err(MeshError::Invalid(format!(
                "block {n}: user_id {} does not fit the 20-bit flow label",
                l.user_id
            )));
        }
        let have = self.blocks()?;
        self.blocks_map(|m| {
            for (n, l) in blocks.iter().filter(|(n, l)| have.get(n) != Some(l)) {
                let v = Dest {
                    host: octets(l.host),
                    user_id: l.user_id,
                    tenant: l.tenant,
                };
                let key = Key::new(u32::from(n.prefix_len()), n.network().octets());
                m.insert(&key, v, 0)?;
            }
            for n in have.keys().filter(|n| !blocks.contains_key(n)) {
                let key = Key::new(u32::from(n.prefix_len()), n.network().octets());
                ignore_missing(m.remove(&key))?;
            }
            Ok(())
        })
    }

    /// The public-block map in the kernel now.
    ///
    /// # Errors
    /// A map error.
    pub fn blocks(&self) -> Result<BTreeMap<Ipv6Net, Location>, MeshError> {
        self.blocks_map(|m| {
            m.iter()
                .map(|r| {
                    r.map(|(k, v)| {
                        let len = u8::try_from(k.prefix_len()).unwrap_or(128);
                        (
                            Ipv6Net::new(Ipv6Addr::from(k.data()), len).unwrap_or_default(),
                            Location {
                                host: Ipv6Addr::from(v.host),
                                user_id: v.user_id,
                                tenant: v.tenant,
                            },
                        )
                    })
                })
                .collect()
        })
    }

    /// Makes the gateway map `gateways`: each (host mesh address, tenant) that runs a gateway
    /// VM of that tenant, diffed against the kernel map. A packet forwarded by a gateway VM
    /// (an inner source outside the mesh and every block) is accepted from a host only for a
    /// destination VM of a tenant that host has a gateway for.
    ///
    /// # Errors
    /// A map error.
    pub fn set_gateways(&self, gateways: &BTreeSet<(Ipv6Addr, u32)>) -> Result<(), MeshError> {
        let have = self.gateways()?;
        let key = |(h, t): &(Ipv6Addr, u32)| GwKey {
            host: octets(*h),
            tenant: *t,
        };
        self.hash::<GwKey, u8, _>(maps::GATEWAYS, |m| {
            for g in gateways.difference(&have) {
                m.insert(key(g), 1, 0)?;
            }
            for g in have.difference(gateways) {
                ignore_missing(m.remove(&key(g)))?;
            }
            Ok(())
        })
    }

    /// The gateway map in the kernel now: (host mesh address, tenant) pairs.
    ///
    /// # Errors
    /// A map error.
    pub fn gateways(&self) -> Result<BTreeSet<(Ipv6Addr, u32)>, MeshError> {
        self.hash::<GwKey, u8, _>(maps::GATEWAYS, |m| {
            m.keys()
                .map(|k| k.map(|k| (Ipv6Addr::from(k.host), k.tenant)))
                .collect()
        })
    }

    fn attach(&self, dev: &str, program: &'static str) -> Result<(), MeshError> {
        self.ifindex(dev)?;
        let mut guard = self.lock();
        let bpf: &mut Ebpf = &mut guard;
        let mut run = move || -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
            let prog: &mut SchedClassifier = bpf
                .program_mut(program)
                .ok_or_else(|| format!("no program {program}"))?
                .try_into()?;
            // An existing clsact qdisc (an earlier agent, other tools) is fine.
            let _ = aya::programs::tc::qdisc_add_clsact(dev);
            let opts = || {
                TcAttachOptions::Netlink(NlOptions {
                    priority: FILTER_PRIORITY,
                    handle: FILTER_HANDLE,
                    ..NlOptions::default()
                })
            };
            let kind = TcAttachType::Ingress;
            let id = match prog.attach_with_options(dev, kind, opts()) {
                Ok(id) => id,
                Err(first) => {
                    // A filter of an earlier agent: swap this program in atomically.
                    let old = SchedClassifierLink::attached(
                        dev,
                        kind,
                        FILTER_PRIORITY,
                        FILTER_HANDLE,
                        None,
                    )?;
                    prog.attach_to_link(old)
                        .map_err(|e| format!("{first}; replacing: {e}"))?
                }
            };
            // Released, not detached: the filter stays when this process exits.
            std::mem::forget(prog.take_link(id)?);
            Ok(())
        };
        let result = match &self.ns {
            Some(ns) => crate::netns::run_in(ns, run).map_err(MeshError::Netns)?,
            None => run(),
        };
        result.map_err(|source| MeshError::Attach {
            dev: dev.to_owned(),
            program,
            source,
        })
    }

    /// The kernel's id of this plane's VM-side program (`mesh_from_vm`): what a VM's filter
    /// runs when this plane attached it ([`super::filter::filter_program`] reads a filter's).
    ///
    /// # Errors
    /// [`MeshError::Invalid`] when the program is not loaded.
    pub fn vm_program_id(&self) -> Result<u32, MeshError> {
        self.program_id(FROM_VM)
    }

    /// The kernel's id of this plane's WireGuard-side program (`mesh_from_wg`), as
    /// [`Self::vm_program_id`].
    ///
    /// # Errors
    /// [`MeshError::Invalid`] when the program is not loaded.
    pub fn wg_program_id(&self) -> Result<u32, MeshError> {
        self.program_id(FROM_WG)
    }

    fn program_id(&self, name: &'static str) -> Result<u32, MeshError> {
        let bpf = self.lock();
        let prog: &SchedClassifier = bpf
            .program(name)
            .and_then(|p| p.try_into().ok())
            .ok_or_else(|| MeshError::Invalid(format!("no program {name}")))?;
        prog.info()
            .map(|i| i.id())
            .map_err(|e| MeshError::Invalid(format!("{name}: {e}")))
    }

    /// The ifindex of device `dev` in the plane's namespace.
    ///
    /// # Errors
    /// [`MeshError::NoDevice`].
    pub fn device_index(&self, dev: &str) -> Result<u32, MeshError> {
        self.ifindex(dev)
    }

    /// Attaches the VM-side program to the ingress of host veth end `veth` (replacing ours if
    /// present, next to any other filter).
    ///
    /// # Errors
    /// [`MeshError::NoDevice`] or [`MeshError::Attach`].
    pub fn attach_veth(&self, veth: &str) -> Result<(), MeshError> {
        self.attach(veth, FROM_VM)
    }

    /// Attaches the decapsulating program to the ingress of the WireGuard interface `wg`.
    ///
    /// # Errors
    /// [`MeshError::NoDevice`] or [`MeshError::Attach`].
    pub fn attach_wg(&self, wg: &str) -> Result<(), MeshError> {
        self.attach(wg, FROM_WG)
    }
}
