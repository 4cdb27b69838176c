//! The vmnet agent: the reconcile loop of namespace mode, the HTTP API (unix socket) over the
//! store, the client the CLI uses, and the host spec format.
//!
//! The modules, leaves first (no module uses one listed after it):
//! * [`status`] — the status and VM bodies the agent reports, and the clock of their times.
//! * [`activity`] — the packet-activity reports and their idle-time rule.
//! * [`table`] — the text table renderer.
//! * [`pool`] — pool mode on this host: NICs, seeds and the bcd tables.
//! * [`provider`] — provider pools: the Hetzner Cloud and Proxmox VE clients and the poller.
//! * [`metadata`] — the metadata service (MMDS) served inside every VM's netns.
//! * [`worker`] — the unprivileged process that serves the metadata service and sends the
//!   provider polls.
//! * [`events`] — the event bus, its kinds and the `GET /v1/events` stream.
//! * [`agent`] — the agent's state and the VM operations (store + driver, serialized).
//! * [`reconcile`] — the full pass and the background loop.
//! * [`health`] — the loops' heartbeats, `GET /healthz` and `GET /readyz`.
//! * [`metrics`] — `GET /metrics`: what the agent observes and a snapshot per scrape.
//! * [`notify`] — systemd's `READY=1`, `WATCHDOG=1`, `STATUS=`, `STOPPING=1`.
//! * [`api`] — routes, error mapping, request/response types; `openapi.json` documents it.
//! * [`server`] — binding the unix socket and checking who connects.
//! * [`client`] — the API client over the unix socket.
//! * [`hostspec`] and [`apply`] — the file `vmnet apply` takes and applying it.

pub mod activity;
pub mod agent;
pub mod api;
pub mod apply;
pub mod client;
pub mod events;
pub mod health;
pub mod hostspec;
pub mod malloc;
pub mod mesh;
pub mod metadata;
pub mod metrics;
pub mod notify;
pub mod pool;
pub mod provider;
pub mod public;
pub mod reconcile;
pub mod repairs;
pub mod server;
pub mod status;
pub mod table;
pub mod wake;
pub mod watch;
pub mod worker;
