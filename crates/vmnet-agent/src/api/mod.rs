//! The HTTP API: routes, the documented error body, request and response types.

pub mod error;
pub mod types;
