//! The main job's world, for `vmnet-lab up --sandbox` and for the tests: throwaway namespaces that
//! stand in for a hypervisor host, the internet and the guests, and the checks that send real
//! packets through them.
//!
//! - [`sandbox::Sandbox`]: a sandbox host namespace and a fake internet namespace joined by an
//!   uplink veth (documentation addresses), plus extra namespaces, all deleted on `Drop`.
//! - [`fleet::Fleet`]: 1-4 sandbox hosts sharing one fake internet (each with its own uplink
//!   and public block) and one private network (a bridge), all deleted on `Drop`.
//! - [`echo::EchoService`]: TCP and UDP echo threads inside a namespace that report the peer
//!   address they saw and the MSS of the TCP SYN.
//! - [`relay::Relay`] and [`guest`]: a simulated guest joined to a VM's tap by a frame relay
//!   that opens the tap the way a VMM does; [`sim_guest`]: a pool-mode guest configured from its
//!   NoCloud seed; [`probe`]: raw frames sent and captured on a link; [`hostile`]: spoofed
//!   frames from a guest, looked for where they would arrive.
//! - [`mmds`]: raw requests to the metadata service from inside a guest namespace.
//! - [`traffic`]: TCP/UDP echo clients, ICMP ping and command runs inside a namespace, each with
//!   a timeout.
//! - [`kvm`]: real guests (`--guests kvm`): qemu on the VMs' taps, the guest image, the command
//!   channel and the pool-mode checks run inside the guests.
//! - [`udpstat`]: a namespace's UDP buffer-error counters.
//! - [`postgres`]: a throwaway PostgreSQL cluster on a unix socket.
//! - [`exe`]: the programs the lab starts (the product's `vmnet`, the lab's own helpers).
//! - [`agent`]: the agent (`vmnet serve --netns …`) as a child process, ready when its API
//!   answers, stopped by its pid on drop; the one start-up routine of the jobs, benchmarks and
//!   root tests; [`agent_args`]: the extra flags `up --agent-arg` gives every agent, and their
//!   command lines as printed; [`worker_user`]: the agent's worker user, made when missing.
//! - [`ns_job`], [`pool_job`] and [`fleet_job`]: `vmnet-lab up --sandbox` for a namespace-mode host
//!   spec, a pool-mode spec and a fleet spec (several hosts), with [`state`] (the sandbox's state directory, its processes and signals)
//!   and [`helper`] (the relay and echo processes the sandbox runs in the background).
//!
//! # Design
//! Namespaces are named (`/run/netns/<name>`) and made with `ip netns add`, so `ip -n` works on
//! them. Code that must run inside one runs on a dedicated thread that called `setns(2)`; the
//! calling thread never changes namespace.
//!
//! # Limitations
//! Needs root (`CAP_NET_ADMIN`, `CAP_SYS_ADMIN` for `setns`).

pub mod agent;
pub mod agent_args;
pub mod args;
pub mod attach;
pub mod echo;
pub mod exe;
pub mod fleet;
pub mod fleet_job;
pub mod guest;
pub mod helper;
pub mod hostile;
pub mod kvm;
pub mod mesh_lab;
pub mod mmds;
pub mod netns;
pub mod ns_job;
pub mod pool_job;
pub mod postgres;
pub mod probe;
pub mod relay;
pub mod sandbox;
pub mod sim_guest;
pub mod state;
pub mod tap;
pub mod teardown;
pub mod traffic;
pub mod udpstat;
pub mod up;
pub mod uplink;
pub mod worker_user;

mod error;

pub use error::SandboxError;
pub use fleet::Fleet;
pub use sandbox::Sandbox;
