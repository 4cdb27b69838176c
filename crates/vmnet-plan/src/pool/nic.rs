//! The NIC vps sends for a hosted instance (spec: "What reaches the host") and the instance's
//! address list (spec: "Addresses on an instance").
//!
//! One NIC per instance: network = the host bridge, MAC = [`MacAddr::for_instance`], addresses =
//! the IPv4 lease then the IPv6 lease, each in CIDR form ([`lease_cidr`], [`lease6_cidr`]: the
//! prefix length of the range the lease is in, or `/32`, `/128` for a lease the range no longer
//! contains), `gateway` = the IPv4 range's gateway, `gateway6` = the IPv6 range's gateway,
//! nameservers = the first IPv4 range's `dns`. Without a lease the NIC has no addresses,
//! gateways or nameservers; with only an IPv6 lease it has no IPv4 gateway and no nameservers
//! (the pool's DNS servers belong to its first IPv4 range).
//!
//! A lease outside its range (possible after `setIpPool` replaced the range, which keeps
//! existing leases) never fails the host plan: it is given as `/32`, exactly as the store shows
//! it in `Instance.addresses`, and keeps the range's gateway and nameservers; the seed then
//! routes through the gateway on-link ([`crate::pool::seed`]).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv6Net};
use vmnet_model::ValidationError;
use vmnet_model::nic::{IfName, InstanceSpec, MacAddr, NetworkPolicy, NicSpec, append_reported};
use vmnet_model::pool::{IpRange, PoolRange};

/// An instance's leases with the ranges they are in, as the NIC takes them.
#[derive(Debug, Clone, Copy, Default)]
pub struct Leases<'a> {
    /// The IPv4 lease and its range (the first range, or the added IPv4 range it is in; the
    /// nameservers are always the first range's).
    pub v4: Option<(Ipv4Addr, &'a IpRange)>,
    /// The IPv6 lease and the IPv6 range it is in.
    pub v6: Option<(Ipv6Addr, &'a PoolRange)>,
}

impl<'a> Leases<'a> {
    /// Only an IPv4 lease.
    #[must_use]
    pub const fn v4(lease: Option<(Ipv4Addr, &'a IpRange)>) -> Self {
        Self {
            v4: lease,
            v6: None,
        }
    }
}

/// The NIC of instance `instance_id` on bridge `bridge`, with its leases (see the module docs).
/// Never fails: a lease outside its range is given as a host prefix.
#[must_use]
pub fn nic_for_instance(instance_id: &str, bridge: &IfName, leases: Leases<'_>) -> NicSpec {
    let mut nic = NicSpec {
        network: Some(bridge.clone()),
        mac: MacAddr::for_instance(instance_id),
        addresses: Vec::new(),
        gateway: None,
        gateway6: None,
        nameservers: Vec::new(),
    };
    if let Some((addr, range)) = leases.v4 {
        nic.addresses.push(lease_cidr(addr, range));
        nic.gateway = Some(range.gateway.into());
        nic.nameservers.clone_from(&range.dns);
    }
    if let Some((addr, range)) = leases.v6 {
        nic.addresses.push(lease6_cidr(addr, range));
        if let IpAddr::V6(gw) = range.gateway {
            nic.gateway6 = Some(gw);
        }
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

/// The IPv6 lease in CIDR form: the address with the range's prefix length
/// (`2001:db8::2/64`), or `<addr>/128` when `range.cidr` does not contain it (the store's rule
/// for `Instance.addresses`).
#[must_use]
pub fn lease6_cidr(addr: Ipv6Addr, range: &PoolRange) -> IpNet {
    match range.cidr {
        IpNet::V6(net) if net.contains(&addr) => {
            IpNet::V6(Ipv6Net::new(addr, net.prefix_len()).unwrap_or_else(|_| Ipv6Net::from(addr)))
        }
        _ => IpNet::V6(Ipv6Net::from(addr)),
    }
}

/// The [`InstanceSpec`] of a hosted instance: one NIC from [`nic_for_instance`], validated.
///
/// # Errors
/// As [`InstanceSpec::validate`] (e.g. a bridge starting with `bc`).
pub fn instance_spec(
    instance_id: &str,
    allocation_id: &str,
    bridge: &IfName,
    leases: Leases<'_>,
    policy: NetworkPolicy,
    sandbox: bool,
) -> Result<InstanceSpec, ValidationError> {
    let spec = InstanceSpec {
        id: instance_id.to_owned(),
        allocation_id: allocation_id.to_owned(),
        policy,
        sandbox,
        nics: vec![nic_for_instance(instance_id, bridge, leases)],
    };
    spec.validate()?;
    Ok(spec)
}

/// `Instance.addresses` of a hosted instance: the IPv4 lease, then the IPv6 lease (CIDR form,
/// [`lease_cidr`], [`lease6_cidr`]), then every address of the host's status reports in arrival
/// order; reports only add.
#[must_use]
pub fn instance_addresses(leases: Leases<'_>, reports: &[Vec<IpNet>]) -> Vec<IpNet> {
    let mut out = Vec::new();
    if let Some((addr, range)) = leases.v4 {
        out.push(lease_cidr(addr, range));
    }
    if let Some((addr, range)) = leases.v6 {
        out.push(lease6_cidr(addr, range));
    }
    for r in reports {
        append_reported(&mut out, r);
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
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
        let nic = nic_for_instance(
            "inst-1",
            &br,
            Leases::v4(Some(("10.0.0.2".parse().unwrap(), &r))),
        );
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
        let nic = nic_for_instance("inst-1", &br, Leases::default());
        assert!(nic.addresses.is_empty() && nic.gateway.is_none() && nic.nameservers.is_empty());
    }

    #[test]
    fn lease_outside_replaced_range_is_32_with_gateway() {
        let br: IfName = "br0".parse().unwrap();
        let r = range();
        let nic = nic_for_instance(
            "inst-1",
            &br,
            Leases::v4(Some(("10.0.1.2".parse().unwrap(), &r))),
        );
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
            Leases::v4(Some(("10.0.1.2".parse().unwrap(), &r))),
            NetworkPolicy::Public,
            false,
        )
        .unwrap();
        assert_eq!(spec.nics[0], nic);
        // The same rule as the store's Instance.addresses.
        let a = instance_addresses(Leases::v4(Some(("10.0.1.2".parse().unwrap(), &r))), &[]);
        assert_eq!(a, ["10.0.1.2/32".parse::<IpNet>().unwrap()]);
    }

    #[test]
    fn bc_bridge_fails_instance() {
        let br: IfName = "bc0".parse().unwrap();
        let e = instance_spec(
            "inst-1",
            "a-1",
            &br,
            Leases::default(),
            NetworkPolicy::Public,
            false,
        )
        .unwrap_err();
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
        let a = instance_addresses(
            Leases::v4(Some(("10.0.0.2".parse().unwrap(), &r))),
            &reports,
        );
        let s: Vec<String> = a.iter().map(ToString::to_string).collect();
        assert_eq!(s, ["10.0.0.2/29", "fd00::7/64", "192.168.7.2/24"]);
    }

    pub(crate) fn range6() -> PoolRange {
        PoolRange {
            pool_id: "p1".into(),
            family: vmnet_model::pool::Family::Ipv6,
            cidr: "2001:db8::/64".parse().unwrap(),
            gateway: "2001:db8::1".parse().unwrap(),
            first_host: "2001:db8::2".parse().unwrap(),
            last_host: "2001:db8::6".parse().unwrap(),
        }
    }

    /// Both leases: the IPv4 lease then the IPv6 lease, each with its range's prefix length,
    /// `gateway` the IPv4 range's and `gateway6` the IPv6 range's, the first range's
    /// nameservers; the same order as `Instance.addresses`.
    #[test]
    fn dual_stack_nic() {
        let br: IfName = "br0".parse().unwrap();
        let (r, r6) = (range(), range6());
        let leases = Leases {
            v4: Some(("10.0.0.2".parse().unwrap(), &r)),
            v6: Some(("2001:db8::2".parse().unwrap(), &r6)),
        };
        let nic = nic_for_instance("inst-1", &br, leases);
        assert_eq!(
            serde_json::to_value(&nic).unwrap(),
            serde_json::json!({"network":"br0","mac":"02:81:bf:91:24:5c",
                "addresses":["10.0.0.2/29","2001:db8::2/64"],"gateway":"10.0.0.1",
                "gateway6":"2001:db8::1","nameservers":["10.0.0.1","2001:db8::53"]})
        );
        let spec =
            instance_spec("inst-1", "a-1", &br, leases, NetworkPolicy::Public, false).unwrap();
        assert_eq!(spec.nics[0], nic);
        assert_eq!(instance_addresses(leases, &[]), nic.addresses);
    }

    /// Only an IPv6 lease (an IPv6-only pool): its address and `gateway6`, no IPv4 gateway and
    /// no nameservers. A lease its range does not contain is a `/128`.
    #[test]
    fn ipv6_only_nic_and_a_lease_outside_its_range() {
        let br: IfName = "br0".parse().unwrap();
        let r6 = range6();
        let leases = Leases {
            v4: None,
            v6: Some(("2001:db8::5".parse().unwrap(), &r6)),
        };
        let spec =
            instance_spec("inst-1", "a-1", &br, leases, NetworkPolicy::Public, false).unwrap();
        assert_eq!(
            serde_json::to_value(&spec.nics[0]).unwrap(),
            serde_json::json!({"network":"br0","mac":"02:81:bf:91:24:5c",
                "addresses":["2001:db8::5/64"],"gateway":null,"gateway6":"2001:db8::1",
                "nameservers":[]})
        );
        assert_eq!(
            lease6_cidr("2001:db8:1::5".parse().unwrap(), &r6).to_string(),
            "2001:db8:1::5/128"
        );
    }
}
