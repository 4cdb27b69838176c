//! The per-VM metadata document (MMDS) and where it is served (spec: namespaced-vm-networking.md,
//! the MMDS paragraph of "Atlas WG Mesh", "Design notes": the mesh address comes from MMDS, so
//! nothing per VM is baked into the image).
//!
//! # The document
//! A pure function of the VM config, laid out as Firecracker's MMDS examples and EC2 lay theirs
//! out (the spec's `meta-data/mesh-ipv6` is the key under `latest/`):
//!
//! ```json
//! {"latest": {"meta-data": {
//!     "instance-id": "web-7",
//!     "mesh-ipv6": "fdaa:1::7",
//!     "host-routes": "0.0.0.0/0\n::/0",
//!     "public-ipv4": "203.0.113.57",
//!     "public-ipv6": "2001:db8:7::/56"}}}
//! ```
//!
//! - `instance-id`: the VM id, always;
//! - `mesh-ipv6`: the mesh address, absent without one (a warm image-capture VM);
//! - `host-routes`: the destinations of the VM's routes `via: host`, in config order, one per
//!   line (no trailing newline); the empty string when there are none, so a guest can tell "no
//!   routes" from a missing document;
//! - `public-ipv4`, `public-ipv6`: when set (the IPv6 as the config writes it: an address for a
//!   mapped /128, a prefix for a routed block).
//!
//! Every value is a string, so a plain-text `GET` of each leaf answers it (MMDS refuses other
//! leaf types). The serialized document is capped at [`MAX_DOCUMENT_BYTES`] (Firecracker's
//! default data store limit); a config whose document would exceed it is refused.
//!
//! # Where
//! [`METADATA_IPV4`] port [`METADATA_PORT`] inside the VM's netns: a /32 on the tap (in
//! [`super::TapPlan::metadata_ipv4`], so observe, drift and repair cover it like the tap's other
//! addresses). The guest reaches it through the tap: its default route goes via 172.16.0.1 on
//! the tap, and the netns answers ARP for the /32 on the tap (link-local, never routed, so it
//! needs no route in the netns whatever the VM's routes). The VM's nftables table filters only
//! forwarded traffic and the limits leave 169.254/16 unshaped, so neither touches it.

use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use vmnet_model::ValidationError;
use vmnet_model::vm::metadata::MetadataVersion;
use vmnet_model::vm::{Via, VmConfig, public};

/// The metadata address, the same in every VM: `169.254.169.254`.
pub const METADATA_IPV4: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);
/// The metadata port.
pub const METADATA_PORT: u16 = 80;
/// The largest serialized document, bytes (Firecracker's default MMDS data store limit).
pub const MAX_DOCUMENT_BYTES: usize = 51_200;

/// The metadata of one VM as planned.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct MetadataPlan {
    /// The version the VM's config asks for; `None` is the host's default.
    pub version: Option<MetadataVersion>,
    /// The document (see the module docs).
    pub document: Value,
}

/// Builds the document of `cfg` (see the module docs).
///
/// # Errors
/// `INVALID_INPUT` naming the VM when the serialized document would exceed
/// [`MAX_DOCUMENT_BYTES`].
pub fn plan(cfg: &VmConfig) -> Result<MetadataPlan, ValidationError> {
    let mut md = Map::new();
    md.insert("instance-id".into(), Value::String(cfg.id.clone()));
    if let Some(m) = cfg.mesh_ipv6 {
        md.insert("mesh-ipv6".into(), Value::String(m.to_string()));
    }
    let routes: Vec<String> = cfg
        .network
        .routes
        .iter()
        .filter(|r| r.via == Via::Host)
        .map(|r| r.destination.to_string())
        .collect();
    md.insert("host-routes".into(), Value::String(routes.join("\n")));
    if let Some(a) = cfg.public_ipv4 {
        md.insert("public-ipv4".into(), Value::String(a.to_string()));
    }
    if let Some(n) = cfg.public_ipv6 {
        md.insert("public-ipv6".into(), Value::String(public::ipv6_text(&n)));
    }
    let mut latest = Map::new();
    latest.insert("meta-data".into(), Value::Object(md));
    let mut root = Map::new();
    root.insert("latest".into(), Value::Object(latest));
    let document = Value::Object(root);
    let size = document.to_string().len();
    if size > MAX_DOCUMENT_BYTES {
        return Err(ValidationError::rule(format!(
            "vm {}: the metadata document would be {size} bytes, more than the {MAX_DOCUMENT_BYTES} allowed (network.routes has {} routes via host)",
            cfg.id,
            routes.len()
        )));
    }
    Ok(MetadataPlan {
        version: cfg.metadata.and_then(|m| m.version),
        document,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(json: &str) -> VmConfig {
        vmnet_model::vm::parse_vm_config(json.as_bytes()).unwrap()
    }

    #[test]
    fn full_document() {
        let c = cfg(
            r#"{"id":"web-7","user_id":7,"tenant":1,"mesh_ipv6":"fdaa:1::7",
            "public_ipv4":"203.0.113.57","public_ipv6":"2001:db8:7::/56",
            "metadata":{"version":"v1"},
            "network":{"routes":[{"destination":"0.0.0.0/0","via":"host"},
                                 {"destination":"2000::/3","via":"fdaa:1::56"},
                                 {"destination":"::/0","via":"host"}]}}"#,
        );
        let p = plan(&c).unwrap();
        assert_eq!(p.version, Some(MetadataVersion::V1));
        assert_eq!(
            p.document,
            serde_json::json!({"latest": {"meta-data": {
                "instance-id": "web-7", "mesh-ipv6": "fdaa:1::7",
                "host-routes": "0.0.0.0/0\n::/0",
                "public-ipv4": "203.0.113.57", "public-ipv6": "2001:db8:7::/56"}}})
        );
    }

    #[test]
    fn minimal_document_has_no_optional_keys() {
        let p = plan(&cfg(r#"{"id":"cap","user_id":1,"tenant":0}"#)).unwrap();
        assert_eq!(p.version, None);
        assert_eq!(
            p.document,
            serde_json::json!({"latest": {"meta-data": {"instance-id": "cap", "host-routes": ""}}})
        );
    }

    #[test]
    fn mapped_public_ipv6_is_written_as_an_address() {
        let p = plan(&cfg(r#"{"id":"a","user_id":1,"tenant":0,"mesh_ipv6":"fdaa::1",
            "public_ipv6":"2001:db8::5","network":{"routes":[{"destination":"::/0","via":"host"}]}}"#))
        .unwrap();
        assert_eq!(
            p.document["latest"]["meta-data"]["public-ipv6"],
            "2001:db8::5"
        );
    }

    #[test]
    fn oversized_document_is_refused() {
        // 3,000 IPv6 /64 routes via host: ~70 KB of destinations.
        let routes: Vec<String> = (0..3000u32)
            .map(|i| {
                format!(
                    r#"{{"destination":"2001:db8:{:x}:{:x}::/64","via":"host"}}"#,
                    i / 256 + 1,
                    i % 256
                )
            })
            .collect();
        let c = cfg(&format!(
            r#"{{"id":"big","user_id":1,"tenant":0,"mesh_ipv6":"fdaa::1","network":{{"routes":[{}]}}}}"#,
            routes.join(",")
        ));
        let e = plan(&c).unwrap_err().message();
        assert!(
            e.starts_with("vm big: the metadata document would be "),
            "{e}"
        );
        assert!(
            e.contains("more than the 51200 allowed (network.routes has 3000 routes via host)"),
            "{e}"
        );
        // Just under the cap is fine.
        let c = cfg(&format!(
            r#"{{"id":"big","user_id":1,"tenant":0,"mesh_ipv6":"fdaa::1","network":{{"routes":[{}]}}}}"#,
            routes[..2000].join(",")
        ));
        assert!(plan(&c).unwrap().document.to_string().len() <= MAX_DOCUMENT_BYTES);
    }
}
