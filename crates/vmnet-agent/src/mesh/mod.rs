//! The mesh's WireGuard peers (`POST /v1/sync`, `GET /v1/mesh`): the body and its validation
//! ([`body`]), the plan of a sync ([`plan`]), the host key ([`keys`]), the supervised device and
//! its convergence ([`runtime`]) and the API bodies ([`view`]).

pub mod body;
pub mod conflicts;
pub mod dataplane;
pub mod keys;
mod known;
mod localvm;
pub mod locations;
pub mod plan;
pub mod registry;
pub mod runtime;
pub mod view;
mod wanted;
