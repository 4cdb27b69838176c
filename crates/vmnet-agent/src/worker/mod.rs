//! The unprivileged worker: the one process that parses input from guests (the metadata
//! service's HTTP) and from the internet (the provider APIs' answers), apart from the root
//! agent that holds netlink, nf_tables and BPF (threat model: "code that parses input from
//! guests or the internet runs with the least privilege that can do the job").
//!
//! # Design
//! - The worker is the `vmnet` binary run as `vmnet serve --worker-serve UID:GID`, started by
//!   the agent with one end of a socketpair as descriptor 3 ([`supervisor`]). Before anything
//!   else it closes every other descriptor, becomes the worker user (`--worker-user`, default
//!   [`confine::DEFAULT_USER`]) with no capability in any set, sets `no_new_privs` and installs
//!   a seccomp filter that kills it on any system call outside its allow-list ([`confine`]).
//!   It never sees the store, its credentials, the WireGuard key or any file the agent reads.
//! - The agent keeps making each VM's listening socket inside the VM's netns and passes a
//!   copy to the worker over `SCM_RIGHTS`; the two talk over the socketpair with a small typed
//!   protocol ([`proto`]): documents and listeners one way, provider polls both ways. The
//!   worker can answer the polls the agent asked for and nothing more; the agent checks each
//!   answer against its job ([`check`]) and ends a worker that breaks the protocol.
//! - The provider poller stays in the agent for everything that touches the store or a
//!   secret's file: it reads the pool and its machines, reads the secret from the credentials
//!   directory, and hands the worker the ready `Authorization` header; the worker sends the
//!   requests and parses the answers; the agent writes the checked result.
//! - A worker that dies (killed, crashed, or killed by its seccomp filter) is started again at
//!   once and handed every listener and document again; the listeners stayed open in the
//!   agent, so guests' new connections wait in their queues meanwhile, and their session tokens
//!   stay valid ([`crate::metadata::tokens`]).
//!
//! # Limitations
//! The worker shares the agent's network namespace (it reaches the providers from where the
//! agent would) and its file system view; the seccomp filter lets it open files read-only (the
//! C resolver reads `/etc/hosts`, `/etc/resolv.conf` and the name service's libraries), as its
//! own user, which cannot read the store, the credentials directory or the key files.

pub mod check;
pub mod child;
pub mod confine;
pub mod launch;
pub mod proto;
pub mod supervisor;
pub mod table;

pub use confine::{DEFAULT_USER, WorkerUser};
pub use launch::{WorkerSettings, command, command_with, vmnet_exe};
pub use supervisor::Worker;
pub use table::Change;
