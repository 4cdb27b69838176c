//! The vmnet agent: the reconcile loop of namespace mode, the HTTP API (unix socket, optional
//! loopback TCP) over the store, the client the CLI uses, and the host spec format.
//!
//! * [`api`] — routes, error mapping, request/response types; `openapi.json` documents it.
//! * [`client`] — the API client over the unix socket.
//! * [`hostspec`] — the file `vmnet apply` takes.
//! * [`server`] — binding the unix socket and the loopback TCP port.

pub mod api;
pub mod apply;
pub mod client;
pub mod hostspec;
pub mod pool;
pub mod server;
