//! The pool sandbox's spec file (`"mode": "pool"`): the pool, the host and the instances,
//! checked before anything is built.

use serde::Deserialize;

use crate::sandbox::HOST_UPLINK_V4;
use vmnet_model::ValidationError;
use vmnet_model::nic::{IfName, NetworkPolicy};
use vmnet_model::pool::{AddRange, Family, PoolRange, SetIpPool};

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

/// A range added after the pool's first (`POST /v1/pools/{id}/ranges`): IPv4 or IPv6.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSpecRange {
    /// The network, e.g. `fd00:10::/64`.
    pub cidr: String,
    /// The gateway; never leased.
    pub gateway: String,
    /// The first address to lease (default: the API's).
    #[serde(default)]
    pub first_host: Option<String>,
    /// The last address to lease (default: the API's).
    #[serde(default)]
    pub last_host: Option<String>,
}

impl PoolSpecRange {
    /// The API's request for this range of pool `pool_id`.
    #[must_use]
    pub fn request(&self, pool_id: &str) -> AddRange {
        AddRange {
            pool_id: pool_id.to_owned(),
            cidr: self.cidr.clone(),
            gateway: self.gateway.clone(),
            first_host: self.first_host.clone(),
            last_host: self.last_host.clone(),
        }
    }
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
    /// The ranges added after it, in order (an IPv6 range makes the pool dual-stack).
    #[serde(default)]
    pub ranges: Vec<PoolSpecRange>,
    /// The host.
    pub host: PoolSpecHost,
    /// The instances, created in order.
    pub instances: Vec<PoolSpecInstance>,
}

impl PoolSpec {
    /// Parses and checks a pool spec before anything is built: valid JSON object, `mode`
    /// `"pool"`, a bridge name usable in the sandbox host (an interface name, not `bc…`, not
    /// `lo` or `uplink`), a valid range not overlapping the sandbox's own networks, a valid
    /// added ranges (`ranges`, each valid, not overlapping the sandbox's networks), a valid
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
        let sandbox_nets6 = [
            (
                "the sandbox uplink",
                ipnet::IpNet::from(
                    ipnet::Ipv6Net::new(
                        crate::sandbox::HOST_UPLINK_V6,
                        crate::sandbox::UPLINK_V6_LEN,
                    )
                    .map_err(|e| ValidationError::rule(e.to_string()))?
                    .trunc(),
                ),
            ),
            (
                "the fake internet's echo address",
                ipnet::IpNet::from(
                    ipnet::Ipv6Net::new(crate::sandbox::ECHO_V6, 128)
                        .map_err(|e| ValidationError::rule(e.to_string()))?,
                ),
            ),
        ];
        for (n, r) in spec.ranges.iter().enumerate() {
            let added = r
                .request(&spec.pool.pool_id)
                .validate()
                .map_err(|e| bad(format!("ranges[{n}]: {}", e.message())))?;
            let v4 = sandbox_nets.map(|(w, net)| (w, ipnet::IpNet::from(net)));
            for (what, net) in v4.iter().chain(&sandbox_nets6) {
                if net.contains(&added.cidr.network()) || added.cidr.contains(&net.network()) {
                    return Err(bad(format!(
                        "ranges[{n}].cidr {} overlaps {what} {net}",
                        added.cidr
                    )));
                }
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

impl PoolSpec {
    /// The first IPv6 range of `ranges`, validated (`None` for an IPv4-only pool).
    #[must_use]
    pub fn range6(&self) -> Option<PoolRange> {
        self.ranges
            .iter()
            .filter_map(|r| r.request(&self.pool.pool_id).validate().ok())
            .find(|r| r.family == Family::Ipv6)
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
        assert!(PoolSpec::parse("f", GOOD).unwrap().range6().is_none());
        let dual = GOOD.replacen(
            r#""host":"#,
            r#""ranges": [{"cidr": "fd00:10::/64", "gateway": "fd00:10::1"}], "host":"#,
            1,
        );
        let r6 = PoolSpec::parse("f", &dual).unwrap().range6().unwrap();
        assert_eq!(
            (r6.gateway.to_string(), r6.first_host.to_string()),
            ("fd00:10::1".to_owned(), "fd00:10::2".to_owned())
        );
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
            (
                with(
                    r#""host":"#,
                    r#""ranges": [{"cidr": "fd00:10::/32", "gateway": "fd00:10::1"}], "host":"#,
                ),
                "ranges[0]: pool pool-1: cidr fd00:10::/32 has prefix length 32",
            ),
            (
                with(
                    r#""host":"#,
                    r#""ranges": [{"cidr": "fd00:10::/64", "gw": "fd00:10::1"}], "host":"#,
                ),
                "unknown field `gw`",
            ),
            (
                with(
                    r#""host":"#,
                    r#""ranges": [{"cidr": "2001:db8:0:1::/64", "gateway": "2001:db8:0:1::9"}], "host":"#,
                ),
                "ranges[0].cidr 2001:db8:0:1::/64 overlaps the sandbox uplink",
            ),
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
