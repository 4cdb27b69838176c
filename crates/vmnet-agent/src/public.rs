//! Public addresses are unique on a host: a VM's `public_ipv4`, or a `public_ipv6` address or
//! block that another VM holds or overlaps, is refused with `CONFLICT` naming that VM, checked
//! in the transaction that stores the config (PUTs are serialized by the agent's kernel lock).
//! Nor may a public address be one of the host's own (its uplink's): the VM would take the
//! host's inbound traffic ([`check_host`]).

use ipnet::Ipv6Net;
use vmnet_ipam::IpamError;
use vmnet_ipam::db::Tx;
use vmnet_ipam::vm_store;
use vmnet_model::vm::{VmConfig, parse_vm_config};

fn text6(n: Ipv6Net) -> String {
    if n.prefix_len() == 128 {
        n.addr().to_string()
    } else {
        n.to_string()
    }
}

/// The conflict between `cfg` and another VM's config `other` (id `other_id`), if any.
#[must_use]
pub fn conflict(cfg: &VmConfig, other_id: &str, other: &VmConfig) -> Option<IpamError> {
    let vm = &cfg.id;
    if let (Some(a), Some(b)) = (cfg.public_ipv4, other.public_ipv4)
        && a == b
    {
        return Some(IpamError::Conflict(format!(
            "vm {vm}: public_ipv4 {a} is already used by vm {other_id}"
        )));
    }
    if let (Some(a), Some(b)) = (cfg.public_ipv6, other.public_ipv6)
        && (a.contains(&b) || b.contains(&a))
    {
        let what = if a == b {
            format!("public_ipv6 {} is already used by vm {other_id}", text6(a))
        } else {
            format!(
                "public_ipv6 {} overlaps public_ipv6 {} of vm {other_id}",
                text6(a),
                text6(b)
            )
        };
        return Some(IpamError::Conflict(format!("vm {vm}: {what}")));
    }
    None
}

/// `CONFLICT` when another stored VM holds or overlaps one of `cfg`'s public addresses.
///
/// # Errors
/// `CONFLICT` naming the other VM; `UNAVAILABLE` on a store failure.
pub async fn check(tx: &mut Tx, cfg: &VmConfig) -> Result<(), IpamError> {
    if cfg.public_ipv4.is_none() && cfg.public_ipv6.is_none() {
        return Ok(());
    }
    for (id, json) in vm_store::with_public(tx, &cfg.id).await? {
        // A stored config that no longer parses holds nothing we can compare; the agent reports
        // it elsewhere.
        let Ok(other) = parse_vm_config(json.as_bytes()) else {
            continue;
        };
        if let Some(e) = conflict(cfg, &id, &other) {
            return Err(e);
        }
    }
    Ok(())
}

/// `INVALID_INPUT` when one of `cfg`'s public addresses is an address of the host itself, or its
/// routed block holds one, as the driver finds them in the host's routing tables.
///
/// # Errors
/// `INVALID_INPUT` naming the VM, the field and the address; the driver's error when the host
/// cannot be read.
pub async fn check_host(
    driver: &dyn vmnet_kernel::ns::NsDriver,
    cfg: &VmConfig,
) -> Result<(), vmnet_model::Error> {
    let mut addrs = Vec::new();
    addrs.extend(cfg.public_ipv4.map(std::net::IpAddr::V4));
    addrs.extend(cfg.public_ipv6_mapped().map(std::net::IpAddr::V6));
    let block = cfg.public_ipv6_block();
    if addrs.is_empty() && block.is_none() {
        return Ok(());
    }
    let Some(held) = driver
        .host_address_in(&addrs, block)
        .await
        .map_err(|e| crate::api::error::from_ns(&e))?
    else {
        return Ok(());
    };
    let field = if held.is_ipv4() {
        "public_ipv4"
    } else {
        "public_ipv6"
    };
    let what = match block {
        Some(b) if held.is_ipv6() && cfg.public_ipv6_mapped().is_none() => {
            format!("{b} holds {held}, an address of this host")
        }
        _ => format!("{held} is an address of this host"),
    };
    Err(vmnet_model::Error::invalid(format!(
        "vm {}: {field} {what}: the VM would take the host's own inbound traffic",
        cfg.id
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vm(id: &str, uid: u32, public: &str) -> VmConfig {
        parse_vm_config(format!(
            r#"{{"id":"{id}","user_id":{uid},"tenant":1,"mesh_ipv6":"fdaa:1::{uid}"{public},"network":{{"routes":[{{"destination":"0.0.0.0/0","via":"host"}},{{"destination":"::/0","via":"host"}}]}}}}"#
        ).as_bytes())
        .unwrap()
    }

    #[test]
    fn each_overlap_is_a_conflict_naming_the_holder() {
        let a = vm(
            "a",
            1,
            r#","public_ipv4":"203.0.113.5","public_ipv6":"2001:db8:7::/56""#,
        );
        let msg = |b: &VmConfig| {
            conflict(b, "a", &a).map(|e| {
                let e = crate::api::error::from_ipam(e);
                (e.code, e.message)
            })
        };
        let c = vmnet_model::ErrorCode::Conflict;
        assert_eq!(
            msg(&vm("b", 2, r#","public_ipv4":"203.0.113.5""#)),
            Some((
                c,
                "vm b: public_ipv4 203.0.113.5 is already used by vm a".into()
            ))
        );
        assert_eq!(
            msg(&vm("b", 2, r#","public_ipv6":"2001:db8:7:5::1""#)),
            Some((
                c,
                "vm b: public_ipv6 2001:db8:7:5::1 overlaps public_ipv6 2001:db8:7::/56 of vm a"
                    .into()
            ))
        );
        assert_eq!(
            msg(&vm("b", 2, r#","public_ipv6":"2001:db8:7::/48""#)),
            Some((
                c,
                "vm b: public_ipv6 2001:db8:7::/48 overlaps public_ipv6 2001:db8:7::/56 of vm a"
                    .into()
            ))
        );
        assert_eq!(
            msg(&vm("b", 2, r#","public_ipv6":"2001:db8:7::/56""#)),
            Some((
                c,
                "vm b: public_ipv6 2001:db8:7::/56 is already used by vm a".into()
            ))
        );
        assert_eq!(
            msg(&vm(
                "b",
                2,
                r#","public_ipv4":"203.0.113.6","public_ipv6":"2001:db8:8::1""#
            )),
            None
        );
    }
}
