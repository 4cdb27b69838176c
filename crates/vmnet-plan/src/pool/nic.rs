//! The NIC vps sends for a hosted instance (spec: "What reaches the host") and the instance's
//! address list (spec: "Addresses on an instance").
//!
//! One NIC per instance: network = the host bridge, MAC = [`MacAddr::for_instance`], addresses =
//! the lease in CIDR form ([`lease_cidr`]: the range's prefix length, or `/32` for a lease the
//! range no longer contains), gateway = the range's gateway, nameservers = the range's `dns`.
//! Without a lease the NIC has no addresses, gateway or nameservers.
//!
//! A lease outside its range (possible after `setIpPool` replaced the range, which keeps
//! existing leases) never fails the host plan: it is given as `/32`, exactly as the store shows
//! it in `Instance.addresses`, and keeps the range's gateway and nameservers; the seed then
//! routes through the gateway on-link ([`crate::pool::seed`]).

use std::net::Ipv4Addr;

use ipnet::IpNet;
use vmnet_model::ValidationError;
use vmnet_model::nic::{IfName, InstanceSpec, MacAddr, NetworkPolicy, NicSpec, append_reported};
use vmnet_model::pool::IpRange;

/// The NIC of instance `instance_id` on bridge `bridge`, with its lease (`address` from
/// `range`) if it holds one. Never fails: a lease outside the range is given as `/32`.
#[must_use]
pub fn nic_for_instance(
    instance_id: &str,
    bridge: &IfName,
    lease: Option<(Ipv4Addr, &IpRange)>,
) -> NicSpec {
    let mut nic = NicSpec {
        network: Some(bridge.clone()),
        mac: MacAddr::for_instance(instance_id),
        addresses: Vec::new(),
        gateway: None,
        nameservers: Vec::new(),
    };
    if let Some((addr, range)) = lease {
        nic.addresses.push(lease_cidr(addr, range));
        nic.gateway = Some(range.gateway.into());
        nic.nameservers.clone_from(&range.dns);
    }
    nic
}

/// The lease in CIDR form: the address with the range's prefix length (`10.0.0.2/24`), or
/// `<addr>/32` when `range.cidr` does not contain it ([`vmnet_model::nic::lease_cidr`], the rule
/// the store uses for `Instance.addresses`).
#[must_use]
pub fn lease_cidr(addr: Ipv4Addr, range: &IpRange) -> IpNet {
    IpNet::V4(vmnet_model::nic::lease_cidr(addr, Some(range.cidr)))
}

/// The [`InstanceSpec`] of a hosted instance: one NIC from [`nic_for_instance`], validated.
///
/// # Errors
/// As [`InstanceSpec::validate`] (e.g. a bridge starting with `bc`).
pub fn instance_spec(
    instance_id: &str,
    allocation_id: &str,
    bridge: &IfName,
    lease: Option<(Ipv4Addr, &IpRange)>,
    policy: NetworkPolicy,
    sandbox: bool,
) -> Result<InstanceSpec, ValidationError> {
    let spec = InstanceSpec {
        id: instance_id.to_owned(),
        allocation_id: allocation_id.to_owned(),
        policy,
        sandbox,
        nics: vec![nic_for_instance(instance_id, bridge, lease)],
    };
    spec.validate()?;
    Ok(spec)
}

/// `Instance.addresses` of a hosted instance: the lease first (CIDR form, [`lease_cidr`]), then
/// every address of the host's status reports in arrival order; reports only add.
#[must_use]
pub fn instance_addresses(
    lease: Option<(Ipv4Addr, &IpRange)>,
    reports: &[Vec<IpNet>],
) -> Vec<IpNet> {
    let mut out = Vec::new();
    if let Some((addr, range)) = lease {
        out.push(lease_cidr(addr, range));
    }
    for r in reports {
        append_reported(&mut out, r);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn range() -> IpRange {
        IpRange {
            pool_id: "p1".into(),
            cidr: "10.0.0.0/29".parse().unwrap(),
            gateway: "10.0.0.1".parse().unwrap(),
            first_host: "10.0.0.2".parse().unwrap(),
            last_host: "10.0.0.6".parse().unwrap(),
            dns: vec!["10.0.0.1".parse().unwrap(), "2001:db8::53".parse().unwrap()],
        }
    }

    #[test]
    fn nic_with_lease() {
        let br: IfName = "br0".parse().unwrap();
        let r = range();
        let nic = nic_for_instance("inst-1", &br, Some(("10.0.0.2".parse().unwrap(), &r)));
        let j = serde_json::to_value(&nic).unwrap();
        assert_eq!(
            j,
            serde_json::json!({"network":"br0","mac":"02:81:bf:91:24:5c","addresses":["10.0.0.2/29"],
                "gateway":"10.0.0.1","nameservers":["10.0.0.1","2001:db8::53"]})
        );
    }

    #[test]
    fn nic_without_lease_has_nothing() {
        let br: IfName = "br0".parse().unwrap();
        let nic = nic_for_instance("inst-1", &br, None);
        assert!(nic.addresses.is_empty() && nic.gateway.is_none() && nic.nameservers.is_empty());
    }

    #[test]
    fn lease_outside_replaced_range_is_32_with_gateway() {
        let br: IfName = "br0".parse().unwrap();
        let r = range();
        let nic = nic_for_instance("inst-1", &br, Some(("10.0.1.2".parse().unwrap(), &r)));
        let j = serde_json::to_value(&nic).unwrap();
        assert_eq!(
            j,
            serde_json::json!({"network":"br0","mac":"02:81:bf:91:24:5c","addresses":["10.0.1.2/32"],
                "gateway":"10.0.0.1","nameservers":["10.0.0.1","2001:db8::53"]})
        );
        let spec = instance_spec(
            "inst-1",
            "a-1",
            &br,
            Some(("10.0.1.2".parse().unwrap(), &r)),
            NetworkPolicy::Public,
            false,
        )
        .unwrap();
        assert_eq!(spec.nics[0], nic);
        // The same rule as the store's Instance.addresses.
        let a = instance_addresses(Some(("10.0.1.2".parse().unwrap(), &r)), &[]);
        assert_eq!(a, ["10.0.1.2/32".parse::<IpNet>().unwrap()]);
    }

    #[test]
    fn bc_bridge_fails_instance() {
        let br: IfName = "bc0".parse().unwrap();
        let e =
            instance_spec("inst-1", "a-1", &br, None, NetworkPolicy::Public, false).unwrap_err();
        assert!(e.message().contains("nics[0].network"), "{e}");
    }

    #[test]
    fn lease_stays_first() {
        let r = range();
        let reports = vec![
            vec!["fd00::7/64".parse().unwrap()],
            vec![
                "10.0.0.2/29".parse().unwrap(),
                "192.168.7.2/24".parse().unwrap(),
            ],
        ];
        let a = instance_addresses(Some(("10.0.0.2".parse().unwrap(), &r)), &reports);
        let s: Vec<String> = a.iter().map(ToString::to_string).collect();
        assert_eq!(s, ["10.0.0.2/29", "fd00::7/64", "192.168.7.2/24"]);
    }
}
