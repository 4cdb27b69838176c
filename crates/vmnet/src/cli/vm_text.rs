//! The cells of `vmnet vm list` and `vmnet vm get` that summarise a VM's desired config against
//! its status: a value the agent has not put in force yet is marked `*`.

use vmnet_agent::api::types::VmView;
use vmnet_plan::ns::limits::TrafficClass;

/// `private P / public Q` MiB/s, `-` for unlimited (both 0). A limit marked `*` is configured but
/// not shaping in both directions now: not applied yet, or a public limit on a VM without a
/// public path (no route via host).
pub fn limits_text(v: &VmView) -> String {
    let c = &v.config;
    let (p, q) = (
        c.private_network_throughput_mibps,
        c.public_network_throughput_mibps,
    );
    if p == 0 && q == 0 {
        return "-".to_owned();
    }
    let one = |class: TrafficClass, mibps: u32| {
        if mibps == 0 {
            return "unlimited".to_owned();
        }
        let rows: Vec<_> = v
            .status
            .limits
            .iter()
            .filter(|l| l.class == class)
            .collect();
        let in_force = !rows.is_empty() && rows.iter().all(|l| l.applied && l.limit_mibps == mibps);
        format!("{mibps}{}", if in_force { "" } else { "*" })
    };
    format!(
        "private {} / public {}",
        one(TrafficClass::Private, p),
        one(TrafficClass::Public, q)
    )
}

/// The desired public addresses, each marked `*` while it is not applied yet.
pub fn public_text(v: &VmView) -> String {
    let s = &v.status;
    let mut parts = Vec::new();
    if let Some(a) = v.config.public_ipv4 {
        let a = a.to_string();
        let mark = if s.applied_public_ipv4.as_deref() == Some(a.as_str()) {
            ""
        } else {
            "*"
        };
        parts.push(format!("{a}{mark}"));
    }
    if let Some(n) = v.config.public_ipv6 {
        let n = if n.prefix_len() == 128 {
            n.addr().to_string()
        } else {
            n.to_string()
        };
        let mark = if s.applied_public_ipv6.as_deref() == Some(n.as_str()) {
            ""
        } else {
            "*"
        };
        parts.push(format!("{n}{mark}"));
    }
    if parts.is_empty() {
        "-".to_owned()
    } else {
        parts.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// A VM view as the API answers it: `config`, then limit rows (class, applied) for both
    /// directions, and the applied public IPv6.
    fn view(config: &serde_json::Value, rows: &[(&str, u32, bool)], v6: Option<&str>) -> VmView {
        let limits: Vec<_> = ["download", "upload"]
            .iter()
            .flat_map(|d| {
                rows.iter().map(move |(c, l, a)| {
                    json!({"class": c, "direction": d, "limit_mibps": l, "applied": a,
                           "bytes": null, "packets": null, "drops": null})
                })
            })
            .collect();
        serde_json::from_value(json!({
            "config": config,
            "status": {
                "state": "applied", "netns": "vmns0007", "veth_host": null, "veth_ns": null,
                "transit": null, "mtu": 1380, "tap": "vmnt0007", "tap_owner": null,
                "guest_ipv4": "172.16.0.2/30", "gateway_ipv4": "172.16.0.1",
                "guest_mac": "06:00:ac:10:00:02", "mesh_ipv6": "fdaa:1::7",
                "applied_public_ipv4": null, "applied_public_ipv6": v6,
                "public_neighbors": "proxy", "applied_routes": [], "last_error": null,
                "updated_at_unix_ms": 0, "limits": limits,
            }
        }))
        .unwrap()
    }

    fn config(public_limit: u32) -> serde_json::Value {
        json!({"id": "web", "user_id": 7, "tenant": 1, "mesh_ipv6": "fdaa:1::7",
               "public_ipv6": "2001:db8::57", "public_network_throughput_mibps": public_limit,
               "private_network_throughput_mibps": 20,
               "network": {"routes": [{"destination": "::/0", "via": "host"}]}})
    }

    #[test]
    fn an_unapplied_limit_is_marked_as_an_unapplied_address_is() {
        let applied = view(
            &config(2),
            &[("private", 20, true), ("public", 2, true)],
            Some("2001:db8::57"),
        );
        assert_eq!(limits_text(&applied), "private 20 / public 2");
        assert_eq!(public_text(&applied), "2001:db8::57");
        let kept = view(
            &config(2),
            &[("private", 20, true), ("public", 2, false)],
            None,
        );
        assert_eq!(limits_text(&kept), "private 20 / public 2*");
        assert_eq!(public_text(&kept), "2001:db8::57*");
        // Not applied yet (no rows at all): both marked.
        let pending = view(&config(2), &[], None);
        assert_eq!(limits_text(&pending), "private 20* / public 2*");
        // The status of an older limit: marked until the new one is in force.
        let old = view(
            &config(3),
            &[("private", 20, true), ("public", 2, true)],
            Some("2001:db8::57"),
        );
        assert_eq!(limits_text(&old), "private 20 / public 3*");
        let unlimited = view(
            &config(0),
            &[("private", 20, true), ("public", 0, false)],
            None,
        );
        assert_eq!(limits_text(&unlimited), "private 20 / public unlimited");
    }
}
