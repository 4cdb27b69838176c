//! NIC configs for the runtimes users run (spec: "The guest's network configuration"): each NIC
//! on its persistent tap `bc<10 hex>n<index>` with the spec's MAC.
//!
//! - libvirt: one `<interface type='ethernet'>` per NIC (MAC, `target dev` = the tap vmnet made,
//!   `managed='no'`, virtio model); see [`libvirt_interfaces`] for why not `type='bridge'`.
//! - cloud-hypervisor: `--net tap=<tap>,mac=<mac> …` (one value per NIC after one `--net`).
//! - Firecracker: the `network-interfaces` array (`iface_id`, `host_dev_name`, `guest_mac`).
//! - qemu: `-netdev tap,id=net<i>,ifname=<tap>,script=no,downscript=no -device
//!   virtio-net-pci,netdev=net<i>,mac=<mac>` per NIC.
//! - plugins: a JSON spec with every NIC's tap, bridge, MAC, addresses (the IPv4 lease, then the
//!   IPv6 lease), gateway, `gateway6` (only for a NIC with an IPv6 gateway) and nameservers.
//!
//! All values are printed from parsed types (names of `[A-Za-z0-9_.-]`, MACs, addresses); the
//! XML is escaped anyway.

use serde_json::{Value, json};
use vmnet_model::ValidationError;
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

/// A NIC on a bridge (validation refuses one without): its tap and MAC.
struct Row {
    tap: IfName,
    mac: String,
}

fn rows(inst: &InstanceSpec) -> Result<Vec<Row>, ValidationError> {
    inst.validate()?;
    let taps = inst.tap_names()?;
    Ok(inst
        .nics
        .iter()
        .zip(taps)
        .filter(|(n, _)| n.network.is_some())
        .map(|(n, tap)| Row {
            tap,
            mac: n.mac.to_string(),
        })
        .collect())
}

/// libvirt domain `<interface>` elements, one per NIC, newline separated:
///
/// ```xml
/// <interface type='ethernet'>
///   <mac address='02:…'/>
///   <target dev='bc<10 hex>n0' managed='no'/>
///   <model type='virtio'/>
/// </interface>
/// ```
///
/// # Design
/// vmnet makes the tap itself — persistent, on the NIC's bridge as a locked port with learning
/// off and a static FDB entry, guarded — before the domain starts. So libvirt must use that tap
/// as it is: `type='ethernet'` with `managed='no'` opens the existing tap by name and leaves its
/// bridge port alone. The issue's `type='bridge'` with `<source bridge>` would not work with a
/// pre-made tap: libvirt then adds the tap to the bridge itself, which the kernel refuses
/// (`EBUSY`) for a port that already has a master, and libvirt accepts `managed='no'` only on
/// `type='ethernet'`. The bridge is not named in the XML; it is the NIC's `network`.
/// Validated with `virsh -c test:///default define` (libvirt's own parser and validator) in the
/// tests.
///
/// # Errors
/// `INVALID_INPUT` when the instance does not validate.
pub fn libvirt_interfaces(inst: &InstanceSpec) -> Result<String, ValidationError> {
    let mut out = String::new();
    for r in rows(inst)? {
        out.push_str(&format!(
            "<interface type='ethernet'>\n  <mac address='{}'/>\n  <target dev='{}' managed='no'/>\n  <model type='virtio'/>\n</interface>\n",
            xml_escape(&r.mac),
            xml_escape(r.tap.as_str()),
        ));
    }
    Ok(out)
}

/// cloud-hypervisor arguments: `["--net", "tap=…,mac=…", …]`, empty without NICs.
///
/// # Errors
/// `INVALID_INPUT` when the instance does not validate.
pub fn cloud_hypervisor_args(inst: &InstanceSpec) -> Result<Vec<String>, ValidationError> {
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
pub fn firecracker_interfaces(inst: &InstanceSpec) -> Result<Value, ValidationError> {
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
pub fn qemu_args(inst: &InstanceSpec) -> Result<Vec<String>, ValidationError> {
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
/// gateway, `gateway6` (present only when the NIC has an IPv6 gateway) and nameservers.
///
/// # Errors
/// `INVALID_INPUT` when the instance does not validate.
pub fn plugin_spec(inst: &InstanceSpec) -> Result<Value, ValidationError> {
    inst.validate()?;
    let taps = inst.tap_names()?;
    let nics: Vec<Value> = inst
        .nics
        .iter()
        .zip(taps)
        .map(|(n, tap)| {
            let mut v = json!({
                "tap": tap.as_str(),
                "network": n.network.as_ref().map(IfName::as_str),
                "mac": n.mac.to_string(),
                "addresses": n.addresses.iter().map(ToString::to_string).collect::<Vec<_>>(),
                "gateway": n.gateway.map(|g| g.to_string()),
                "nameservers": n.nameservers.iter().map(ToString::to_string).collect::<Vec<_>>(),
            });
            if let Some(g) = n.gateway6 {
                v["gateway6"] = Value::String(g.to_string());
            }
            v
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
                gateway6: None,
                nameservers: vec!["10.0.0.1".parse().unwrap()],
            }],
        }
    }

    #[test]
    fn libvirt_xml() {
        assert_eq!(
            libvirt_interfaces(&inst()).unwrap(),
            "<interface type='ethernet'>\n  <mac address='02:81:bf:91:24:5c'/>\n  <target dev='bc81bf91245cn0' managed='no'/>\n  <model type='virtio'/>\n</interface>\n"
        );
        assert_eq!(xml_escape("a'<&>\""), "a&apos;&lt;&amp;&gt;&quot;");
    }

    /// One element of a minimal XML reader for the structural test: name, attributes in order,
    /// children.
    #[derive(Debug)]
    struct El {
        name: String,
        attrs: Vec<(String, String)>,
        kids: Vec<El>,
    }

    /// Reads a sequence of elements (tags, `'`/`"`-quoted attributes, self-closing or closed by
    /// a matching end tag; whitespace between tags only). Panics on anything malformed.
    fn parse_xml(src: &str) -> Vec<El> {
        fn unescape(v: &str) -> String {
            v.replace("&apos;", "'")
                .replace("&quot;", "\"")
                .replace("&lt;", "<")
                .replace("&gt;", ">")
                .replace("&amp;", "&")
        }
        let mut stack: Vec<El> = vec![El {
            name: String::new(),
            attrs: vec![],
            kids: vec![],
        }];
        let mut rest = src;
        loop {
            rest = rest.trim_start();
            if rest.is_empty() {
                break;
            }
            assert!(rest.starts_with('<'), "text outside a tag: {rest:?}");
            let end = rest.find('>').expect("unterminated tag");
            let tag = &rest[1..end];
            rest = &rest[end + 1..];
            if let Some(name) = tag.strip_prefix('/') {
                let el = stack.pop().unwrap();
                assert_eq!(el.name, name.trim(), "mismatched end tag");
                stack
                    .last_mut()
                    .expect("end tag without start")
                    .kids
                    .push(el);
                continue;
            }
            let (body, closed) = match tag.strip_suffix('/') {
                Some(b) => (b, true),
                None => (tag, false),
            };
            let mut parts = body.trim();
            let name_end = parts.find(char::is_whitespace).unwrap_or(parts.len());
            let name = parts[..name_end].to_owned();
            assert!(
                !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric()),
                "bad element name {name:?}"
            );
            parts = parts[name_end..].trim_start();
            let mut attrs = Vec::new();
            while !parts.is_empty() {
                let eq = parts.find('=').expect("attribute without =");
                let key = parts[..eq].trim().to_owned();
                let q = parts[eq + 1..].chars().next().expect("attribute value");
                assert!(q == '\'' || q == '"', "unquoted attribute {key}");
                let v_start = eq + 2;
                let v_len = parts[v_start..].find(q).expect("unterminated value");
                let value = &parts[v_start..v_start + v_len];
                assert!(!value.contains('<'), "raw < in attribute {key}");
                assert!(
                    !attrs.iter().any(|(k, _): &(String, String)| *k == key),
                    "attribute {key} twice"
                );
                attrs.push((key, unescape(value)));
                parts = parts[v_start + v_len + 1..].trim_start();
            }
            let el = El {
                name,
                attrs,
                kids: vec![],
            };
            if closed {
                stack.last_mut().unwrap().kids.push(el);
            } else {
                stack.push(el);
            }
        }
        assert_eq!(stack.len(), 1, "unclosed element");
        stack.pop().unwrap().kids
    }

    fn attrs(el: &El) -> Vec<(&str, &str)> {
        el.attrs
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect()
    }

    #[test]
    fn libvirt_xml_structure() {
        let mut i = inst();
        let mut second = i.nics[0].clone();
        second.network = Some("br-2".parse().unwrap());
        second.mac = "02:00:00:00:00:09".parse().unwrap();
        i.nics.push(second);
        let taps = i.tap_names().unwrap();
        let xml = libvirt_interfaces(&i).unwrap();
        let els = parse_xml(&xml);
        assert_eq!(els.len(), 2);
        for ((el, nic), tap) in els.iter().zip(&i.nics).zip(&taps) {
            assert_eq!(el.name, "interface");
            assert_eq!(attrs(el), [("type", "ethernet")]);
            let kids: Vec<&str> = el.kids.iter().map(|k| k.name.as_str()).collect();
            assert_eq!(kids, ["mac", "target", "model"]);
            let mac = nic.mac.to_string();
            assert_eq!(attrs(&el.kids[0]), [("address", mac.as_str())]);
            assert_eq!(
                attrs(&el.kids[1]),
                [("dev", tap.as_str()), ("managed", "no")]
            );
            assert_eq!(attrs(&el.kids[2]), [("type", "virtio")]);
            assert!(el.kids.iter().all(|k| k.kids.is_empty()));
        }
    }

    /// With `virsh` installed, libvirt's own parser and validator (test driver, nothing is
    /// started) accept a domain carrying the interfaces; without it the test says it was skipped.
    #[test]
    fn libvirt_xml_defines_with_virsh_when_available() {
        let found = std::process::Command::new("sh")
            .args(["-c", "command -v virsh"])
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            // scripts/install-deps.sh installs it: under CI its absence is a failure.
            assert!(
                std::env::var_os("CI").is_none(),
                "virsh missing under CI (libvirt-clients)"
            );
            eprintln!("virsh not installed: libvirt validation skipped (structure checked above)");
            return;
        }
        let dir = std::env::temp_dir().join(format!("vmnet-virsh-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("domain.xml");
        let domain = format!(
            "<domain type='test'>\n<name>vmnet-nic-check</name>\n<memory unit='MiB'>64</memory>\n<os><type>hvm</type></os>\n<devices>\n{}</devices>\n</domain>\n",
            libvirt_interfaces(&inst()).unwrap()
        );
        std::fs::write(&file, domain).unwrap();
        let out = std::process::Command::new("virsh")
            .args(["-c", "test:///default", "define"])
            .arg(&file)
            .output()
            .unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            out.status.success(),
            "virsh define: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
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

    /// A dual-stack NIC: both addresses and both gateways reach the plugin; the other runtimes'
    /// configs carry no addresses and stay as for an IPv4-only NIC.
    #[test]
    fn plugin_spec_dual_stack() {
        let v4 = inst();
        assert!(
            plugin_spec(&v4).unwrap()["nics"][0]
                .get("gateway6")
                .is_none()
        );
        let mut i = inst();
        i.nics[0].addresses.push("2001:db8::2/64".parse().unwrap());
        i.nics[0].gateway6 = Some("2001:db8::1".parse().unwrap());
        let p = plugin_spec(&i).unwrap();
        assert_eq!(
            p["nics"][0],
            json!({"tap":"bc81bf91245cn0","network":"br0","mac":"02:81:bf:91:24:5c",
                "addresses":["10.0.0.2/29","2001:db8::2/64"],"gateway":"10.0.0.1",
                "gateway6":"2001:db8::1","nameservers":["10.0.0.1"]})
        );
        assert_eq!(
            libvirt_interfaces(&i).unwrap(),
            libvirt_interfaces(&v4).unwrap()
        );
        assert_eq!(
            cloud_hypervisor_args(&i).unwrap(),
            cloud_hypervisor_args(&v4).unwrap()
        );
        assert_eq!(
            firecracker_interfaces(&i).unwrap(),
            firecracker_interfaces(&v4).unwrap()
        );
        assert_eq!(qemu_args(&i).unwrap(), qemu_args(&v4).unwrap());
    }

    #[test]
    fn nic_without_network_is_refused() {
        let mut i = inst();
        i.nics[0].network = None;
        assert!(libvirt_interfaces(&i).is_err());
        assert!(cloud_hypervisor_args(&i).is_err());
    }
}
