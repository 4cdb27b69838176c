//! Provider pools in the agent (spec: hosted-pool-networking.md, the table of pools,
//! "Provider", and "Addresses on an instance", provider pools): the HTTP clients of Hetzner
//! Cloud and Proxmox VE, and the poller that replaces each machine's `Instance.addresses` with
//! what its provider reports.
//!
//! - [`http`]: one GET with the pool's credentials, a timeout, `429` + `Retry-After` honoured,
//!   and the body parsed into a typed struct (unknown fields ignored); every failure a
//!   [`PollError`].
//! - [`hetzner`]: Hetzner Cloud API v1, `GET /servers` with pagination.
//! - [`proxmox`]: Proxmox VE API2 JSON, `GET /cluster/resources?type=vm`, then the guest agent
//!   of each running VM that has one.
//! - [`fetch`]: who sends a poll's requests: the unprivileged metadata worker in the agent.
//! - [`poller`]: every pool's interval, one poll per pool; the results go to the store, the
//!   pool's state to `GET /v1/status`.
//!
//! The secret is read at every poll from the file (inside the agent's credentials directory) or
//! environment variable the pool names ([`Secret::read`]), sent only in the `Authorization`
//! header (marked sensitive) of requests to the pool's `https://` API and never stored, answered
//! or logged: its `Debug` form is `Secret(..)` and its memory is zeroed when dropped.

pub mod fetch;
pub mod hetzner;
pub mod http;
pub mod poller;
pub mod proxmox;
pub mod secret;

pub use secret::Secret;

use std::net::IpAddr;

use ipnet::IpNet;

/// Why a poll (of a whole pool, or of one machine) failed. The message names the pool's
/// provider or the URL, never the secret. Serialisable: the metadata worker sends it to the
/// agent ([`crate::worker::proto`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum PollError {
    /// The secret cannot be read (file missing or unreadable, variable unset, empty, or not a
    /// valid header value).
    #[error("{0}")]
    Credentials(String),
    /// The provider answered `401` or `403`: the credentials are wrong or lack a permission.
    #[error("{what} answered {status}: the credentials were refused")]
    Auth {
        /// The request, e.g. `GET http://…/servers?page=1&per_page=50`.
        what: String,
        /// 401 or 403.
        status: u16,
    },
    /// The provider kept answering `429` (or asked to wait longer than the poller waits).
    #[error("{what} answered 429 Too Many Requests; retry after {retry_after_secs} s")]
    RateLimited {
        /// The request.
        what: String,
        /// What `Retry-After` asked for, seconds.
        retry_after_secs: u64,
    },
    /// Another unsuccessful status (a `500`, a `404` of an unknown node, …).
    #[error("{what} answered {status}")]
    Status {
        /// The request.
        what: String,
        /// The HTTP status.
        status: u16,
    },
    /// No answer within the request timeout.
    #[error("{what}: no answer within {timeout_ms} ms")]
    Timeout {
        /// The request.
        what: String,
        /// The timeout, ms.
        timeout_ms: u64,
    },
    /// The provider could not be reached (connection refused, DNS, TLS).
    #[error("{what}: {why}")]
    Unreachable {
        /// The request.
        what: String,
        /// The transport error.
        why: String,
    },
    /// The agent's rules refuse the pool (`api_url` not `https://` without
    /// `--allow-plain-http-providers`, see [`vmnet_model::pool::ProviderRules`]).
    #[error("{0}")]
    Refused(String),
    /// The answer is not the documented JSON shape.
    #[error("{what}: the answer is not the documented JSON: {why}")]
    Malformed {
        /// The request.
        what: String,
        /// The parser's words.
        why: String,
    },
}

impl PollError {
    /// The kind as `GET /v1/status` shows it: `credentials`, `auth`, `rate_limited`, `status`,
    /// `timeout`, `unreachable`, `refused` or `malformed`.
    #[must_use]
    pub const fn kind(&self) -> &'static str {
        match self {
            Self::Credentials(_) => "credentials",
            Self::Auth { .. } => "auth",
            Self::RateLimited { .. } => "rate_limited",
            Self::Status { .. } => "status",
            Self::Timeout { .. } => "timeout",
            Self::Unreachable { .. } => "unreachable",
            Self::Refused(_) => "refused",
            Self::Malformed { .. } => "malformed",
        }
    }

    /// Whether the credentials are at fault (unreadable, or refused with 401/403).
    #[must_use]
    pub const fn is_auth(&self) -> bool {
        matches!(self, Self::Credentials(_) | Self::Auth { .. })
    }
}

/// Whether a reported address is kept in `Instance.addresses`: loopback (`127.0.0.0/8`, `::1`),
/// link-local (`169.254.0.0/16`, `fe80::/10`) and unspecified (`0.0.0.0`, `::`) addresses are
/// dropped (spec: "without loopback and link-local ones").
#[must_use]
pub fn keep_address(a: IpAddr) -> bool {
    match a {
        IpAddr::V4(v4) => !(v4.is_loopback() || v4.is_link_local() || v4.is_unspecified()),
        IpAddr::V6(v6) => !(v6.is_loopback() || v6.is_unicast_link_local() || v6.is_unspecified()),
    }
}

/// Appends `net` to `out` unless it is dropped ([`keep_address`]) or listed already.
pub fn push_address(out: &mut Vec<IpNet>, net: IpNet) {
    if keep_address(net.addr()) && !out.contains(&net) {
        out.push(net);
    }
}

/// What one poll of a pool found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PollReport {
    /// Per machine (every machine of the pool, in instance order): its addresses now, or
    /// `None` when this machine's own call failed (see `errors`).
    pub results: Vec<vmnet_ipam::MachinePoll>,
    /// Instances whose machine the provider does not list (their addresses are replaced with
    /// none).
    pub missing: Vec<String>,
    /// Per-machine failures (Proxmox's guest agent calls), as `(instance id, error)`.
    pub errors: Vec<(String, PollError)>,
    /// HTTP requests the poll sent (retries after `429` included).
    pub requests: u64,
}

pub use crate::status::{ProviderPoolState, ProviderPoolStatus};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_link_local_and_unspecified_are_dropped() {
        for a in [
            "127.0.0.1",
            "::1",
            "169.254.3.4",
            "fe80::1",
            "0.0.0.0",
            "::",
        ] {
            assert!(!keep_address(a.parse().unwrap()), "{a}");
        }
        for a in [
            "10.0.0.2",
            "203.0.113.5",
            "2001:db8::5",
            "fd00::1",
            "100.64.0.1",
        ] {
            assert!(keep_address(a.parse().unwrap()), "{a}");
        }
        let mut out = Vec::new();
        push_address(&mut out, "10.0.0.2/24".parse().unwrap());
        push_address(&mut out, "10.0.0.2/24".parse().unwrap());
        push_address(&mut out, "fe80::1/64".parse().unwrap());
        assert_eq!(out, vec!["10.0.0.2/24".parse::<IpNet>().unwrap()]);
    }
}
