//! The mesh's WireGuard peers (`POST /v1/sync`, `GET /v1/mesh`): the body and its validation
//! ([`body`]), the plan of a sync ([`plan`]).

pub mod body;
pub mod plan;
