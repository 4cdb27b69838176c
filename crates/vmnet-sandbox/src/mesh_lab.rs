//! A mesh laboratory: fleet hosts ([`Fleet`]) each running `wireguard-go` over the shared
//! private network, with the mesh data plane ([`MeshPlane`]) on wg0 and on the host end of
//! each VM's veth pair. A "VM" is a namespace `<host prefix>x-vm<user id, 3 hex digits>`
//! (never a name an agent of that prefix derives, so its sweep leaves it alone) standing where
//! namespace mode puts the VM's namespace: its mesh address on the veth's peer end, the
//! mesh range routed to the host's link-local address, the host routing the VM's /128 to the
//! peer's link-local address (as `vmnet-plan`'s namespace topology does).
//!
//! The lab writes the data plane's maps directly (the locations the store would carry): tests
//! and benchmarks of the kernel side, without an agent. Everything is deleted on drop: the
//! `wireguard-go` processes, the bpffs mounted for the pins, and the fleet's namespaces.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use vmnet_agent::mesh::body::WgKey;
use vmnet_agent::mesh::keys::public_of;
use vmnet_kernel::mesh::{LocalVm, Location, MeshHost, MeshPlane, mount_bpffs, route};
use vmnet_kernel::netns::netlink_in;
use vmnet_kernel::wg::daemon::Daemon;
use vmnet_kernel::wg::link;
use vmnet_kernel::wg::sockbuf;
use vmnet_kernel::wg::uapi::{PeerChange, set_text};

use crate::fleet::{Fleet, HostNet};
use crate::{SandboxError, netns};

/// The VM MTU, which the mesh carries end to end.
pub const VM_MTU: u32 = 1380;
/// The WireGuard interface's MTU: the VM MTU plus the 40-byte outer header.
pub const WG_MTU: u32 = VM_MTU + 40;
/// The WireGuard listen port of every lab host.
pub const WG_PORT: u16 = 51820;
/// The host end's link-local address on every VM veth.
pub const HOST_LL: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);
/// The VM end's link-local address on every VM veth.
pub const VM_LL: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 2);

/// One lab host.
#[derive(Debug)]
pub struct LabHost {
    /// Its fleet host.
    pub net: HostNet,
    /// Its WireGuard interface.
    pub wg: String,
    /// Its mesh address, `fdaa::<index>`.
    pub mesh: Ipv6Addr,
    /// Its data plane.
    pub plane: MeshPlane,
    daemon: Daemon,
}

/// One lab VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabVm {
    /// The index of its host in [`MeshLab::hosts`].
    pub host: usize,
    /// Its namespace.
    pub ns: String,
    /// Its user id on its host.
    pub user_id: u32,
    /// Its tenant.
    pub tenant: u32,
    /// Its mesh address.
    pub mesh: Ipv6Addr,
    /// The host end of its veth pair.
    pub veth: String,
}

impl LabHost {
    /// The UDP sockets of its `wireguard-go` with their buffers, as they are.
    ///
    /// # Errors
    /// When the process's sockets cannot be read.
    pub fn socket_buffers(&self) -> Result<Vec<sockbuf::UdpSocket>, SandboxError> {
        self.daemon
            .read_sockets()
            .map_err(unexpected("wireguard socket buffers"))
    }
}

impl LabVm {
    /// Its location, as every host's data plane holds it.
    #[must_use]
    pub fn location(&self, hosts: &[LabHost]) -> Location {
        Location {
            host: hosts[self.host].mesh,
            user_id: self.user_id,
            tenant: self.tenant,
        }
    }
}

/// The laboratory; deleted on drop.
#[derive(Debug)]
pub struct MeshLab {
    /// The hosts, in fleet order.
    pub hosts: Vec<LabHost>,
    bpffs: BpffsMount,
    // Dropped last: the namespaces.
    fleet: Fleet,
}

fn io(what: &str) -> impl Fn(std::io::Error) -> SandboxError + '_ {
    move |e| SandboxError::io(what, e)
}

fn unexpected<E: std::fmt::Display>(what: &str) -> impl Fn(E) -> SandboxError + '_ {
    move |e| SandboxError::Unexpected(format!("{what}: {e}"))
}

fn random_key() -> Result<WgKey, SandboxError> {
    let mut k = [0u8; 32];
    let mut f = std::fs::File::open("/dev/urandom").map_err(io("open /dev/urandom"))?;
    std::io::Read::read_exact(&mut f, &mut k).map_err(io("read /dev/urandom"))?;
    Ok(WgKey(k))
}

fn block_on<T>(
    f: impl std::future::Future<Output = Result<T, SandboxError>>,
) -> Result<T, SandboxError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(io("tokio runtime"))?
        .block_on(f)
}

impl MeshLab {
    /// Builds `n` fleet hosts (2..=4) with WireGuard between all of them and the data plane
    /// loaded and attached to each wg0 (maps pinned in a bpffs mounted for the lab).
    ///
    /// # Errors
    /// When any step fails (after deleting what was made).
    pub fn new(n: usize) -> Result<Self, SandboxError> {
        Self::new_with(n, Some(sockbuf::DEFAULT_BYTES))
    }

    /// As [`MeshLab::new`], each `wireguard-go`'s UDP socket buffers sized to `socket_bytes`
    /// as the agent sizes them (`None`: left as `wireguard-go` sets them).
    ///
    /// # Errors
    /// When any step fails (after deleting what was made).
    pub fn new_with(n: usize, socket_bytes: Option<u32>) -> Result<Self, SandboxError> {
        let fleet = Fleet::new(n)?;
        let bpffs = BpffsMount::new(fleet.prefix())?;
        let mut lab = Self {
            hosts: Vec::new(),
            bpffs,
            fleet,
        };
        let mut keys = Vec::new();
        for net in lab.fleet.hosts().to_vec() {
            let (host, key) = lab.start_host(net, socket_bytes)?;
            lab.hosts.push(host);
            keys.push(key);
        }
        for (i, h) in lab.hosts.iter().enumerate() {
            let peers: Vec<PeerChange> = lab
                .hosts
                .iter()
                .zip(&keys)
                .filter(|(o, _)| o.net.index != h.net.index)
                .map(|(o, k)| PeerChange::Set {
                    key: public_of(&k.0).0,
                    endpoint: SocketAddr::new(IpAddr::V6(o.net.private_v6), WG_PORT),
                    allowed_ips: vec![ipnet::IpNet::V6(
                        ipnet::Ipv6Net::new(o.mesh, 128).expect("a /128 is valid"),
                    )],
                    keepalive: 0,
                })
                .collect();
            h.daemon
                .uapi()
                .set(&set_text(Some(&keys[i].0), Some(WG_PORT), &peers))
                .map_err(unexpected("wireguard set"))?;
            // As the agent does: the port set made the device open new sockets.
            h.daemon
                .size_sockets()
                .map_err(unexpected("wireguard socket buffers"))?;
            let others: Vec<Ipv6Addr> = lab
                .hosts
                .iter()
                .filter(|o| o.net.index != h.net.index)
                .map(|o| o.mesh)
                .collect();
            let (ns, wg) = (h.net.ns.clone(), h.wg.clone());
            block_on(async move {
                let nl = netlink_in(&ns).map_err(unexpected("netlink"))?;
                let l = link::by_name(&nl, &wg)
                    .await
                    .map_err(unexpected("wg link"))?
                    .ok_or_else(|| SandboxError::Unexpected(format!("{wg}: gone")))?;
                for o in others {
                    link::add_route(&nl, l.index, o)
                        .await
                        .map_err(unexpected("peer route"))?;
                }
                route::ensure_range_route(&nl, l.index, VM_MTU)
                    .await
                    .map_err(unexpected("mesh range route"))
            })?;
        }
        Ok(lab)
    }

    fn start_host(
        &self,
        net: HostNet,
        socket_bytes: Option<u32>,
    ) -> Result<(LabHost, WgKey), SandboxError> {
        let wg = format!("{}wg", net.prefix);
        let exe = PathBuf::from("wireguard-go");
        let daemon = Daemon::new(&wg, &exe, None).socket_buffers(socket_bytes);
        netns::run_in(&net.ns, || daemon.start())?.map_err(unexpected("start wireguard-go"))?;
        let mesh = Ipv6Addr::new(0xfdaa, 0, 0, 0, 0, 0, 0, u16::from(net.index));
        let (ns, wgc) = (net.ns.clone(), wg.clone());
        block_on(async move {
            let nl = netlink_in(&ns).map_err(unexpected("netlink"))?;
            let l = link::by_name(&nl, &wgc)
                .await
                .map_err(unexpected("wg link"))?
                .ok_or_else(|| SandboxError::Unexpected(format!("{wgc}: no link")))?;
            link::prepare(&nl, l, WG_MTU, Some(mesh))
                .await
                .map_err(unexpected("prepare wg"))
        })?;
        let pins = self.bpffs.dir(&format!("h{}", net.index))?;
        let plane = MeshPlane::load(Some(&net.ns), &pins).map_err(unexpected("load mesh"))?;
        plane
            .set_host(&MeshHost {
                mesh,
                vm_mtu: VM_MTU,
            })
            .map_err(unexpected("mesh host"))?;
        plane.attach_wg(&wg).map_err(unexpected("attach wg"))?;
        let key = random_key()?;
        Ok((
            LabHost {
                net,
                wg,
                mesh,
                plane,
                daemon,
            },
            key,
        ))
    }

    /// The private network's namespace (where a capture sees the hosts' traffic).
    #[must_use]
    pub fn private_ns(&self) -> String {
        self.fleet.private_ns()
    }

    /// The private network's port of host `i` (frames host `i` sends arrive on it there).
    #[must_use]
    pub fn private_port(&self, i: usize) -> String {
        format!("h{}", self.hosts[i].net.index)
    }

    /// Creates a VM on host `host` with `user_id` (below 0x1000), `tenant` and mesh address
    /// `mesh`, its veth at `mtu` bytes (the VM MTU, or more to test Packet Too Big), and
    /// registers it on host `host` only (see [`MeshLab::publish`]).
    ///
    /// # Errors
    /// As [`add_vm`].
    pub fn add_vm(
        &self,
        host: usize,
        user_id: u32,
        tenant: u32,
        mesh: Ipv6Addr,
        mtu: u32,
    ) -> Result<LabVm, SandboxError> {
        let h = &self.hosts[host];
        let spec = VmSpec {
            host,
            user_id,
            tenant,
            mesh,
            mtu,
        };
        add_vm(&h.plane, &h.net, h.mesh, &spec)
    }

    /// Writes `vm`'s location on every host.
    ///
    /// # Errors
    /// A map write failure.
    pub fn publish(&self, vm: &LabVm) -> Result<(), SandboxError> {
        for h in &self.hosts {
            h.plane
                .put_location(vm.mesh, &vm.location(&self.hosts))
                .map_err(unexpected("location"))?;
        }
        Ok(())
    }

    /// Waits until host `from` completes a WireGuard handshake with every other host (pings of
    /// their mesh addresses; the first packet of a tunnel waits for its handshake).
    ///
    /// # Errors
    /// [`SandboxError::Timeout`] when a host does not answer within 10 s.
    pub fn wait_tunnels(&self) -> Result<(), SandboxError> {
        for h in &self.hosts {
            for o in self.hosts.iter().filter(|o| o.net.index != h.net.index) {
                let mut ok = false;
                for _ in 0..10 {
                    let p = crate::traffic::ping(
                        &h.net.ns,
                        IpAddr::V6(o.mesh),
                        1,
                        Duration::from_secs(1),
                    )?;
                    if p.received == 1 {
                        ok = true;
                        break;
                    }
                }
                if !ok {
                    return Err(SandboxError::Timeout {
                        what: format!("wireguard {} -> {}", h.mesh, o.mesh),
                        timeout: Duration::from_secs(10),
                    });
                }
            }
        }
        Ok(())
    }
}

/// A bpffs mounted for a test at `<tmp>/vmnet-bpf-<tag>`, unmounted and removed on drop.
#[derive(Debug)]
pub struct BpffsMount(PathBuf);

impl BpffsMount {
    /// Mounts it.
    ///
    /// # Errors
    /// The `mkdir` or `mount` error.
    pub fn new(tag: &str) -> Result<Self, SandboxError> {
        let dir = std::env::temp_dir().join(format!("vmnet-bpf-{tag}"));
        mount_bpffs(&dir).map_err(io("mount bpffs"))?;
        Ok(Self(dir))
    }

    /// The mount point.
    #[must_use]
    pub fn path(&self) -> &std::path::Path {
        &self.0
    }

    /// A directory `name` in it (created).
    ///
    /// # Errors
    /// The `mkdir` error.
    pub fn dir(&self, name: &str) -> Result<PathBuf, SandboxError> {
        let d = self.0.join(name);
        std::fs::create_dir_all(&d).map_err(io("mkdir in bpffs"))?;
        Ok(d)
    }
}

impl Drop for BpffsMount {
    fn drop(&mut self) {
        // The pins go with the mount; the programs with the namespaces' links.
        let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What makes a lab VM (see [`add_vm`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmSpec {
    /// The index of its host (in the caller's host list).
    pub host: usize,
    /// Its user id (below 0x1000: it names the namespace and links).
    pub user_id: u32,
    /// Its tenant.
    pub tenant: u32,
    /// Its mesh address.
    pub mesh: Ipv6Addr,
    /// Its veth MTU.
    pub mtu: u32,
}

/// Creates the VM `spec` on fleet host `net` whose mesh address is `host_mesh`, and registers
/// it in `plane` (that host's data plane): the local VM, its location (this host), the program
/// on its veth.
///
/// # Errors
/// When a namespace, link, address or route cannot be made, or a map write fails.
pub fn add_vm(
    plane: &MeshPlane,
    net: &HostNet,
    host_mesh: Ipv6Addr,
    spec: &VmSpec,
) -> Result<LabVm, SandboxError> {
    let VmSpec {
        host,
        user_id,
        tenant,
        mesh,
        mtu,
    } = *spec;
    if user_id >= 0x1000 {
        return Err(SandboxError::Unexpected(format!(
            "lab vm user id {user_id}: at most 0xfff"
        )));
    }
    let hp = &net.prefix;
    let vm = LabVm {
        host,
        ns: format!("{hp}x-vm{user_id:03x}"),
        user_id,
        tenant,
        mesh,
        veth: format!("{hp}vh{user_id:03x}"),
    };
    let peer = format!("{hp}vp{user_id:03x}");
    netns::create(&vm.ns)?;
    for key in ["all", "default"] {
        netns::sysctl(&vm.ns, &format!("net/ipv6/conf/{key}/accept_dad"), "0")?;
    }
    let m = mtu.to_string();
    let hns = net.ns.as_str();
    netns::ip(
        hns,
        &[
            "link", "add", &vm.veth, "mtu", &m, "type", "veth", "peer", "name", &peer, "mtu", &m,
            "netns", &vm.ns,
        ],
    )?;
    let ll = |a: Ipv6Addr| format!("{a}/64");
    netns::ip(
        hns,
        &["addr", "add", &ll(HOST_LL), "dev", &vm.veth, "nodad"],
    )?;
    netns::ip(hns, &["link", "set", &vm.veth, "up"])?;
    let ns = vm.ns.as_str();
    netns::ip(ns, &["link", "set", "lo", "up"])?;
    netns::ip(ns, &["addr", "add", &ll(VM_LL), "dev", &peer, "nodad"])?;
    let m128 = format!("{mesh}/128");
    netns::ip(ns, &["addr", "add", &m128, "dev", &peer, "nodad"])?;
    netns::ip(ns, &["link", "set", &peer, "up"])?;
    let hll = HOST_LL.to_string();
    netns::ip(
        ns,
        &["-6", "route", "add", "fdaa::/16", "via", &hll, "dev", &peer],
    )?;
    let vll = VM_LL.to_string();
    netns::ip(
        hns,
        &["-6", "route", "add", &m128, "via", &vll, "dev", &vm.veth],
    )?;
    plane
        .put_local(&LocalVm {
            user_id,
            veth: vm.veth.clone(),
            tenant,
            mesh,
            via: VM_LL,
            // The lab's VMs route only the mesh range: no gateway lookups.
            routes_via_mesh: false,
            gateway: false,
        })
        .map_err(unexpected("local vm"))?;
    let loc = Location {
        host: host_mesh,
        user_id,
        tenant,
    };
    plane
        .put_location(mesh, &loc)
        .map_err(unexpected("location"))?;
    plane
        .attach_veth(&vm.veth)
        .map_err(unexpected("attach veth"))?;
    Ok(vm)
}

/// What one sized ICMPv6 echo request got back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SizedPing {
    /// The echo reply.
    Reply,
    /// An ICMPv6 Packet Too Big, with its MTU.
    TooBig(u32),
    /// Nothing within the wait.
    Nothing,
}

/// Sends one ICMPv6 echo request of `total` bytes (IPv6 header included, never fragmented)
/// from namespace `ns` to `target` and waits up to `wait` for the reply or a Packet Too Big.
///
/// # Errors
/// When the namespace or the raw socket fails, or `total` is below 48.
pub fn ping6_sized(
    ns: &str,
    target: Ipv6Addr,
    total: usize,
    wait: Duration,
) -> Result<SizedPing, SandboxError> {
    use std::os::fd::AsRawFd;

    use nix::sys::socket::{
        AddressFamily, MsgFlags, SockFlag, SockProtocol, SockType, SockaddrIn6, SockaddrStorage,
        recvfrom, sendto, socket,
    };
    if total < 48 {
        return Err(SandboxError::Unexpected(format!("ping of {total} bytes")));
    }
    let what = format!("netns {ns}: ping {target} with {total} bytes");
    let run = || -> nix::Result<SizedPing> {
        let fd = socket(
            AddressFamily::Inet6,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::IcmpV6,
        )?;
        let one: libc::c_int = 1;
        let tv = libc::timeval {
            tv_sec: 0,
            tv_usec: 20_000,
        };
        // SAFETY: valid option values of the sizes given, on an open socket.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::IPPROTO_IPV6,
                libc::IPV6_DONTFRAG,
                std::ptr::from_ref(&one).cast(),
                4,
            );
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                std::ptr::from_ref(&tv).cast(),
                u32::try_from(std::mem::size_of::<libc::timeval>()).unwrap_or(16),
            );
        }
        let id = u16::try_from(std::process::id() & 0xffff).unwrap_or(0) ^ 0x6d65;
        let mut pkt = vec![128u8, 0, 0, 0];
        pkt.extend(id.to_be_bytes());
        pkt.extend([0, 1]);
        pkt.resize(total - 40, 0x6d);
        let dst = SockaddrIn6::from(std::net::SocketAddrV6::new(target, 0, 0, 0));
        sendto(fd.as_raw_fd(), &pkt, &dst, MsgFlags::empty())?;
        let deadline = std::time::Instant::now() + wait;
        let mut buf = vec![0u8; 4096];
        while std::time::Instant::now() < deadline {
            let Ok((n, _)) = recvfrom::<SockaddrStorage>(fd.as_raw_fd(), &mut buf) else {
                continue;
            };
            let m = &buf[..n];
            if m.len() >= 8 && m[0] == 129 && m[4..6] == id.to_be_bytes() {
                return Ok(SizedPing::Reply);
            }
            // A Packet Too Big quotes our request: IPv6 header (40) then our ICMPv6 header.
            if m.len() >= 56 && m[0] == 2 && m[48] == 128 && m[52..54] == id.to_be_bytes() {
                return Ok(SizedPing::TooBig(u32::from_be_bytes([
                    m[4], m[5], m[6], m[7],
                ])));
            }
        }
        Ok(SizedPing::Nothing)
    };
    netns::run_in(ns, run)?.map_err(|e| SandboxError::errno(what, e))
}

impl Drop for MeshLab {
    fn drop(&mut self) {
        for h in &self.hosts {
            h.daemon.stop();
        }
        self.hosts.clear();
    }
}
