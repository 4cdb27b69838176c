//! Request and response bodies of the API that the agent defines itself (the IPAM results are
//! the store's own types, serialized as they are). All request bodies refuse unknown fields.
//! Times are milliseconds since the Unix epoch (`*_unix_ms`).

use serde::{Deserialize, Serialize};

/// Body of `PUT /v1/pools/{id}/range`: the pool's IPv4 range.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolRange {
    /// The IPv4 network, e.g. `10.0.0.0/24` (no host bits). IPv6 is refused.
    pub cidr: String,
    /// The gateway address; never leased, may lie outside the range.
    pub gateway: String,
    /// The first address to lease (default: the address after the gateway).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_host: Option<String>,
    /// The last address to lease (default: the address before the broadcast address).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_host: Option<String>,
    /// DNS servers for the guests, IPv4 or IPv6 (default: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns: Option<Vec<String>>,
}

/// Body of `PUT /v1/hosts/{id}`: schedulable capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostCapacity {
    /// vCPUs (0 to 2^32-1).
    pub vcpus: u32,
    /// Memory in MiB (0 to 2^32-1).
    pub memory_mib: u32,
}
