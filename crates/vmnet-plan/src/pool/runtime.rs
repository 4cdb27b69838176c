//! NIC configs for the runtimes users run (spec: "The guest's network configuration"): each NIC
//! on its persistent tap `bc<10 hex>n<index>` with the spec's MAC.
//!
//! - libvirt: one `<interface type='bridge'>` per NIC (virtio model, MAC, `target dev` = tap with
//!   `managed='no'` so libvirt uses the tap vmnet created, `source bridge`).
//! - cloud-hypervisor: `--net tap=<tap>,mac=<mac> …` (one value per NIC after one `--net`).
//! - Firecracker: the `network-interfaces` array (`iface_id`, `host_dev_name`, `guest_mac`).
//! - qemu: `-netdev tap,id=net<i>,ifname=<tap>,script=no,downscript=no -device
//!   virtio-net-pci,netdev=net<i>,mac=<mac>` per NIC.
//! - plugins: a JSON spec with every NIC's tap, bridge, MAC, addresses, gateway and nameservers.
//!
//! All values are printed from parsed types (names of `[A-Za-z0-9_.-]`, MACs, addresses); the
//! XML is escaped anyway.

use serde_json::{Value, json};
use vmnet_model::Error;
use vmnet_model::nic::{IfName, InstanceSpec};

use super::seed::guest_ifname;

/// Escapes `&`, `<`, `>`, `'` and `"` for XML text and attribute values.
#[must_use]
pub fn xml_escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '\'' => o.push_str("&apos;"),
            '"' => o.push_str("&quot;"),
            c => o.push(c),
        }
    }
    o
}

struct Row {
    tap: IfName,
    bridge: IfName,
    mac: String,
}

fn rows(inst: &InstanceSpec) -> Result<Vec<Row>, Error> {
    inst.validate()?;
    let taps = inst.tap_names()?;
    Ok(inst
        .nics
        .iter()
        .zip(taps)
        .filter_map(|(n, tap)| {
            n.network.clone().map(|bridge| Row {
                tap,
                bridge,
                mac: n.mac.to_string(),
            })
        })
        .collect())
}

/// libvirt domain `<interface>` elements, one per NIC, newline separated.
///
/// # Errors
/// `INVALID_INPUT` when the instance does not validate.
pub fn libvirt_interfaces(inst: &InstanceSpec) -> Result<String, Error> {
    let mut out = String::new();
    for r in rows(inst)? {
        out.push_str(&format!(
            "<interface type='bridge'>\n  <mac address='{}'/>\n  <source bridge='{}'/>\n  <target dev='{}' managed='no'/>\n  <model type='virtio'/>\n</interface>\n",
            xml_escape(&r.mac),
            xml_escape(r.bridge.as_str()),
            xml_escape(r.tap.as_str()),
        ));
    }
    Ok(out)
}

/// cloud-hypervisor arguments: `["--net", "tap=…,mac=…", …]`, empty without NICs.
///
/// # Errors
/// `INVALID_INPUT` when the instance does not validate.
pub fn cloud_hypervisor_args(inst: &InstanceSpec) -> Result<Vec<String>, Error> {
    let rows = rows(inst)?;
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let mut v = vec!["--net".to_owned()];
    v.extend(rows.iter().map(|r| format!("tap={},mac={}", r.tap, r.mac)));
    Ok(v)
}

/// Firecracker `network-interfaces`: `[{"iface_id":"eth0","host_dev_name":tap,"guest_mac":mac}]`.
///
/// # Errors
/// `INVALID_INPUT` when the instance does not validate.
pub fn firecracker_interfaces(inst: &InstanceSpec) -> Result<Value, Error> {
    Ok(rows(inst)?
        .iter()
        .enumerate()
        .map(|(i, r)| {
            json!({ "iface_id": guest_ifname(i), "host_dev_name": r.tap.as_str(), "guest_mac": r.mac })
        })
        .collect())
}

/// qemu arguments: `-netdev tap,… -device virtio-net-pci,…` per NIC.
///
/// # Errors
/// `INVALID_INPUT` when the instance does not validate.
pub fn qemu_args(inst: &InstanceSpec) -> Result<Vec<String>, Error> {
    let mut v = Vec::new();
    for (i, r) in rows(inst)?.iter().enumerate() {
        v.push("-netdev".to_owned());
        v.push(format!(
            "tap,id=net{i},ifname={},script=no,downscript=no",
            r.tap
        ));
        v.push("-device".to_owned());
        v.push(format!("virtio-net-pci,netdev=net{i},mac={}", r.mac));
    }
    Ok(v)
}

/// The runtime plugin spec: instance, allocation and each NIC with tap, network, MAC, addresses,
/// gateway and nameservers.
///
/// # Errors
/// `INVALID_INPUT` when the instance does not validate.
pub fn plugin_spec(inst: &InstanceSpec) -> Result<Value, Error> {
    inst.validate()?;
    let taps = inst.tap_names()?;
    let nics: Vec<Value> = inst
        .nics
        .iter()
        .zip(taps)
        .map(|(n, tap)| {
            json!({
                "tap": tap.as_str(),
                "network": n.network.as_ref().map(IfName::as_str),
                "mac": n.mac.to_string(),
                "addresses": n.addresses.iter().map(ToString::to_string).collect::<Vec<_>>(),
                "gateway": n.gateway.map(|g| g.to_string()),
                "nameservers": n.nameservers.iter().map(ToString::to_string).collect::<Vec<_>>(),
            })
        })
        .collect();
    Ok(json!({ "instance_id": inst.id, "allocation_id": inst.allocation_id, "nics": nics }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmnet_model::nic::{MacAddr, NetworkPolicy, NicSpec};

    fn inst() -> InstanceSpec {
        InstanceSpec {
            id: "inst-1".into(),
            allocation_id: "alloc-1".into(),
            policy: NetworkPolicy::Public,
            sandbox: false,
            nics: vec![NicSpec {
                network: Some("br0".parse().unwrap()),
                mac: MacAddr::for_instance("inst-1"),
                addresses: vec!["10.0.0.2/29".parse().unwrap()],
                gateway: Some("10.0.0.1".parse().unwrap()),
                nameservers: vec!["10.0.0.1".parse().unwrap()],
            }],
        }
    }

    #[test]
    fn libvirt_xml() {
        assert_eq!(
            libvirt_interfaces(&inst()).unwrap(),
            "<interface type='bridge'>\n  <mac address='02:81:bf:91:24:5c'/>\n  <source bridge='br0'/>\n  <target dev='bc81bf91245cn0' managed='no'/>\n  <model type='virtio'/>\n</interface>\n"
        );
        assert_eq!(xml_escape("a'<&>\""), "a&apos;&lt;&amp;&gt;&quot;");
    }

    #[test]
    fn cloud_hypervisor_and_qemu() {
        assert_eq!(
            cloud_hypervisor_args(&inst()).unwrap(),
            ["--net", "tap=bc81bf91245cn0,mac=02:81:bf:91:24:5c"]
        );
        assert_eq!(
            qemu_args(&inst()).unwrap(),
            [
                "-netdev",
                "tap,id=net0,ifname=bc81bf91245cn0,script=no,downscript=no",
                "-device",
                "virtio-net-pci,netdev=net0,mac=02:81:bf:91:24:5c"
            ]
        );
    }

    #[test]
    fn firecracker_and_plugin() {
        assert_eq!(
            firecracker_interfaces(&inst()).unwrap(),
            json!([{"iface_id":"eth0","host_dev_name":"bc81bf91245cn0","guest_mac":"02:81:bf:91:24:5c"}])
        );
        let p = plugin_spec(&inst()).unwrap();
        assert_eq!(p["nics"][0]["gateway"], "10.0.0.1");
        assert_eq!(p["nics"][0]["nameservers"], json!(["10.0.0.1"]));
        assert_eq!(p["allocation_id"], "alloc-1");
    }

    #[test]
    fn nic_without_network_is_refused() {
        let mut i = inst();
        i.nics[0].network = None;
        assert!(libvirt_interfaces(&i).is_err());
        assert!(cloud_hypervisor_args(&i).is_err());
    }
}
