//! Provider pools (spec: hosted-pool-networking.md, the table of pools, "Provider (`provider`)",
//! and "Addresses on an instance", provider pools). Re-exported from [`crate::pool`].
//!
//! A provider pool leases nothing: its instances are machines at a provider (a Hetzner Cloud
//! server, a Proxmox VE QEMU VM), and their `addresses` are what the provider reports for the
//! machine, replaced on every poll. The pool names the provider, the API base URL, where the
//! credentials are (a file or an environment variable of the agent, never the secret itself) and
//! how often to poll.
//!
//! Everything here is pure: [`SetProviderPool::validate`] turns the caller's strings into a
//! [`ProviderPool`], [`Machine::validate`] checks an instance's machine against its pool's
//! provider. Errors are `INVALID_INPUT` naming the pool (or instance) and the field.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::ValidationError;
use crate::ids::validate_id;

/// The poll interval when the request does not give one: 30 seconds.
pub const DEFAULT_POLL_INTERVAL_SECS: u32 = 30;

/// The shortest poll interval accepted: 5 seconds (Hetzner Cloud allows 3,600 requests per hour
/// and project; 1,000 servers cost 20 list requests a poll).
pub const MIN_POLL_INTERVAL_SECS: u32 = 5;

/// The longest poll interval accepted: 86,400 seconds (a day).
pub const MAX_POLL_INTERVAL_SECS: u32 = 86_400;

/// Hetzner Cloud's documented API endpoint, the default `api_url` of a `hetzner-cloud` pool.
pub const HETZNER_API_URL: &str = "https://api.hetzner.cloud/v1";

/// The longest `api_url`, credentials path or variable name accepted, in bytes.
pub const MAX_SETTING_LEN: usize = 512;

/// Which provider a pool's machines live at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Provider {
    /// Hetzner Cloud (API v1): `hetzner-cloud`.
    #[serde(rename = "hetzner-cloud")]
    HetznerCloud,
    /// Proxmox VE (API2 JSON): `proxmox-ve`.
    #[serde(rename = "proxmox-ve")]
    ProxmoxVe,
}

impl Provider {
    /// Every provider, in the order the docs list them.
    pub const ALL: [Self; 2] = [Self::HetznerCloud, Self::ProxmoxVe];

    /// The name in JSON, SQL and the CLI: `hetzner-cloud` or `proxmox-ve`.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::HetznerCloud => "hetzner-cloud",
            Self::ProxmoxVe => "proxmox-ve",
        }
    }
}

impl fmt::Display for Provider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Provider {
    type Err = ValidationError;
    /// Parses the name.
    ///
    /// # Errors
    /// `INVALID_INPUT`: `provider "aws" is not one of hetzner-cloud, proxmox-ve`.
    fn from_str(s: &str) -> Result<Self, ValidationError> {
        Self::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| {
                ValidationError::rule(format!(
                    "provider {s:?} is not one of hetzner-cloud, proxmox-ve"
                ))
            })
    }
}

/// Where the agent reads a provider pool's secret, at every poll. JSON:
/// `{"file": "/etc/vmnet/credentials/hcloud.token"}` or `{"env": "HCLOUD_TOKEN"}`. The secret
/// itself is never stored, answered or logged.
///
/// The secret is, for Hetzner Cloud, the project's API token (sent as `Authorization: Bearer
/// <token>`); for Proxmox VE, the API token as `USER@REALM!TOKENID=SECRET` (sent as
/// `Authorization: PVEAPIToken=USER@REALM!TOKENID=SECRET`). Surrounding whitespace (a file's
/// trailing newline) is ignored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Credentials {
    /// An absolute path of a file the agent can read.
    File(String),
    /// The name of an environment variable of the agent (`[A-Za-z_][A-Za-z0-9_]*`).
    Env(String),
}

impl Credentials {
    /// Checks the path (absolute, no NUL, at most [`MAX_SETTING_LEN`] bytes) or the variable name.
    ///
    /// # Errors
    /// `INVALID_INPUT` naming `credentials.file` or `credentials.env`, prefixed with `what`
    /// (e.g. `pool hz`).
    pub fn validate(&self, what: &str) -> Result<(), ValidationError> {
        match self {
            Self::File(p) => {
                if p.len() > MAX_SETTING_LEN || !p.starts_with('/') || p.contains('\0') {
                    return Err(ValidationError::rule(format!(
                        "{what}: credentials.file {p:?} must be an absolute path of at most {MAX_SETTING_LEN} bytes"
                    )));
                }
            }
            Self::Env(n) => {
                let ok = !n.is_empty()
                    && n.len() <= MAX_SETTING_LEN
                    && !n.as_bytes()[0].is_ascii_digit()
                    && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
                if !ok {
                    return Err(ValidationError::rule(format!(
                        "{what}: credentials.env {n:?} must be an environment variable name ([A-Za-z_][A-Za-z0-9_]*)"
                    )));
                }
            }
        }
        Ok(())
    }
}

impl fmt::Display for Credentials {
    /// `file /etc/vmnet/credentials/hcloud.token` or `env HCLOUD_TOKEN` (never the secret).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::File(p) => write!(f, "file {p}"),
            Self::Env(n) => write!(f, "env {n}"),
        }
    }
}

/// The request that makes a pool a provider pool (`PUT /v1/pools/{id}/provider`, `vmnet pool
/// set POOL --provider …`), as the caller gives it. Check it with [`SetProviderPool::validate`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetProviderPool {
    /// The pool.
    pub pool_id: String,
    /// `hetzner-cloud` or `proxmox-ve`.
    pub provider: String,
    /// The API base URL the request paths are appended to: for Hetzner Cloud the v1 endpoint
    /// (default [`HETZNER_API_URL`]), for Proxmox VE the API2 JSON root of a cluster node, e.g.
    /// `https://pve1.example.com:8006/api2/json` (required).
    #[serde(default)]
    pub api_url: Option<String>,
    /// Where the secret is.
    pub credentials: Credentials,
    /// Seconds between polls, [`MIN_POLL_INTERVAL_SECS`] to [`MAX_POLL_INTERVAL_SECS`]
    /// (default [`DEFAULT_POLL_INTERVAL_SECS`]).
    #[serde(default)]
    pub poll_interval_secs: Option<u32>,
}

/// A provider pool's settings, validated (what the store keeps and `GET /v1/pools/{id}` shows
/// as `provider`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderPool {
    /// The pool.
    pub pool_id: String,
    /// The provider.
    pub provider: Provider,
    /// The API base URL, without a trailing `/` (see [`SetProviderPool::api_url`]).
    pub api_url: String,
    /// Where the secret is (never the secret).
    pub credentials: Credentials,
    /// Seconds between polls.
    pub poll_interval_secs: u32,
}

impl SetProviderPool {
    /// Validates the request and fills in the defaults.
    ///
    /// # Errors
    /// `INVALID_INPUT` naming the pool and the field, e.g.
    /// `pool hz: provider "aws" is not one of hetzner-cloud, proxmox-ve`,
    /// `pool pve: api_url is required for a proxmox-ve pool`,
    /// `pool hz: api_url "ftp://x" must be an http:// or https:// URL with a host, without user, query or fragment`,
    /// `pool hz: credentials.env "1X" must be an environment variable name ([A-Za-z_][A-Za-z0-9_]*)`,
    /// `pool hz: poll_interval_secs 1 must be between 5 and 86400`.
    pub fn validate(&self) -> Result<ProviderPool, ValidationError> {
        validate_id("pool_id", &self.pool_id)?;
        let what = format!("pool {}", self.pool_id);
        let provider: Provider = self
            .provider
            .parse()
            .map_err(|e: ValidationError| ValidationError::rule(format!("{what}: {e}")))?;
        let api_url = match (&self.api_url, provider) {
            (Some(u), _) => validate_url(&what, u)?,
            (None, Provider::HetznerCloud) => HETZNER_API_URL.to_owned(),
            (None, Provider::ProxmoxVe) => {
                return Err(ValidationError::rule(format!(
                    "{what}: api_url is required for a proxmox-ve pool (e.g. https://pve1.example.com:8006/api2/json)"
                )));
            }
        };
        self.credentials.validate(&what)?;
        let poll_interval_secs = self
            .poll_interval_secs
            .unwrap_or(DEFAULT_POLL_INTERVAL_SECS);
        if !(MIN_POLL_INTERVAL_SECS..=MAX_POLL_INTERVAL_SECS).contains(&poll_interval_secs) {
            return Err(ValidationError::rule(format!(
                "{what}: poll_interval_secs {poll_interval_secs} must be between {MIN_POLL_INTERVAL_SECS} and {MAX_POLL_INTERVAL_SECS}"
            )));
        }
        Ok(ProviderPool {
            pool_id: self.pool_id.clone(),
            provider,
            api_url,
            credentials: self.credentials.clone(),
            poll_interval_secs,
        })
    }
}

/// Checks an API base URL: `http` or `https`, a host, no user or password (a secret in the URL
/// would be stored and shown), no query or fragment; returns it without a trailing `/`.
fn validate_url(what: &str, raw: &str) -> Result<String, ValidationError> {
    let bad = || {
        ValidationError::rule(format!(
            "{what}: api_url {raw:?} must be an http:// or https:// URL with a host, without user, query or fragment"
        ))
    };
    if raw.len() > MAX_SETTING_LEN {
        return Err(bad());
    }
    let u = url::Url::parse(raw).map_err(|_| bad())?;
    let ok = matches!(u.scheme(), "http" | "https")
        && u.host_str().is_some_and(|h| !h.is_empty())
        && u.username().is_empty()
        && u.password().is_none()
        && u.query().is_none()
        && u.fragment().is_none();
    if !ok {
        return Err(bad());
    }
    Ok(u.as_str().trim_end_matches('/').to_owned())
}

/// The largest Proxmox VE vmid: 999,999,999 (Proxmox's own bound; the smallest is 100).
pub const MAX_PROXMOX_VMID: u32 = 999_999_999;

/// The machine an instance of a provider pool is (`machine` in `POST /v1/instances`; `null` for
/// an instance of a hosted pool). JSON: `{"server_id": 42}` (Hetzner Cloud) or `{"node": "pve1",
/// "vmid": 100}` (Proxmox VE). Which fields are needed depends on the pool's provider; check it
/// with [`Machine::validate`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Machine {
    /// The Hetzner Cloud server id (1 to 2^63-1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_id: Option<u64>,
    /// The Proxmox VE node the VM is on (a host name: 1 to 63 bytes of `[A-Za-z0-9-]`, not
    /// starting or ending with `-`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// The Proxmox VE vmid (100 to [`MAX_PROXMOX_VMID`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vmid: Option<u32>,
}

impl Machine {
    /// A Hetzner Cloud server.
    #[must_use]
    pub fn hetzner(server_id: u64) -> Self {
        Self {
            server_id: Some(server_id),
            ..Self::default()
        }
    }

    /// A Proxmox VE QEMU VM.
    #[must_use]
    pub fn proxmox(node: impl Into<String>, vmid: u32) -> Self {
        Self {
            node: Some(node.into()),
            vmid: Some(vmid),
            ..Self::default()
        }
    }

    /// Checks that the machine is one of `provider`'s: Hetzner Cloud needs `server_id` alone,
    /// Proxmox VE `node` and `vmid` alone.
    ///
    /// # Errors
    /// `INVALID_INPUT` naming the instance and the field, e.g.
    /// `instance vm1: machine.server_id is required for an instance of a hetzner-cloud pool`,
    /// `instance vm1: machine.node is not used by a hetzner-cloud pool`,
    /// `instance vm1: machine.vmid 7 must be between 100 and 999999999`,
    /// `instance vm1: machine.node "-a" must be a host name (1 to 63 bytes of A-Z a-z 0-9 -, not starting or ending with -)`.
    pub fn validate(&self, instance_id: &str, provider: Provider) -> Result<(), ValidationError> {
        let err = |m: String| ValidationError::rule(format!("instance {instance_id}: {m}"));
        let unused = |field: &str| err(format!("machine.{field} is not used by a {provider} pool"));
        let missing = |field: &str| {
            err(format!(
                "machine.{field} is required for an instance of a {provider} pool"
            ))
        };
        match provider {
            Provider::HetznerCloud => {
                if self.node.is_some() {
                    return Err(unused("node"));
                }
                if self.vmid.is_some() {
                    return Err(unused("vmid"));
                }
                match self.server_id {
                    None => Err(missing("server_id")),
                    Some(s) if s == 0 || i64::try_from(s).is_err() => Err(err(format!(
                        "machine.server_id {s} must be between 1 and {}",
                        i64::MAX
                    ))),
                    Some(_) => Ok(()),
                }
            }
            Provider::ProxmoxVe => {
                if self.server_id.is_some() {
                    return Err(unused("server_id"));
                }
                let node = self.node.as_deref().ok_or_else(|| missing("node"))?;
                let vmid = self.vmid.ok_or_else(|| missing("vmid"))?;
                let b = node.as_bytes();
                let ok = !b.is_empty()
                    && b.len() <= 63
                    && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'-')
                    && b[0] != b'-'
                    && b[b.len() - 1] != b'-';
                if !ok {
                    return Err(err(format!(
                        "machine.node {node:?} must be a host name (1 to 63 bytes of A-Z a-z 0-9 -, not starting or ending with -)"
                    )));
                }
                if !(100..=MAX_PROXMOX_VMID).contains(&vmid) {
                    return Err(err(format!(
                        "machine.vmid {vmid} must be between 100 and {MAX_PROXMOX_VMID}"
                    )));
                }
                Ok(())
            }
        }
    }
}

impl fmt::Display for Machine {
    /// `server 42`, `node pve1 vmid 100`, or `none`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.server_id, &self.node, self.vmid) {
            (Some(s), _, _) => write!(f, "server {s}"),
            (None, Some(n), Some(v)) => write!(f, "node {n} vmid {v}"),
            _ => f.write_str("none"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(provider: &str, url: Option<&str>, creds: Credentials) -> SetProviderPool {
        SetProviderPool {
            pool_id: "hz".into(),
            provider: provider.into(),
            api_url: url.map(Into::into),
            credentials: creds,
            poll_interval_secs: None,
        }
    }

    fn env(n: &str) -> Credentials {
        Credentials::Env(n.into())
    }

    fn err(r: &SetProviderPool) -> String {
        r.validate().unwrap_err().to_string()
    }

    #[test]
    fn defaults_and_normalised_url() {
        let p = req("hetzner-cloud", None, env("HCLOUD_TOKEN"))
            .validate()
            .unwrap();
        assert_eq!(p.api_url, HETZNER_API_URL);
        assert_eq!(p.poll_interval_secs, DEFAULT_POLL_INTERVAL_SECS);
        assert_eq!(p.provider, Provider::HetznerCloud);
        let p = req(
            "proxmox-ve",
            Some("https://pve1.example.com:8006/api2/json/"),
            Credentials::File("/etc/vmnet/pve.token".into()),
        )
        .validate()
        .unwrap();
        assert_eq!(p.api_url, "https://pve1.example.com:8006/api2/json");
        let json = serde_json::to_value(&p).unwrap();
        assert_eq!(json["provider"], "proxmox-ve");
        assert_eq!(json["credentials"]["file"], "/etc/vmnet/pve.token");
    }

    #[test]
    fn each_bad_field_is_named() {
        assert_eq!(
            err(&req("aws", None, env("X"))),
            "pool hz: provider \"aws\" is not one of hetzner-cloud, proxmox-ve"
        );
        assert!(
            err(&req("proxmox-ve", None, env("X"))).starts_with("pool hz: api_url is required")
        );
        for bad in [
            "ftp://x/",
            "https://user:pw@api.example.com/v1",
            "https://api.example.com/v1?x=1",
            "https://api.example.com/v1#f",
            "not a url",
            "http://",
        ] {
            let e = err(&req("hetzner-cloud", Some(bad), env("X")));
            assert!(e.starts_with("pool hz: api_url "), "{bad}: {e}");
        }
        for bad in ["", "1X", "A-B", "A B"] {
            let e = err(&req("hetzner-cloud", None, env(bad)));
            assert!(e.starts_with("pool hz: credentials.env "), "{bad}: {e}");
        }
        let e = err(&req(
            "hetzner-cloud",
            None,
            Credentials::File("token".into()),
        ));
        assert!(
            e.starts_with("pool hz: credentials.file \"token\" must be an absolute path"),
            "{e}"
        );
        let mut r = req("hetzner-cloud", None, env("X"));
        r.poll_interval_secs = Some(1);
        assert_eq!(
            err(&r),
            "pool hz: poll_interval_secs 1 must be between 5 and 86400"
        );
        r.pool_id = "a;b".into();
        assert!(err(&r).starts_with("pool_id "));
    }

    #[test]
    fn credentials_json_takes_one_source() {
        let c: Credentials = serde_json::from_str(r#"{"env": "HCLOUD_TOKEN"}"#).unwrap();
        assert_eq!(c, env("HCLOUD_TOKEN"));
        assert!(serde_json::from_str::<Credentials>(r#"{"env": "A", "file": "/x"}"#).is_err());
        assert!(serde_json::from_str::<Credentials>(r#"{"token": "secret"}"#).is_err());
        assert_eq!(c.to_string(), "env HCLOUD_TOKEN");
    }

    #[test]
    fn machines_fit_their_provider() {
        let hz = Provider::HetznerCloud;
        let pve = Provider::ProxmoxVe;
        assert!(Machine::hetzner(42).validate("vm1", hz).is_ok());
        assert!(Machine::proxmox("pve1", 100).validate("vm1", pve).is_ok());
        let e = |m: Machine, p| m.validate("vm1", p).unwrap_err().to_string();
        assert_eq!(
            e(Machine::default(), hz),
            "instance vm1: machine.server_id is required for an instance of a hetzner-cloud pool"
        );
        assert_eq!(
            e(Machine::hetzner(0), hz),
            "instance vm1: machine.server_id 0 must be between 1 and 9223372036854775807"
        );
        assert_eq!(
            e(Machine::proxmox("pve1", 100), hz),
            "instance vm1: machine.node is not used by a hetzner-cloud pool"
        );
        assert_eq!(
            e(Machine::hetzner(1), pve),
            "instance vm1: machine.server_id is not used by a proxmox-ve pool"
        );
        assert_eq!(
            e(Machine::proxmox("pve1", 7), pve),
            "instance vm1: machine.vmid 7 must be between 100 and 999999999"
        );
        assert!(
            e(Machine::proxmox("-a", 100), pve).starts_with("instance vm1: machine.node \"-a\"")
        );
        assert!(e(Machine::proxmox("a/../b", 100), pve).starts_with("instance vm1: machine.node "));
        let m = Machine {
            node: Some("pve1".into()),
            ..Machine::default()
        };
        assert_eq!(
            e(m, pve),
            "instance vm1: machine.vmid is required for an instance of a proxmox-ve pool"
        );
        assert!(serde_json::from_str::<Machine>(r#"{"server": 1}"#).is_err());
    }
}
