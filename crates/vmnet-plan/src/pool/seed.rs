//! The cloud-init NoCloud seed of an instance (spec: "The guest's network configuration").
//!
//! Three files: `meta-data` (`instance-id`, the instance id as it is, and `local-hostname`, a
//! valid hostname derived from it by [`local_hostname`]), `user-data` (`#cloud-config` and a
//! JSON object) and, when at least one NIC has static configuration, `network-config`
//! (version 2).
//!
//! # Design
//! Every file is JSON, which is valid YAML and sidesteps YAML 1.1 reading a MAC such as
//! `52:54:00:12:34:56` as a base-60 number. Every value is printed from a parsed type
//! ([`MacAddr`], [`IpNet`], [`IpAddr`]) as a JSON string, so no input string reaches a seed;
//! a malformed lease fails when the NodeSpec is parsed, before any seed exists.
//!
//! Each NIC is keyed `eth<index>` (its position in the instance's NIC list), matched by its
//! MAC and renamed with `set-name: eth<index>`. A static NIC gets `dhcp4: false`, its addresses
//! (the IPv4 lease, then the IPv6 lease), a default route per gateway, and its nameservers:
//!
//! - An IPv4 gateway is a route `{"to": "0.0.0.0/0", "via": gateway}`. When no address of the
//!   NIC contains it (a `/32` lease outside a replaced range, or a gateway outside the range's
//!   network, which the model allows) the route carries `"on-link": true`, so the gateway is
//!   reached directly on the link instead of the route being refused as unreachable.
//! - An IPv6 gateway (`gateway6`, or an IPv6 `gateway`) that one of the NIC's addresses
//!   contains, or that is link-local (`fe80::1`), is the `gateway6` key. cloud-init (22.4, in
//!   Debian 12) reads a `::/0` route as `::/64` when it renders systemd-networkd or ifupdown
//!   configuration (it drops the prefix length 0 as empty), so the guest would get no IPv6
//!   default route; `gateway6` reaches every renderer as the default route (netplan warns that
//!   the key is deprecated and applies it). Any other IPv6 gateway is a route
//!   `{"to": "::/0", "via": gateway, "on-link": true}` (netplan honours it).
//!
//! A NIC with an IPv6 address also gets `accept-ra: false`: its IPv6 address and route are
//! static, and an address the guest formed from a router advertisement (SLAAC) would be a
//! foreign source the anti-spoofing rules drop. A NIC without addresses gets `dhcp4: true`.
//! With no static NIC at all there is no network-config, so the image's own fallback (DHCP on
//! the first NIC) stays.

use std::net::IpAddr;

use ipnet::IpNet;
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};
use vmnet_model::ValidationError;
use vmnet_model::nic::{InstanceSpec, NicSpec};

/// The seed files of one instance, as written into the `cidata` image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seed {
    /// `meta-data`: JSON with `instance-id` and `local-hostname`.
    pub meta_data: String,
    /// `user-data`: `#cloud-config` on the first line, then a JSON object.
    pub user_data: String,
    /// `network-config` (version 2, JSON), or `None` when no NIC has static configuration.
    pub network_config: Option<String>,
}

impl Seed {
    /// The files as `(name, contents)` pairs, in the order they are written.
    #[must_use]
    pub fn files(&self) -> Vec<(&'static str, &str)> {
        let mut v = vec![
            ("meta-data", self.meta_data.as_str()),
            ("user-data", self.user_data.as_str()),
        ];
        if let Some(n) = &self.network_config {
            v.push(("network-config", n.as_str()));
        }
        v
    }
}

/// The interface name a NIC gets in the guest: `eth<index>`.
#[must_use]
pub fn guest_ifname(index: usize) -> String {
    format!("eth{index}")
}

fn ip_str(a: IpAddr) -> Value {
    Value::String(a.to_string())
}

fn net_str(n: IpNet) -> Value {
    Value::String(n.to_string())
}

/// Whether one of the NIC's addresses contains `gw`.
fn on_subnet(nic: &NicSpec, gw: IpAddr) -> bool {
    nic.addresses.iter().any(|a| a.contains(&gw))
}

/// The default route of a static NIC through `gw`: `{"to", "via"}`, plus `"on-link": true`
/// when none of the NIC's addresses contains `gw` (cloud-init network-config v2 route key).
fn default_route(nic: &NicSpec, gw: IpAddr) -> Value {
    let to = if gw.is_ipv4() { "0.0.0.0/0" } else { "::/0" };
    let mut r = Map::new();
    r.insert("to".into(), Value::String(to.into()));
    r.insert("via".into(), ip_str(gw));
    if !on_subnet(nic, gw) {
        r.insert("on-link".into(), Value::Bool(true));
    }
    Value::Object(r)
}

fn ethernet(index: usize, nic: &NicSpec) -> Value {
    let mut e = Map::new();
    e.insert("match".into(), json!({ "macaddress": nic.mac.to_string() }));
    e.insert("set-name".into(), Value::String(guest_ifname(index)));
    if nic.is_static() {
        e.insert("dhcp4".into(), Value::Bool(false));
        e.insert(
            "addresses".into(),
            nic.addresses.iter().copied().map(net_str).collect(),
        );
        if nic.addresses.iter().any(|a| a.addr().is_ipv6()) {
            e.insert("accept-ra".into(), Value::Bool(false));
        }
        let mut routes = Vec::new();
        for gw in nic.gateways() {
            match gw {
                IpAddr::V6(g) if g.is_unicast_link_local() || on_subnet(nic, gw) => {
                    e.insert("gateway6".into(), ip_str(gw));
                }
                _ => routes.push(default_route(nic, gw)),
            }
        }
        if !routes.is_empty() {
            e.insert("routes".into(), Value::Array(routes));
        }
        if !nic.nameservers.is_empty() {
            let ns: Vec<Value> = nic.nameservers.iter().copied().map(ip_str).collect();
            e.insert("nameservers".into(), json!({ "addresses": ns }));
        }
    } else {
        e.insert("dhcp4".into(), Value::Bool(true));
    }
    Value::Object(e)
}

/// The network-config (version 2) document, or `None` with no static NIC.
#[must_use]
pub fn network_config(inst: &InstanceSpec) -> Option<Value> {
    if !inst.nics.iter().any(NicSpec::is_static) {
        return None;
    }
    let mut eths = Map::new();
    for (i, nic) in inst.nics.iter().enumerate() {
        eths.insert(guest_ifname(i), ethernet(i, nic));
    }
    Some(json!({ "version": 2, "ethernets": eths }))
}

/// The longest hostname label (RFC 1123), in bytes.
pub const MAX_HOSTNAME_LEN: usize = 63;

/// How many hex digits of the SHA-256 of the instance id a derived hostname ends with.
pub const HOSTNAME_HASH_DIGITS: usize = 10;

/// Whether `h` ends with `-` and [`HOSTNAME_HASH_DIGITS`] lowercase hex digits (the shape of a
/// derived hostname).
fn ends_like_derived(h: &str) -> bool {
    let n = HOSTNAME_HASH_DIGITS;
    h.len() > n
        && h.as_bytes()[h.len() - n - 1] == b'-'
        && h[h.len() - n..]
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The `local-hostname` of instance `id` in its NoCloud `meta-data`: always one valid hostname
/// label (RFC 1123: 1 to 63 bytes of `a-z`, `0-9` and `-`, neither first nor last a `-`).
///
/// * An id that is already such a label is used as it is (`web-01` → `web-01`), unless it ends
///   like a derived name (`-` and 10 lowercase hex digits), which goes through the next rule.
/// * Any other id (upper case, `_`, `.`, 64 bytes) is mapped: lower-cased, every character
///   other than `a-z 0-9` replaced by `-`, runs of `-` squeezed to one, `-` trimmed from both
///   ends, cut to 52 bytes (and trimmed again); then `-` and the first 10 hex digits of the
///   SHA-256 of the original id are appended: `Web_01` → `web-01-929397059b`. At most
///   63 bytes.
///
/// Deterministic (the same id gives the same name on every host and every run). Two ids never
/// get one name: a mapped name carries the hash of its own id, and an id that merely looks
/// mapped is mapped too, so a clash needs two ids whose SHA-256 agree in the first 40 bits.
#[must_use]
pub fn local_hostname(id: &str) -> String {
    let is_label = (1..=MAX_HOSTNAME_LEN).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !id.starts_with('-')
        && !id.ends_with('-');
    if is_label && !ends_like_derived(id) {
        return id.to_owned();
    }
    let mut base = String::with_capacity(id.len());
    for c in id.chars() {
        let c = c.to_ascii_lowercase();
        if c.is_ascii_lowercase() || c.is_ascii_digit() {
            base.push(c);
        } else if !base.is_empty() && !base.ends_with('-') {
            base.push('-');
        }
    }
    // ASCII only from here on, so any byte length is a character boundary.
    base.truncate(MAX_HOSTNAME_LEN - 1 - HOSTNAME_HASH_DIGITS);
    let base = base.trim_end_matches('-');
    let digest = hex::encode(Sha256::digest(id.as_bytes()));
    let hash = &digest[..HOSTNAME_HASH_DIGITS];
    if base.is_empty() {
        hash.to_owned()
    } else {
        format!("{base}-{hash}")
    }
}

/// Why a seed cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum SeedError {
    /// The instance does not validate ([`InstanceSpec::validate`]).
    #[error(transparent)]
    Invalid(#[from] ValidationError),
    /// A seed document does not encode (a bug).
    #[error("instance {instance}: seed")]
    Encode {
        /// The instance id.
        instance: String,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
}

/// The seed of `inst`. `user_config` is merged into user-data (an object; the caller's keys).
///
/// # Errors
/// [`SeedError::Invalid`] when the instance does not validate ([`InstanceSpec::validate`]).
pub fn seed(
    inst: &InstanceSpec,
    user_config: Option<&Map<String, Value>>,
) -> Result<Seed, SeedError> {
    inst.validate()?;
    let meta = json!({ "instance-id": inst.id, "local-hostname": local_hostname(&inst.id) });
    let user = Value::Object(user_config.cloned().unwrap_or_default());
    let to_s = |v: &Value| {
        serde_json::to_string_pretty(v).map_err(|source| SeedError::Encode {
            instance: inst.id.clone(),
            source,
        })
    };
    Ok(Seed {
        meta_data: to_s(&meta)? + "\n",
        user_data: format!("#cloud-config\n{}\n", to_s(&user)?),
        network_config: network_config(inst)
            .map(|v| to_s(&v))
            .transpose()?
            .map(|s| s + "\n"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmnet_model::nic::{MacAddr, NetworkPolicy};

    fn inst(nics: Vec<NicSpec>) -> InstanceSpec {
        InstanceSpec {
            id: "inst-1".into(),
            allocation_id: "alloc-1".into(),
            policy: NetworkPolicy::Public,
            sandbox: false,
            nics,
        }
    }

    fn static_nic() -> NicSpec {
        NicSpec {
            network: Some("br0".parse().unwrap()),
            mac: MacAddr::for_instance("inst-1"),
            addresses: vec!["10.0.0.2/29".parse().unwrap()],
            gateway: Some("10.0.0.1".parse().unwrap()),
            gateway6: None,
            nameservers: vec!["10.0.0.1".parse().unwrap()],
        }
    }

    #[test]
    fn static_and_dhcp_nics() {
        let dhcp = NicSpec {
            network: Some("br1".parse().unwrap()),
            mac: "02:00:00:00:00:09".parse().unwrap(),
            addresses: vec![],
            gateway: None,
            gateway6: None,
            nameservers: vec![],
        };
        let s = seed(&inst(vec![static_nic(), dhcp]), None).unwrap();
        let nc: Value = serde_json::from_str(s.network_config.as_deref().unwrap()).unwrap();
        assert_eq!(
            nc,
            json!({"version":2,"ethernets":{
                "eth0":{"match":{"macaddress":"02:81:bf:91:24:5c"},"set-name":"eth0","dhcp4":false,
                        "addresses":["10.0.0.2/29"],"routes":[{"to":"0.0.0.0/0","via":"10.0.0.1"}],
                        "nameservers":{"addresses":["10.0.0.1"]}},
                "eth1":{"match":{"macaddress":"02:00:00:00:00:09"},"set-name":"eth1","dhcp4":true}}})
        );
        let meta: Value = serde_json::from_str(&s.meta_data).unwrap();
        assert_eq!(meta["instance-id"], "inst-1");
        assert!(s.user_data.starts_with("#cloud-config\n{"));
        assert_eq!(s.files().len(), 3);
    }

    #[test]
    fn ipv6_gateway_routes_default_v6() {
        let mut n = static_nic();
        n.addresses = vec!["2001:db8::5/64".parse().unwrap()];
        n.gateway = Some("2001:db8::1".parse().unwrap());
        n.nameservers.clear();
        let nc = network_config(&inst(vec![n])).unwrap();
        assert_eq!(nc["ethernets"]["eth0"]["gateway6"], "2001:db8::1");
        assert!(nc["ethernets"]["eth0"].get("routes").is_none());
        assert!(nc["ethernets"]["eth0"].get("nameservers").is_none());
    }

    /// A dual-stack lease: the exact `network-config` (both addresses, IPv4 first, the IPv4
    /// default route and the IPv6 gateway as `gateway6`, `accept-ra: false`, the first range's
    /// nameservers).
    #[test]
    fn dual_stack_network_config_exact() {
        use crate::pool::nic::{Leases, instance_spec};
        let br = "br0".parse().unwrap();
        let r = crate::pool::nic::tests::range();
        let r6 = crate::pool::nic::tests::range6();
        let leases = Leases {
            v4: Some(("10.0.0.2".parse().unwrap(), &r)),
            v6: Some(("2001:db8::2".parse().unwrap(), &r6)),
        };
        let i = instance_spec("inst-1", "a-1", &br, leases, NetworkPolicy::Public, false).unwrap();
        let s = seed(&i, None).unwrap();
        assert_eq!(
            s.network_config.as_deref().unwrap(),
            r#"{
  "ethernets": {
    "eth0": {
      "accept-ra": false,
      "addresses": [
        "10.0.0.2/29",
        "2001:db8::2/64"
      ],
      "dhcp4": false,
      "gateway6": "2001:db8::1",
      "match": {
        "macaddress": "02:81:bf:91:24:5c"
      },
      "nameservers": {
        "addresses": [
          "10.0.0.1",
          "2001:db8::53"
        ]
      },
      "routes": [
        {
          "to": "0.0.0.0/0",
          "via": "10.0.0.1"
        }
      ],
      "set-name": "eth0"
    }
  },
  "version": 2
}
"#
        );
    }

    /// Only an IPv6 lease: the IPv6 address, its link-local gateway as `gateway6`, no
    /// nameservers.
    #[test]
    fn ipv6_only_network_config_exact() {
        use crate::pool::nic::{Leases, instance_spec};
        let br = "br0".parse().unwrap();
        let mut r6 = crate::pool::nic::tests::range6();
        r6.gateway = "fe80::1".parse().unwrap();
        let leases = Leases {
            v4: None,
            v6: Some(("2001:db8::2".parse().unwrap(), &r6)),
        };
        let i = instance_spec("inst-1", "a-1", &br, leases, NetworkPolicy::Public, false).unwrap();
        let s = seed(&i, None).unwrap();
        assert_eq!(
            s.network_config.as_deref().unwrap(),
            r#"{
  "ethernets": {
    "eth0": {
      "accept-ra": false,
      "addresses": [
        "2001:db8::2/64"
      ],
      "dhcp4": false,
      "gateway6": "fe80::1",
      "match": {
        "macaddress": "02:81:bf:91:24:5c"
      },
      "set-name": "eth0"
    }
  },
  "version": 2
}
"#
        );
    }

    #[test]
    fn gateway_outside_every_address_is_on_link() {
        // A /32 lease outside a replaced range keeps the range's gateway.
        let mut n = static_nic();
        n.addresses = vec!["10.0.1.2/32".parse().unwrap()];
        let nc = network_config(&inst(vec![n.clone()])).unwrap();
        assert_eq!(
            nc["ethernets"]["eth0"]["routes"],
            json!([{"to":"0.0.0.0/0","via":"10.0.0.1","on-link":true}])
        );
        // A gateway outside the range's network.
        n.addresses = vec!["10.0.0.2/29".parse().unwrap()];
        n.gateway = Some("10.0.9.1".parse().unwrap());
        let nc = network_config(&inst(vec![n.clone()])).unwrap();
        assert_eq!(nc["ethernets"]["eth0"]["routes"][0]["on-link"], true);
        // One address containing the gateway is enough: no on-link.
        n.addresses.push("10.0.9.5/24".parse().unwrap());
        let nc = network_config(&inst(vec![n.clone()])).unwrap();
        assert_eq!(
            nc["ethernets"]["eth0"]["routes"],
            json!([{"to":"0.0.0.0/0","via":"10.0.9.1"}])
        );
        // IPv6: a gateway outside the /128.
        n.addresses = vec!["2001:db8::5/128".parse().unwrap()];
        n.gateway = Some("2001:db8::1".parse().unwrap());
        let nc = network_config(&inst(vec![n])).unwrap();
        assert_eq!(
            nc["ethernets"]["eth0"]["routes"],
            json!([{"to":"::/0","via":"2001:db8::1","on-link":true}])
        );
    }

    #[test]
    fn no_static_nic_no_network_config() {
        let mut n = static_nic();
        n.addresses.clear();
        n.gateway = None;
        n.nameservers.clear();
        let s = seed(&inst(vec![n]), None).unwrap();
        assert!(s.network_config.is_none());
        assert_eq!(s.files().len(), 2);
    }

    /// RFC 1123 label: 1 to 63 bytes of `a-z 0-9 -`, not starting or ending with `-`.
    fn is_label(h: &str) -> bool {
        (1..=63).contains(&h.len())
            && h.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !h.starts_with('-')
            && !h.ends_with('-')
    }

    #[test]
    fn local_hostname_is_the_id_when_it_is_already_a_hostname() {
        for id in ["inst-1", "web01", "0a", "x", &"a".repeat(63)] {
            assert_eq!(local_hostname(id), id);
        }
        let mut i = inst(vec![static_nic()]);
        i.id = "web01".into();
        let meta: Value = serde_json::from_str(&seed(&i, None).unwrap().meta_data).unwrap();
        assert_eq!(
            meta,
            json!({"instance-id": "web01", "local-hostname": "web01"})
        );
    }

    #[test]
    fn local_hostname_of_other_ids_is_a_label_with_a_hash() {
        let h = local_hostname("Web_01");
        assert_eq!(
            h,
            format!("web-01-{}", &hex::encode(Sha256::digest(b"Web_01"))[..10])
        );
        let cases = [
            "Web_01".to_owned(),
            "web_01".to_owned(),
            "web.01".to_owned(),
            "web-01-".to_owned(),
            "WEB-01".to_owned(),
            "a".repeat(64),
            format!("{}b", "a".repeat(63)),
            format!("{}_", "A".repeat(63)),
            "9_".to_owned(),
            "x..y".to_owned(),
        ];
        let mut seen = std::collections::BTreeSet::new();
        for id in &cases {
            let h = local_hostname(id);
            assert!(is_label(&h), "{id:?} -> {h:?}");
            assert_ne!(&h, id, "{id:?} is not a hostname as it is");
            assert_eq!(h, local_hostname(id), "deterministic");
            assert!(seen.insert(h.clone()), "{id:?} -> {h:?} collides");
        }
        assert!(
            !seen.contains("web-01"),
            "a lossy mapping never gives a plain id"
        );
        // An id shaped like a mapped name is mapped too, so it cannot take another id's name.
        let lookalike = local_hostname("Web_01");
        let h2 = local_hostname(&lookalike);
        assert!(is_label(&h2) && h2 != lookalike, "{h2}");
        assert_eq!(
            local_hostname("web-01-92939705"),
            "web-01-92939705",
            "8 digits: a plain id"
        );
        // The instance's seed carries it.
        let mut i = inst(vec![static_nic()]);
        i.id = "Web_01".into();
        let meta: Value = serde_json::from_str(&seed(&i, None).unwrap().meta_data).unwrap();
        assert_eq!(meta["instance-id"], "Web_01");
        assert_eq!(meta["local-hostname"], h);
    }

    proptest::proptest! {
        /// Every valid instance id gives a label; two different ids give two names.
        #[test]
        fn local_hostname_is_always_a_label_and_injective(
            a in "[A-Za-z0-9][A-Za-z0-9._-]{0,63}",
            b in "[A-Za-z0-9][A-Za-z0-9._-]{0,63}",
        ) {
            let (ha, hb) = (local_hostname(&a), local_hostname(&b));
            proptest::prop_assert!(is_label(&ha), "{} -> {}", a, ha);
            proptest::prop_assert_eq!(a == b, ha == hb, "{} -> {}, {} -> {}", a, ha, b, hb);
            let lower = a.to_ascii_lowercase();
            proptest::prop_assert_eq!(local_hostname(&lower) == ha, lower == a);
        }
    }

    #[test]
    fn invalid_instance_fails_the_seed() {
        let mut n = static_nic();
        n.network = None;
        assert!(seed(&inst(vec![n]), None).is_err());
    }
}
