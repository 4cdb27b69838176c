//! The pool sandbox's spec file (`"mode": "pool"`): the pool, the host and the instances,
//! checked before anything is built.

use serde::Deserialize;

use crate::sandbox::HOST_UPLINK_V4;
use vmnet_model::ValidationError;
use vmnet_model::nic::{IfName, NetworkPolicy};
use vmnet_model::pool::SetIpPool;

/// One instance of a pool spec.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSpecInstance {
    /// The instance id.
    pub instance_id: String,
    /// Its network policy.
    #[serde(default)]
    pub policy: NetworkPolicy,
    /// A sandbox instance (SSH only from the host).
    #[serde(default)]
    pub sandbox: bool,
}

/// The host of a pool spec.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSpecHost {
    /// Host id.
    pub host_id: String,
    /// vCPUs.
    pub vcpus: u32,
    /// Memory, MiB.
    pub memory_mib: u32,
}

/// A pool-mode sandbox spec (`examples/pool.json`): `"mode": "pool"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSpec {
    /// Always `"pool"`.
    pub mode: String,
    /// The host bridge (default `br0`).
    #[serde(default = "default_bridge")]
    pub bridge: String,
    /// The range (`setIpPool`).
    pub pool: SetIpPool,
    /// The host.
    pub host: PoolSpecHost,
    /// The instances, created in order.
    pub instances: Vec<PoolSpecInstance>,
}

impl PoolSpec {
    /// Parses and checks a pool spec before anything is built: valid JSON object, `mode`
    /// `"pool"`, a bridge name usable in the sandbox host (an interface name, not `bc…`, not
    /// `lo` or `uplink`), a valid range not overlapping the sandbox's own networks, a valid
    /// host, at least one instance, instance ids valid and distinct.
    ///
    /// # Errors
    /// `INVALID_INPUT` naming the file and the field.
    pub fn parse(file: &str, text: &str) -> Result<Self, ValidationError> {
        let bad = |m: String| ValidationError::rule(format!("pool spec {file}: {m}"));
        // Strict: a key given twice (two "mode"s, two "pool"s) is refused, not last-wins.
        let v: serde_json::Value = vmnet_model::json::from_slice(text.as_bytes())
            .map_err(|e| bad(format!("not valid JSON: {e}")))?;
        if !v.is_object() {
            return Err(bad("must be a JSON object".into()));
        }
        let spec: Self = serde_json::from_value(v).map_err(|e| bad(e.to_string()))?;
        if spec.mode != "pool" {
            return Err(bad(format!("mode {:?}: must be \"pool\"", spec.mode)));
        }
        let bridge: IfName = spec
            .bridge
            .parse()
            .map_err(|e: ValidationError| bad(format!("bridge: {}", e.message())))?;
        if bridge.as_str().starts_with(vmnet_model::nic::TAP_PREFIX)
            || ["lo", "uplink"].contains(&bridge.as_str())
        {
            return Err(bad(format!(
                "bridge {:?}: names starting with \"{}\" are instance taps, and lo and uplink exist in the sandbox host",
                bridge.as_str(),
                vmnet_model::nic::TAP_PREFIX
            )));
        }
        let range = spec.pool.validate().map_err(|e| bad(e.message()))?;
        let sandbox_nets: [(&str, ipnet::Ipv4Net); 2] = [
            (
                "the sandbox uplink",
                ipnet::Ipv4Net::new(HOST_UPLINK_V4, crate::sandbox::UPLINK_V4_LEN)
                    .map_err(|e| ValidationError::rule(e.to_string()))?
                    .trunc(),
            ),
            (
                "the fake internet's echo network",
                ipnet::Ipv4Net::new(crate::sandbox::ECHO_V4, 24)
                    .map_err(|e| ValidationError::rule(e.to_string()))?
                    .trunc(),
            ),
        ];
        for (what, net) in sandbox_nets {
            if net.contains(&range.cidr.network()) || range.cidr.contains(&net.network()) {
                return Err(bad(format!(
                    "pool.cidr {} overlaps {what} {net}",
                    range.cidr
                )));
            }
        }
        vmnet_model::ids::validate_id("host.host_id", &spec.host.host_id)
            .map_err(|e| bad(e.message()))?;
        if spec.host.vcpus == 0 || spec.host.memory_mib == 0 {
            return Err(bad("host: vcpus and memory_mib must be at least 1".into()));
        }
        if spec.instances.is_empty() {
            return Err(bad("instances: at least one is needed".into()));
        }
        let mut seen = std::collections::BTreeSet::new();
        for (n, i) in spec.instances.iter().enumerate() {
            vmnet_model::ids::validate_id(&format!("instances[{n}].instance_id"), &i.instance_id)
                .map_err(|e| bad(e.message()))?;
            if !seen.insert(i.instance_id.as_str()) {
                return Err(bad(format!(
                    "instances[{n}].instance_id {:?} appears twice",
                    i.instance_id
                )));
            }
        }
        Ok(spec)
    }
}

fn default_bridge() -> String {
    vmnet_model::nic::DEFAULT_BRIDGE.to_owned()
}

/// Whether `text` is a pool-mode spec (a JSON object with `"mode": "pool"`).
#[must_use]
pub fn is_pool_spec(text: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(text)
        .ok()
        .is_some_and(|v| v.get("mode").and_then(serde_json::Value::as_str) == Some("pool"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{"mode": "pool", "pool": {"pool_id": "pool-1", "cidr": "10.0.0.0/29", "gateway": "10.0.0.1"},
        "host": {"host_id": "h1", "vcpus": 8, "memory_mib": 8192},
        "instances": [{"instance_id": "web-1"}, {"instance_id": "web-2", "policy": "private"}]}"#;

    #[test]
    fn pool_specs_are_checked_before_anything_is_built() {
        assert_eq!(PoolSpec::parse("f", GOOD).unwrap().instances.len(), 2);
        let with = |from: &str, to: &str| GOOD.replacen(from, to, 1);
        let cases: Vec<(String, &str)> = vec![
            ("[]".into(), "must be a JSON object"),
            (r#"{"mode": "pool", "#.into(), "not valid JSON"),
            (
                with(r#""mode": "pool""#, r#""mode": "Pool""#),
                "mode \"Pool\"",
            ),
            (
                with(r#""mode": "pool","#, r#""mode": "pool", "bridge": "bc0","#),
                "bridge \"bc0\"",
            ),
            (
                with(
                    r#""mode": "pool","#,
                    r#""mode": "pool", "bridge": "uplink","#,
                ),
                "bridge \"uplink\"",
            ),
            (
                with(r#""mode": "pool","#, r#""mode": "pool", "bridge": "lo","#),
                "bridge \"lo\"",
            ),
            (
                with(r#""mode": "pool","#, r#""mode": "pool", "bridge": "a b","#),
                "bridge:",
            ),
            (
                with(
                    r#"[{"instance_id": "web-1"}, {"instance_id": "web-2", "policy": "private"}]"#,
                    "[]",
                ),
                "instances: at least one",
            ),
            (
                with(r#""web-2""#, r#""web-1""#),
                "instances[1].instance_id \"web-1\" appears twice",
            ),
            (
                with(r#""web-2""#, r#""web-2\nnetwork: {config: disabled}""#),
                "instances[1].instance_id",
            ),
            (
                with(r#""web-2""#, r#""web-2\"; flush ruleset; #""#),
                "instances[1].instance_id",
            ),
            (with(r#""web-1""#, r#""""#), "instances[0].instance_id"),
            (
                with(r#""web-1"}"#, r#""web-1", "colour": "red"}"#),
                "unknown field",
            ),
            (with("10.0.0.0/29", "10.0.0.5/29"), "pool pool-1"),
            (
                with(
                    r#""10.0.0.0/29", "gateway": "10.0.0.1""#,
                    r#""203.0.113.8/29", "gateway": "203.0.113.9""#,
                ),
                "overlaps the sandbox uplink",
            ),
            (
                with(
                    r#""10.0.0.0/29", "gateway": "10.0.0.1""#,
                    r#""198.51.100.0/25", "gateway": "198.51.100.1""#,
                ),
                "overlaps the fake internet",
            ),
            (
                with(r#""host_id": "h1""#, r#""host_id": "h 1""#),
                "host.host_id",
            ),
            (with(r#""vcpus": 8"#, r#""vcpus": 0"#), "host: vcpus"),
        ];
        for (text, want) in cases {
            let e = PoolSpec::parse("f.json", &text).unwrap_err();
            assert!(
                e.message().starts_with("pool spec f.json: "),
                "{}",
                e.message()
            );
            assert!(e.message().contains(want), "{text}: {}", e.message());
        }
    }
}
