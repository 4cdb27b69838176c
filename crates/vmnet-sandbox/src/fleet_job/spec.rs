//! The fleet spec (`examples/fleet.json`): the hosts of a multi-host sandbox and the VMs each
//! runs, checked before anything is built.
//!
//! ```json
//! {
//!   "mode": "fleet",
//!   "hosts": [
//!     {"name": "host-1", "public_neighbors": "routed", "vms": [ … ]},
//!     {"name": "host-2", "public_neighbors": "proxy", "vms": [ … ]}
//!   ]
//! }
//! ```
//!
//! 2 to 4 hosts, in index order (host 1 first). `name`: 1-32 bytes, a lowercase letter, then
//! lowercase letters, digits or `-`, distinct. `public_neighbors` (default `routed`): how the
//! fake internet reaches the host's public block ([`PublicNeighbors`]). `vms` (default none):
//! VM network configs exactly as in a host spec's `vms` (`PUT /v1/vms/{id}` bodies). VM ids and
//! mesh addresses are distinct across the fleet (the report names VMs by id, and the fake
//! internet routes each mesh address to one host); user ids are distinct within a host (each
//! host's agent derives its own names from them).

use std::collections::{BTreeMap, BTreeSet};

use serde::Deserialize;
use vmnet_agent::hostspec::HostSpec;
use vmnet_model::ValidationError;
use vmnet_model::vm::VmConfig;

use crate::fleet::{MAX_HOSTS, PublicNeighbors};

/// The fewest hosts a fleet spec names.
pub const MIN_HOSTS: usize = 2;

/// One host of a fleet spec.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetHostSpec {
    /// The host's name (for the report and its state directory).
    pub name: String,
    /// How the fake internet reaches its public block.
    #[serde(default)]
    pub public_neighbors: PublicNeighbors,
    /// The VMs it runs.
    #[serde(default)]
    pub vms: Vec<VmConfig>,
}

impl FleetHostSpec {
    /// The host spec its agent gets: these VMs, nothing else.
    #[must_use]
    pub fn host_spec(&self) -> HostSpec {
        HostSpec {
            vms: self.vms.clone(),
            ..HostSpec::default()
        }
    }
}

/// A fleet spec: `"mode": "fleet"` and the hosts.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetSpec {
    /// Always `"fleet"`.
    pub mode: String,
    /// The hosts, host 1 first.
    pub hosts: Vec<FleetHostSpec>,
}

/// Whether `text` is a fleet spec (a JSON object with `"mode": "fleet"`).
#[must_use]
pub fn is_fleet_spec(text: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(text)
        .ok()
        .is_some_and(|v| v.get("mode").and_then(serde_json::Value::as_str) == Some("fleet"))
}

fn check_host_name(name: &str) -> Result<(), String> {
    let b = name.as_bytes();
    let ok = (1..=32).contains(&b.len())
        && b[0].is_ascii_lowercase()
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "name {name:?} must be 1-32 bytes: a lowercase letter, then lowercase letters, digits or '-'"
        ))
    }
}

impl FleetSpec {
    /// Parses and checks a fleet spec (see the module docs).
    ///
    /// # Errors
    /// `INVALID_INPUT` starting `fleet spec <file>: ` and naming the field.
    pub fn parse(file: &str, text: &str) -> Result<Self, ValidationError> {
        let bad = |m: String| ValidationError::rule(format!("fleet spec {file}: {m}"));
        // Strict: a key given twice is refused, not last-wins.
        let v: serde_json::Value = vmnet_model::json::from_slice(text.as_bytes())
            .map_err(|e| bad(format!("not valid JSON: {e}")))?;
        if !v.is_object() {
            return Err(bad("must be a JSON object".into()));
        }
        // From the text again (not from `v`), so errors keep their line and column.
        let spec: Self = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        if spec.mode != "fleet" {
            return Err(bad(format!("mode {:?}: must be \"fleet\"", spec.mode)));
        }
        if !(MIN_HOSTS..=MAX_HOSTS).contains(&spec.hosts.len()) {
            return Err(bad(format!(
                "hosts: {} given; a fleet has {MIN_HOSTS} to {MAX_HOSTS}",
                spec.hosts.len()
            )));
        }
        let mut names = BTreeSet::new();
        let mut ids = BTreeMap::new();
        let mut meshes = BTreeMap::new();
        for (n, h) in spec.hosts.iter().enumerate() {
            check_host_name(&h.name).map_err(|m| bad(format!("hosts[{n}]: {m}")))?;
            if !names.insert(h.name.as_str()) {
                return Err(bad(format!("hosts[{n}]: name {:?} appears twice", h.name)));
            }
            let mut users = BTreeMap::new();
            for v in &h.vms {
                let at = format!("hosts[{n}] ({}): vm {}", h.name, v.id);
                if let Some(other) = ids.insert(v.id.as_str(), h.name.as_str()) {
                    return Err(bad(format!("{at}: the id is used on host {other} too")));
                }
                if let Some(other) = users.insert(v.user_id, v.id.as_str()) {
                    return Err(bad(format!(
                        "{at}: user_id {} is already used by vm {other} on this host",
                        v.user_id
                    )));
                }
                if let Some(m) = v.mesh_ipv6
                    && let Some(other) = meshes.insert(m, v.id.as_str())
                {
                    return Err(bad(format!(
                        "{at}: mesh_ipv6 {m} is already used by vm {other}"
                    )));
                }
            }
        }
        Ok(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{"mode": "fleet", "hosts": [
        {"name": "host-1", "vms": [{"id": "a", "user_id": 7, "tenant": 1, "mesh_ipv6": "fdaa:1::7",
            "network": {"routes": [{"destination": "0.0.0.0/0", "via": "host"}]}}]},
        {"name": "host-2", "public_neighbors": "proxy",
         "vms": [{"id": "b", "user_id": 7, "tenant": 1, "mesh_ipv6": "fdaa:2::7", "network": {"routes": []}}]}
    ]}"#;

    #[test]
    fn the_example_parses() {
        let text = include_str!("../../../../examples/fleet.json");
        assert!(is_fleet_spec(text));
        let spec = FleetSpec::parse("fleet.json", text).unwrap();
        assert!(spec.hosts.len() >= MIN_HOSTS);
        assert!(
            spec.hosts
                .iter()
                .any(|h| h.public_neighbors == PublicNeighbors::Proxy)
        );
    }

    #[test]
    fn fleet_specs_are_checked_before_anything_is_built() {
        let spec = FleetSpec::parse("f", GOOD).unwrap();
        assert_eq!(spec.hosts[0].public_neighbors, PublicNeighbors::Routed);
        assert_eq!(spec.hosts[1].public_neighbors, PublicNeighbors::Proxy);
        // One user id on two hosts is fine: each agent has its own names.
        assert_eq!(spec.hosts[1].host_spec().vms[0].user_id, 7);
        let with = |from: &str, to: &str| GOOD.replacen(from, to, 1);
        let cases: Vec<(String, &str)> = vec![
            ("[]".into(), "must be a JSON object"),
            ("{".into(), "not valid JSON"),
            (with(r#""fleet""#, r#""Fleet""#), "mode \"Fleet\""),
            (
                with(r#""mode": "fleet""#, r#""mode": "pool", "mode": "fleet""#),
                "duplicate key \"mode\"",
            ),
            (
                with(r#""name": "host-2""#, r#""name": "host-1""#),
                "hosts[1]: name \"host-1\" appears twice",
            ),
            (
                with(r#""name": "host-1""#, r#""name": "Host 1""#),
                "hosts[0]: name \"Host 1\"",
            ),
            (
                with(r#""name": "host-1""#, r#""name": "1host""#),
                "hosts[0]: name",
            ),
            (
                with(r#""proxy""#, r#""bridged""#),
                "unknown variant `bridged`",
            ),
            (
                with(r#""name": "host-1","#, r#""name": "host-1", "colour": 1,"#),
                "unknown field `colour`",
            ),
            (
                with(r#""id": "b""#, r#""id": "a""#),
                "hosts[1] (host-2): vm a: the id is used on host host-1 too",
            ),
            (
                with("fdaa:2::7", "fdaa:1::7"),
                "vm b: mesh_ipv6 fdaa:1::7 is already used by vm a",
            ),
            (
                with(
                    r#""user_id": 7, "tenant": 1, "mesh_ipv6": "fdaa:2::7""#,
                    r#""user_id": 70000, "tenant": 1, "mesh_ipv6": "fdaa:2::7""#,
                ),
                "user_id",
            ),
        ];
        for (text, want) in cases {
            let e = FleetSpec::parse("f.json", &text).unwrap_err();
            assert!(
                e.message().starts_with("fleet spec f.json: "),
                "{}",
                e.message()
            );
            assert!(e.message().contains(want), "{want}: {}", e.message());
        }
        // Host counts: 2 to 4.
        let one = r#"{"mode": "fleet", "hosts": [{"name": "a"}]}"#;
        let e = FleetSpec::parse("f.json", one).unwrap_err();
        assert!(
            e.message().contains("hosts: 1 given; a fleet has 2 to 4"),
            "{e}"
        );
        let five = r#"{"mode": "fleet", "hosts": [{"name": "a"}, {"name": "b"}, {"name": "c"}, {"name": "d"}, {"name": "e"}]}"#;
        assert!(FleetSpec::parse("f.json", five).is_err());
        // Two VMs with one user id on one host.
        let dup = r#"{"mode": "fleet", "hosts": [{"name": "a", "vms": [
            {"id": "x", "user_id": 1, "tenant": 1, "network": {"routes": []}},
            {"id": "y", "user_id": 1, "tenant": 1, "network": {"routes": []}}]}, {"name": "b"}]}"#;
        let e = FleetSpec::parse("f.json", dup).unwrap_err();
        assert!(
            e.message()
                .contains("vm y: user_id 1 is already used by vm x on this host"),
            "{e}"
        );
        assert!(!is_fleet_spec(r#"{"mode": "pool"}"#));
        assert!(!is_fleet_spec("{"));
    }
}
