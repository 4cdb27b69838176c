//! Public addresses are unique on a host: a VM's `public_ipv4`, or a `public_ipv6` address or
//! block that another VM holds or overlaps, is refused with `CONFLICT` naming that VM, checked
//! in the transaction that stores the config (PUTs are serialized by the agent's kernel lock).
//! Nor may a public address be one of the host's own (its uplink's): the VM would take the
//! host's inbound traffic ([`check_host`]).

use std::net::Ipv4Addr;

use ipnet::Ipv6Net;
use vmnet_ipam::IpamError;
use vmnet_ipam::db::Tx;
use vmnet_ipam::vm_store;
use vmnet_kernel::ns::HostUse;
use vmnet_model::vm::VmConfig;

fn text6(n: Ipv6Net) -> String {
    if n.prefix_len() == 128 {
        n.addr().to_string()
    } else {
        n.to_string()
    }
}

/// The public addresses a VM's config holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Held {
    /// `public_ipv4`.
    pub v4: Option<Ipv4Addr>,
    /// `public_ipv6` (an address as its /128, or a routed block).
    pub v6: Option<Ipv6Net>,
}

/// A stored config's public fields as text, everything else skipped unparsed.
#[derive(serde::Deserialize)]
struct HeldText {
    public_ipv4: Option<String>,
    public_ipv6: Option<String>,
}

impl Held {
    /// What `cfg` holds.
    #[must_use]
    pub fn of(cfg: &VmConfig) -> Self {
        Self {
            v4: cfg.public_ipv4,
            v6: cfg.public_ipv6,
        }
    }

    /// What a stored (validated) config holds, read from its JSON without validating the rest
    /// of it (a firewall of 50 prefixes included). `None` when the fields do not parse.
    #[must_use]
    pub fn from_json(json: &str) -> Option<Self> {
        let t: HeldText = serde_json::from_str(json).ok()?;
        let v4 = t.public_ipv4.map(|a| a.parse()).transpose().ok()?;
        let v6 = match t.public_ipv6 {
            None => None,
            Some(s) if s.contains('/') => Some(s.parse().ok()?),
            Some(s) => Some(Ipv6Net::from(s.parse::<std::net::Ipv6Addr>().ok()?)),
        };
        Some(Self { v4, v6 })
    }
}

/// The conflict between `cfg` and what another VM (id `other_id`) holds, if any.
#[must_use]
pub fn conflict(cfg: &VmConfig, other_id: &str, other: &Held) -> Option<IpamError> {
    let vm = &cfg.id;
    if let (Some(a), Some(b)) = (cfg.public_ipv4, other.v4)
        && a == b
    {
        return Some(IpamError::Conflict(format!(
            "vm {vm}: public_ipv4 {a} is already used by vm {other_id}"
        )));
    }
    if let (Some(a), Some(b)) = (cfg.public_ipv6, other.v6)
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

/// `CONFLICT` when another stored VM holds or overlaps one of `cfg`'s public addresses (read
/// through the store's index: the rows that could conflict, not every VM).
///
/// # Errors
/// `CONFLICT` naming the other VM; `UNAVAILABLE` on a store failure.
pub async fn check(tx: &mut Tx, cfg: &VmConfig) -> Result<(), IpamError> {
    if cfg.public_ipv4.is_none() && cfg.public_ipv6.is_none() {
        return Ok(());
    }
    for (id, json) in
        vm_store::public_candidates(tx, &cfg.id, cfg.public_ipv4, cfg.public_ipv6).await?
    {
        // A stored config whose public fields do not parse holds nothing we can compare; the
        // agent reports it elsewhere.
        let Some(other) = Held::from_json(&json) else {
            continue;
        };
        if let Some(e) = conflict(cfg, &id, &other) {
            return Err(e);
        }
    }
    Ok(())
}

/// `INVALID_INPUT` when one of `cfg`'s public addresses is one the host's own network needs
/// (the gateway of one of its routes, a broadcast or subnet-router anycast address, the network
/// address of its subnet), or an address of the host itself, or its routed block holds one, as
/// the driver finds them in the host's routing tables.
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
    let Some((held, used)) = driver
        .host_use(&addrs, block)
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
    if let HostUse::Reserved(why) = used {
        return Err(vmnet_model::Error::invalid(format!(
            "vm {}: {field} {held} is {why}: no VM may hold it",
            cfg.id
        )));
    }
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
    use vmnet_model::vm::parse_vm_config;

    use super::*;

    #[test]
    fn a_stored_config_holds_what_its_parse_holds() {
        for public in [
            r#","public_ipv4":"203.0.113.5","public_ipv6":"2001:db8:7::/56""#,
            r#","public_ipv6":"2001:db8:7:5::1""#,
            r#","public_ipv4":"198.51.100.9""#,
            "",
        ] {
            let cfg = vm("a", 1, public);
            let stored = serde_json::to_string(&cfg).unwrap();
            assert_eq!(Held::from_json(&stored), Some(Held::of(&cfg)), "{stored}");
        }
        assert_eq!(Held::from_json(r#"{"public_ipv4":"300.1.1.1"}"#), None);
        assert_eq!(Held::from_json("not json"), None);
    }

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
            conflict(b, "a", &Held::of(&a)).map(|e| {
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
