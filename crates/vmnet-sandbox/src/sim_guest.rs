//! A simulated guest configures its interface from its own NoCloud `network-config` the way
//! cloud-init's v2 renderer would: the ethernet whose `match.macaddress` is the interface's MAC
//! gets its static addresses and its default routes (`routes`, then `gateway4`/`gateway6`);
//! `dhcp4: true` leaves it unconfigured. For sandboxes and tests only (`vmnet-lab up
//! --sandbox`, the pool integration tests).
//!
//! # Limitations
//! Uses `ip -n NS …` (iproute2); nameservers are returned, not written anywhere.

use std::process::Command;

use serde_json::Value;
use vmnet_model::nic::MacAddr;

/// What the guest configured.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GuestNet {
    /// Static addresses (CIDR).
    pub addresses: Vec<String>,
    /// Default routes as `(to, via)`: the `routes` in order, then `gateway4`, `gateway6`.
    pub routes: Vec<(String, String)>,
    /// Nameservers.
    pub nameservers: Vec<String>,
    /// Whether the NIC was left to DHCP (or not mentioned).
    pub dhcp: bool,
}

fn ip(ns: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .arg("-n")
        .arg(ns)
        .args(args)
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip -n {ns} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn strings(v: Option<&Value>) -> Vec<String> {
    v.and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

/// Configures `ifname` in `ns` (MAC `mac`, brought up) from `network_config` (the JSON of the
/// seed's `network-config`, or `None` when the seed has none).
///
/// # Errors
/// A message when the document is not JSON or an `ip` command fails.
pub fn configure(
    ns: &str,
    ifname: &str,
    mac: MacAddr,
    network_config: Option<&str>,
) -> Result<GuestNet, String> {
    let m = mac.to_string();
    ip(ns, &["link", "set", ifname, "address", &m])?;
    ip(ns, &["link", "set", ifname, "up"])?;
    let Some(doc) = network_config else {
        return Ok(GuestNet {
            dhcp: true,
            ..GuestNet::default()
        });
    };
    let v: Value = serde_json::from_str(doc).map_err(|e| format!("network-config: {e}"))?;
    let eth = v["ethernets"].as_object().and_then(|o| {
        o.values().find(|e| {
            e["match"]["macaddress"]
                .as_str()
                .is_some_and(|x| x.eq_ignore_ascii_case(&m))
        })
    });
    let Some(eth) = eth else {
        return Ok(GuestNet {
            dhcp: true,
            ..GuestNet::default()
        });
    };
    let mut g = GuestNet {
        dhcp: eth["dhcp4"].as_bool().unwrap_or(false),
        ..GuestNet::default()
    };
    for a in strings(eth.get("addresses")) {
        ip(ns, &["addr", "add", &a, "dev", ifname, "nodad"])?;
        g.addresses.push(a);
    }
    for r in eth["routes"].as_array().into_iter().flatten() {
        let (Some(to), Some(via)) = (r["to"].as_str(), r["via"].as_str()) else {
            continue;
        };
        let fam = if to.contains(':') { "-6" } else { "-4" };
        let dest = if to == "0.0.0.0/0" || to == "::/0" {
            "default"
        } else {
            to
        };
        ip(ns, &[fam, "route", "add", dest, "via", via, "dev", ifname])?;
        g.routes.push((to.to_owned(), via.to_owned()));
    }
    // The v2 gateway keys: a default route each, as cloud-init renders them.
    for (key, fam, to) in [("gateway4", "-4", "0.0.0.0/0"), ("gateway6", "-6", "::/0")] {
        if let Some(via) = eth[key].as_str() {
            ip(
                ns,
                &[fam, "route", "add", "default", "via", via, "dev", ifname],
            )?;
            g.routes.push((to.to_owned(), via.to_owned()));
        }
    }
    g.nameservers = strings(eth["nameservers"].get("addresses"));
    Ok(g)
}
