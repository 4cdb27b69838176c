//! Domain types with validation for vmnet: error codes, pool ranges, leases, instances and NICs
//! (pool mode), and the VM network config (namespace mode).
//!
//! Everything here is plain data with `FromStr`/`Display`/serde at the edge and validation that
//! returns a [`ValidationError`] (`INVALID_INPUT` at the edge). No I/O.

pub mod error;
pub mod ids;
pub mod json;
pub mod nic;
pub mod pool;
pub mod vm;

pub use error::{Error, ErrorCode, ValidationError};
