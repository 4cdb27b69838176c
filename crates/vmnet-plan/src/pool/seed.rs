//! The cloud-init NoCloud seed of an instance (spec: "The guest's network configuration").
//!
//! Three files: `meta-data` (instance-id, local-hostname), `user-data` (`#cloud-config` and a
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
//! MAC and renamed with `set-name: eth<index>`. A static NIC gets `dhcp4: false`, its addresses,
//! a default route (`0.0.0.0/0`, or `::/0` for an IPv6 gateway) via its gateway, and its
//! nameservers. When no address of the NIC contains the gateway (a `/32` lease outside a
//! replaced range, or a gateway outside the range's network, which the model allows) the route
//! carries `"on-link": true`, so the gateway is reached directly on the link instead of the
//! route being refused as unreachable. A NIC without addresses gets `dhcp4: true`. With no static NIC at all there is
//! no network-config, so the image's own fallback (DHCP on the first NIC) stays.

use std::net::IpAddr;

use ipnet::IpNet;
use serde_json::{Map, Value, json};
use vmnet_model::Error;
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

/// The default route of a static NIC through `gw`: `{"to", "via"}`, plus `"on-link": true`
/// when none of the NIC's addresses contains `gw` (cloud-init network-config v2 route key).
fn default_route(nic: &NicSpec, gw: IpAddr) -> Value {
    let to = if gw.is_ipv4() { "0.0.0.0/0" } else { "::/0" };
    let mut r = Map::new();
    r.insert("to".into(), Value::String(to.into()));
    r.insert("via".into(), ip_str(gw));
    if !nic.addresses.iter().any(|a| a.contains(&gw)) {
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
        if let Some(gw) = nic.gateway {
            e.insert("routes".into(), json!([default_route(nic, gw)]));
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

/// The seed of `inst`. `user_config` is merged into user-data (an object; the caller's keys).
///
/// # Errors
/// `INVALID_INPUT` when the instance does not validate ([`InstanceSpec::validate`]).
pub fn seed(inst: &InstanceSpec, user_config: Option<&Map<String, Value>>) -> Result<Seed, Error> {
    inst.validate()?;
    let meta = json!({ "instance-id": inst.id, "local-hostname": inst.id });
    let user = Value::Object(user_config.cloned().unwrap_or_default());
    let to_s = |v: &Value| {
        serde_json::to_string_pretty(v)
            .map_err(|e| Error::internal(format!("instance {}: seed: {e}", inst.id)))
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
        assert_eq!(
            nc["ethernets"]["eth0"]["routes"],
            json!([{"to":"::/0","via":"2001:db8::1"}])
        );
        assert!(nc["ethernets"]["eth0"].get("nameservers").is_none());
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

    #[test]
    fn invalid_instance_fails_the_seed() {
        let mut n = static_nic();
        n.network = None;
        assert!(seed(&inst(vec![n]), None).is_err());
    }
}
