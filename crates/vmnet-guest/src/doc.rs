//! What the guest agent reads: `meta-data/mesh-ipv6` and `meta-data/host-routes` (both from
//! one JSON read of the `meta-data` folder), checked before anything is applied.

use std::net::Ipv6Addr;

use ipnet::IpNet;
use vmnet_model::vm::{MESH_RANGE, parse_net};

/// The largest value accepted, bytes (the metadata service's whole-document cap).
pub const MAX_VALUE_BYTES: usize = 51_200;

/// The network configuration the metadata service asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestNet {
    /// The mesh address (configured as a /128).
    pub mesh_ipv6: Ipv6Addr,
    /// The destinations routed through the host, in the document's order.
    pub host_routes: Vec<IpNet>,
}

/// Checks the two values: `mesh` an IPv6 address in `fdaa::/16`, `routes` empty or one canonical
/// prefix per line (no blank lines, no duplicates), neither over [`MAX_VALUE_BYTES`].
///
/// # Errors
/// A message saying what is wrong; the caller keeps its last good configuration.
pub fn parse(mesh: &str, routes: &str) -> Result<GuestNet, String> {
    if mesh.len() > MAX_VALUE_BYTES || routes.len() > MAX_VALUE_BYTES {
        return Err(format!(
            "a value is larger than {MAX_VALUE_BYTES} bytes (mesh-ipv6 {}, host-routes {})",
            mesh.len(),
            routes.len()
        ));
    }
    let m = mesh.trim_end_matches('\n');
    let mesh_ipv6: Ipv6Addr = m
        .parse()
        .map_err(|_| format!("mesh-ipv6 {m:?} is not an IPv6 address"))?;
    if !MESH_RANGE.contains(&mesh_ipv6) {
        return Err(format!("mesh-ipv6 {mesh_ipv6} is not in {MESH_RANGE}"));
    }
    let mut host_routes: Vec<IpNet> = Vec::new();
    let body = routes.strip_suffix('\n').unwrap_or(routes);
    if !body.is_empty() {
        for (i, line) in body.split('\n').enumerate() {
            let n = parse_net(line)
                .filter(|n| n.trunc() == *n)
                .ok_or_else(|| format!("host-routes line {}: {line:?} is not a prefix", i + 1))?;
            if host_routes.contains(&n) {
                return Err(format!("host-routes line {}: {n} appears twice", i + 1));
            }
            host_routes.push(n);
        }
    }
    Ok(GuestNet {
        mesh_ipv6,
        host_routes,
    })
}

/// Takes the two values out of the JSON form of the `meta-data` folder (an object whose
/// `mesh-ipv6` and `host-routes` are strings; other keys are ignored), then checks them with
/// [`parse`].
///
/// # Errors
/// A message naming the missing or mistyped key, or what [`parse`] finds wrong.
pub fn parse_folder(json: &str) -> Result<GuestNet, String> {
    let v: serde_json::Value = serde_json::from_str(json)
        .map_err(|e| format!("meta-data is not JSON ({} bytes): {e}", json.len()))?;
    let obj = v
        .as_object()
        .ok_or_else(|| "meta-data is not a folder (JSON object)".to_owned())?;
    parse(field(obj, "mesh-ipv6")?, field(obj, "host-routes")?)
}

/// The string at `key` of `obj`.
fn field<'a>(
    obj: &'a serde_json::Map<String, serde_json::Value>,
    key: &str,
) -> Result<&'a str, String> {
    match obj.get(key) {
        None => Err(format!("{key}: missing")),
        Some(serde_json::Value::String(s)) => Ok(s),
        Some(_) => Err(format!("{key}: not a string")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_folder_as_json() {
        let g = parse_folder(
            r#"{"instance-id":"a","mesh-ipv6":"fdaa:1::7","host-routes":"0.0.0.0/0\n::/0"}"#,
        )
        .unwrap();
        assert_eq!(g, parse("fdaa:1::7", "0.0.0.0/0\n::/0").unwrap());
        for (body, want) in [
            ("", "not JSON"),
            ("{\"mesh-ipv6\": \"fdaa::1\"", "not JSON"),
            ("\"fdaa::1\"", "not a folder"),
            (r#"{"host-routes":""}"#, "mesh-ipv6: missing"),
            (r#"{"mesh-ipv6":"fdaa::1"}"#, "host-routes: missing"),
            (
                r#"{"mesh-ipv6":7,"host-routes":""}"#,
                "mesh-ipv6: not a string",
            ),
            (
                r#"{"mesh-ipv6":"fdaa::1","host-routes":["::/0"]}"#,
                "not a string",
            ),
            (
                r#"{"mesh-ipv6":"2001:db8::1","host-routes":""}"#,
                "not in fdaa::/16",
            ),
        ] {
            let e = parse_folder(body).unwrap_err();
            assert!(e.contains(want), "{body:?}: {e}");
        }
    }

    #[test]
    fn good_values() {
        let g = parse("fdaa:1::7", "0.0.0.0/0\n::/0").unwrap();
        assert_eq!(g.mesh_ipv6, "fdaa:1::7".parse::<Ipv6Addr>().unwrap());
        assert_eq!(g.host_routes.len(), 2);
        assert_eq!(parse("fdaa:1::7\n", "").unwrap().host_routes, []);
    }

    #[test]
    fn malformed_values() {
        for (mesh, routes, want) in [
            ("", "", "is not an IPv6 address"),
            ("fdaa:1::7x", "", "is not an IPv6 address"),
            ("2001:db8::1", "", "is not in fdaa::/16"),
            ("<html>", "", "is not an IPv6 address"),
            ("fdaa::1", "0.0.0.0/0\n\n::/0", "line 2"),
            ("fdaa::1", "10.0.0.1/8", "is not a prefix"),
            ("fdaa::1", "0.0.0.0/", "is not a prefix"),
            ("fdaa::1", "::/0\n::/0", "appears twice"),
        ] {
            let e = parse(mesh, routes).unwrap_err();
            assert!(e.contains(want), "{mesh:?} {routes:?}: {e}");
        }
    }

    #[test]
    fn truncated_values() {
        // A value cut in the middle of an address or a prefix.
        assert!(parse("fdaa:1:", "").is_err());
        assert!(parse("fdaa::1", "0.0.0.0/0\n::/").is_err());
        assert!(parse("fdaa::1", "0.0.0.0/0\n20").is_err());
    }

    #[test]
    fn oversized_values() {
        let big = "a".repeat(MAX_VALUE_BYTES + 1);
        assert!(parse(&big, "").unwrap_err().contains("larger than"));
        assert!(parse("fdaa::1", &big).unwrap_err().contains("larger than"));
    }
}
