//! The host spec: pools with ranges, hosts, instances and VMs in one JSON file, applied
//! declaratively by `vmnet apply FILE` (and by `vmnet-lab up --sandbox`).
//!
//! ```json
//! {
//!   "pools": [
//!     {"pool_id": "pool-a", "cidr": "10.0.0.0/29", "gateway": "10.0.0.1", "dns": ["192.0.2.53"]}
//!   ],
//!   "hosts": [
//!     {"host_id": "host-1", "vcpus": 16, "memory_mib": 65536}
//!   ],
//!   "instances": [
//!     {"instance_id": "i-1", "pool_id": "pool-a", "vcpus": 2, "memory_mib": 2048}
//!   ],
//!   "vms": [
//!     {"id": "vm-1", "user_id": 1001, "tenant": 1, "mesh_ipv6": "fdaa:1::1",
//!      "network": {"routes": [{"destination": "0.0.0.0/0", "via": "host"}]}}
//!   ]
//! }
//! ```
//!
//! Every section is optional (missing = empty); unknown fields are refused at every level.
//! A pool entry is [`vmnet_model::pool::SetIpPool`] (`pool_id`, `cidr`, `gateway`, optional
//! `first_host`, `last_host`, `dns`), an instance entry is [`vmnet_model::pool::NewInstance`]
//! (`instance_id`, `pool_id`, optional `host_id`, `vcpus`, `memory_mib`, optional
//! `recreate_on_host_loss`, `network_policy` (`public` default, `private`, `none`), `sandbox`
//! (default false)), a host entry is `host_id`, `vcpus`, `memory_mib`, and each VM entry
//! is a VM network config exactly as `PUT /v1/vms/{id}` takes it.
//!
//! # Semantics of `vmnet apply`
//! The whole file is parsed and every entry validated before anything is sent. Then, in order:
//! 1. **pools**: each range is set (`PUT /v1/pools/{id}/range`); setting it again replaces it
//!    and keeps existing leases.
//! 2. **hosts**: each host is added (`PUT /v1/hosts/{id}`); a host that exists with the same
//!    capacity is left as it is, one with a different capacity is a `CONFLICT` (capacity
//!    changes are not supported by the store).
//! 3. **instances**: each is created with its lease (`POST /v1/instances`, body as in the file); an instance that
//!    exists already is left as it is (placement is not redone, its lease is kept; a changed
//!    `network_policy` or `sandbox` in the file is not applied to it either).
//! 4. **vms**: each VM config is put (`PUT /v1/vms/{id}`); an unchanged config is a no-op.
//! 5. with `--prune` only: VMs the agent holds that the file does not list are deleted.
//!
//! Nothing else is ever deleted by `apply`: pools, hosts and instances not in the file stay
//! (deleting an instance returns its lease; that stays an explicit `vmnet instance delete`).
//!
//! # Limitations
//! Not atomic across entries: a failure stops the apply at that entry and reports it; the
//! entries before it stay applied, and re-running the same file converges.

use serde::{Deserialize, Serialize};
use vmnet_model::ValidationError;

use vmnet_model::pool::{NewInstance, SetIpPool};
use vmnet_model::vm::VmConfig;

use crate::api::types::{HostCapacity, PoolRange};

/// A whole host spec file. See the module docs for the format and the apply semantics.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostSpec {
    /// Pool ranges to set.
    #[serde(default)]
    pub pools: Vec<SetIpPool>,
    /// Hosts and their capacity.
    #[serde(default)]
    pub hosts: Vec<HostSpecEntry>,
    /// Instances to place (each takes a lease from its pool).
    #[serde(default)]
    pub instances: Vec<NewInstance>,
    /// VM network configs (namespace mode), each exactly the body of `PUT /v1/vms/{id}`
    /// (validated while parsing, by [`vmnet_model::vm`]'s rules).
    #[serde(default)]
    pub vms: Vec<VmConfig>,
}

/// A host: the host id plus the body of `PUT /v1/hosts/{id}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostSpecEntry {
    /// The host id.
    pub host_id: String,
    /// Schedulable vCPUs.
    pub vcpus: u32,
    /// Schedulable memory in MiB.
    pub memory_mib: u32,
}

impl HostSpecEntry {
    /// The capacity part, as `PUT /v1/hosts/{id}` takes it.
    #[must_use]
    pub fn capacity(&self) -> HostCapacity {
        HostCapacity {
            vcpus: self.vcpus,
            memory_mib: self.memory_mib,
        }
    }
}

/// The range part of a pool entry, as `PUT /v1/pools/{id}/range` takes it.
#[must_use]
pub fn pool_range(p: &SetIpPool) -> PoolRange {
    PoolRange {
        cidr: p.cidr.clone(),
        gateway: p.gateway.clone(),
        first_host: p.first_host.clone(),
        last_host: p.last_host.clone(),
        dns: Some(p.dns.clone()),
    }
}

impl HostSpec {
    /// Parses a host spec from JSON text and validates every entry (VMs, pools, instances),
    /// before anything is applied.
    ///
    /// # Errors
    /// `INVALID_INPUT`, always starting `host spec <what>: `:
    /// - `not valid JSON: <error> at line L column C` for text that is not JSON, or that repeats
    ///   a key within one object (`duplicate key "vms"`: the last would otherwise win silently);
    /// - `must be a JSON object` for any other top level (`[]`, a string, a number…), so an
    ///   empty array is never taken for an empty spec (which `apply --prune` would turn into
    ///   deleting every VM);
    /// - for a `"mode"` key: a `"mode": "pool"` or `"fleet"` file is a sandbox spec, for
    ///   `vmnet-lab up --sandbox`, not a host spec; any other value: `mode must be "pool" or
    ///   "fleet"`;
    /// - `unknown field` errors (with line and column) at every level;
    /// - the entry and the field at fault when an entry is invalid; also for two entries with
    ///   one id, two VMs with one user id, or two VMs with one mesh address
    ///   (`vms: vm b: mesh_ipv6 fdaa:1::1 is already used by vm a`).
    pub fn parse(what: &str, text: &str) -> Result<Self, ValidationError> {
        let value: serde_json::Value =
            vmnet_model::json::from_slice(text.as_bytes()).map_err(|source| {
                ValidationError::Json {
                    what: format!("host spec {what}: not valid JSON"),
                    source,
                }
            })?;
        let Some(object) = value.as_object() else {
            return Err(ValidationError::rule(format!(
                "host spec {what}: must be a JSON object"
            )));
        };
        if let Some(mode) = object.get("mode") {
            return Err(ValidationError::rule(match mode.as_str() {
                Some(m @ ("pool" | "fleet")) => format!(
                    "host spec {what}: a \"mode\": \"{m}\" file is a {m} sandbox spec, for \
                     `vmnet-lab up --sandbox {what}`, not a host spec (a host spec has no \"mode\")"
                ),
                _ => format!(
                    "host spec {what}: mode must be \"pool\" or \"fleet\" (a sandbox spec, for \
                     `vmnet-lab up --sandbox`); a host spec has no \"mode\" field"
                ),
            }));
        }
        // Deserialized from the text again (not from `value`) so errors keep line and column.
        let spec: Self = serde_json::from_str(text).map_err(|source| ValidationError::Json {
            what: format!("host spec {what}"),
            source,
        })?;
        let bad = |e: ValidationError| {
            ValidationError::rule(format!("host spec {what}: {}", e.message()))
        };
        for p in &spec.pools {
            p.validate().map_err(bad)?;
        }
        for h in &spec.hosts {
            vmnet_model::ids::validate_id("host_id", &h.host_id).map_err(bad)?;
        }
        for i in &spec.instances {
            i.validate().map_err(bad)?;
        }
        dupes(what, "pools", spec.pools.iter().map(|p| p.pool_id.clone()))?;
        dupes(what, "hosts", spec.hosts.iter().map(|h| h.host_id.clone()))?;
        dupes(
            what,
            "instances",
            spec.instances.iter().map(|i| i.instance_id.clone()),
        )?;
        dupes(what, "vms", spec.vms.iter().map(|v| v.id.clone()))?;
        dupes(
            what,
            "vms (user_id)",
            spec.vms.iter().map(|v| v.user_id.to_string()),
        )?;
        let mut meshes = std::collections::BTreeMap::new();
        for v in &spec.vms {
            if let Some(m) = v.mesh_ipv6
                && let Some(other) = meshes.insert(m, &v.id)
            {
                return Err(ValidationError::rule(format!(
                    "host spec {what}: vms: vm {}: mesh_ipv6 {m} is already used by vm {other}",
                    v.id
                )));
            }
        }
        Ok(spec)
    }
}

fn dupes(
    what: &str,
    section: &str,
    ids: impl Iterator<Item = String>,
) -> Result<(), ValidationError> {
    let mut seen = std::collections::BTreeSet::new();
    for id in ids {
        if !seen.insert(id.clone()) {
            return Err(ValidationError::rule(format!(
                "host spec {what}: {section}: {id} is listed twice"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_example() {
        let text = r#"{
          "pools": [{"pool_id": "pool-a", "cidr": "10.0.0.0/29", "gateway": "10.0.0.1", "dns": ["192.0.2.53"]}],
          "hosts": [{"host_id": "host-1", "vcpus": 16, "memory_mib": 65536}],
          "instances": [{"instance_id": "i-1", "pool_id": "pool-a", "vcpus": 2, "memory_mib": 2048}],
          "vms": [{"id": "vm-1", "user_id": 1001, "tenant": 1, "mesh_ipv6": "fdaa:1::1",
                   "network": {"routes": [{"destination": "0.0.0.0/0", "via": "host"}]}}]
        }"#;
        let spec = HostSpec::parse("host.json", text).unwrap();
        assert_eq!(pool_range(&spec.pools[0]).gateway, "10.0.0.1");
        assert_eq!(spec.hosts[0].capacity().memory_mib, 65536);
        assert_eq!(spec.instances[0].pool_id, "pool-a");
        assert_eq!(spec.vms[0].id, "vm-1");
        assert_eq!(spec.vms[0].user_id, 1001);
    }

    #[test]
    fn instances_take_network_policy_and_sandbox() {
        let spec = HostSpec::parse(
            "h.json",
            r#"{"instances": [{"instance_id": "i-1", "pool_id": "p"},
                {"instance_id": "i-2", "pool_id": "p", "network_policy": "none", "sandbox": true}]}"#,
        )
        .unwrap();
        use vmnet_model::nic::NetworkPolicy;
        let got: Vec<_> = spec
            .instances
            .iter()
            .map(|i| (i.network_policy, i.sandbox))
            .collect();
        assert_eq!(
            got,
            [(NetworkPolicy::Public, false), (NetworkPolicy::None, true)]
        );
        let e = HostSpec::parse(
            "h.json",
            r#"{"instances": [{"instance_id": "i-1", "pool_id": "p", "network_policy": "open"}]}"#,
        )
        .unwrap_err();
        assert!(e.message().contains("network_policy"), "{e}");
    }

    #[test]
    fn unknown_fields_are_refused() {
        let e = HostSpec::parse("h.json", r#"{"pools": [], "vm": []}"#).unwrap_err();
        assert!(e.message().contains("unknown field `vm`"), "{e}");
        let e = HostSpec::parse(
            "h.json",
            r#"{"hosts": [{"host_id": "h", "vcpus": 1, "memory_mib": 1, "x": 1}]}"#,
        )
        .unwrap_err();
        assert!(e.message().contains("unknown field `x`"), "{e}");
    }

    #[test]
    fn entries_are_validated_before_anything_is_applied() {
        let e = HostSpec::parse(
            "h.json",
            r#"{"vms": [{"id": "v", "user_id": 1, "tenant": 1, "mesh_ipv6": "fdaa::1",
                "network": {"routes": [{"destination": "10.0.0.1/8", "via": "host"}]}}]}"#,
        )
        .unwrap_err();
        assert!(e.message().contains("network.routes[0].destination"), "{e}");
        let e = HostSpec::parse(
            "h.json",
            r#"{"pools": [{"pool_id": "p", "cidr": "10.0.0.1/24", "gateway": "10.0.0.1"}]}"#,
        )
        .unwrap_err();
        assert!(e.message().contains("pool p: cidr"), "{e}");
        let e = HostSpec::parse(
            "h.json",
            r#"{"vms": [{"id": "a", "user_id": 1, "tenant": 1}, {"id": "b", "user_id": 1, "tenant": 1}]}"#,
        )
        .unwrap_err();
        assert!(e.message().contains("user_id"), "{e}");
        // Two VMs with one mesh address would fight over the host route to it.
        let e = HostSpec::parse(
            "h.json",
            r#"{"vms": [{"id": "a", "user_id": 1, "tenant": 1, "mesh_ipv6": "fdaa:1::100"},
                        {"id": "b", "user_id": 2, "tenant": 1, "mesh_ipv6": "fdaa:1:0::100/128"}]}"#,
        )
        .unwrap_err();
        assert!(
            e.message()
                .contains("vm b: mesh_ipv6 fdaa:1::100 is already used by vm a"),
            "{e}"
        );
        HostSpec::parse(
            "h.json",
            r#"{"vms": [{"id": "a", "user_id": 1, "tenant": 1, "mesh_ipv6": "fdaa:1::100"},
                        {"id": "b", "user_id": 2, "tenant": 1, "mesh_ipv6": "fdaa:1::101"}]}"#,
        )
        .unwrap();
    }

    #[test]
    fn only_a_json_object_is_a_host_spec() {
        for text in ["[]", "[{}]", "\"pools\"", "1", "null", "true"] {
            let e = HostSpec::parse("h.json", text).unwrap_err();
            assert_eq!(
                e.message(),
                "host spec h.json: must be a JSON object",
                "{text}"
            );
        }
        let e = HostSpec::parse("h.json", "{\"pools\": [],\n  ").unwrap_err();
        assert!(
            e.message()
                .starts_with("host spec h.json: not valid JSON: ")
                && e.message().contains("line 2 column"),
            "{e}"
        );
        // Unknown fields keep their position too.
        let e = HostSpec::parse("h.json", "{\n \"vm\": []}").unwrap_err();
        assert!(
            e.message()
                .starts_with("host spec h.json: unknown field `vm`")
                && e.message().contains("line 2 column"),
            "{e}"
        );
    }

    #[test]
    fn a_pool_sandbox_spec_is_not_a_host_spec() {
        let e = HostSpec::parse("pool.json", r#"{"mode": "pool", "pools": []}"#).unwrap_err();
        assert!(
            e.message().starts_with("host spec pool.json: ")
                && e.message().contains("pool sandbox spec")
                && e.message().contains("vmnet-lab up --sandbox"),
            "{e}"
        );
        let e = HostSpec::parse("fleet.json", r#"{"mode": "fleet", "hosts": []}"#).unwrap_err();
        assert!(
            e.message().starts_with("host spec fleet.json: ")
                && e.message().contains("fleet sandbox spec")
                && e.message().contains("vmnet-lab up --sandbox fleet.json"),
            "{e}"
        );
        let e = HostSpec::parse("h.json", r#"{"mode": "namespace"}"#).unwrap_err();
        assert!(
            e.message()
                .starts_with("host spec h.json: mode must be \"pool\" or \"fleet\""),
            "{e}"
        );
    }

    #[test]
    fn empty_spec_is_valid() {
        assert_eq!(
            HostSpec::parse("h.json", "{}").unwrap(),
            HostSpec::default()
        );
    }
}
