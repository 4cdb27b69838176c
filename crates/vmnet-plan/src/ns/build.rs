//! The planner: one VM config and the settings → its [`VmPlan`]; the settings → the
//! [`HostPlan`]. Pure functions over data.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use vmnet_model::ValidationError;
use vmnet_model::vm::{Via, VmConfig};

use super::names::{self, NameKind, name};
use super::nft;
use super::public::{self, PublicNeighbors};
use super::settings::NsSettings;
use super::topology::*;
use super::types::*;

/// The host-wide plan, or `None` when `settings.manage_host` is false.
#[must_use]
pub fn plan_host(settings: &NsSettings) -> Option<HostPlan> {
    settings.manage_host.then(|| {
        let nft_table = names::host_nft_table(&settings.name_prefix);
        let (nft, nft_fingerprint) = nft::host_ruleset(&nft_table, settings.transit_ipv4);
        let pub_table = names::pub_nft_table(&settings.name_prefix);
        let proxy_uplink = settings
            .uplink
            .clone()
            .filter(|_| settings.public_neighbors == PublicNeighbors::Proxy);
        let mut sysctls = vec![
            ("net/ipv4/ip_forward".into(), "1".into()),
            ("net/ipv6/conf/all/forwarding".into(), "1".into()),
        ];
        if let Some(u) = &proxy_uplink {
            // NDP proxying on, and proxied answers sent at once (the default delays each by up
            // to 0.8 s).
            sysctls.push((format!("net/ipv6/conf/{u}/proxy_ndp"), "1".into()));
            sysctls.push((format!("net/ipv4/neigh/{u}/proxy_delay"), "0".into()));
            sysctls.push((format!("net/ipv6/neigh/{u}/proxy_delay"), "0".into()));
        }
        HostPlan {
            sysctls,
            nft,
            nft_fingerprint,
            nft_table,
            pub_nft: public::host_ruleset(&pub_table, settings.transit_ipv4),
            pub_table,
            proxy_uplink,
        }
    })
}

fn fmt_mac(m: [u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// Plans one VM.
///
/// # Errors
/// `INVALID_INPUT` when the config breaks a validation rule, the settings are invalid, or the
/// user id is beyond what the transit range supports.
pub fn plan_vm(cfg: &VmConfig, settings: &NsSettings) -> Result<VmPlan, ValidationError> {
    cfg.validate()?;
    settings.validate()?;
    let uid = cfg.user_id;
    if uid > settings.max_user_id() {
        return Err(ValidationError::rule(format!(
            "vm {}: user_id {uid} is outside the range 0..={} supported by transit range {}",
            cfg.id,
            settings.max_user_id(),
            settings.transit_ipv4
        )));
    }
    let metadata = super::metadata::plan(cfg)?;
    let p = settings.name_prefix.as_str();
    let tap = TapPlan {
        name: name(p, NameKind::Tap, uid),
        owner_uid: settings.tap_owner_uid,
        owner_gid: settings.tap_owner_gid,
        mtu: settings.mtu,
        ipv4: Ipv4Net::new(GATEWAY_IPV4, TAP_PREFIX_LEN).expect("valid"),
        ipv6_link_local: Ipv6Net::new(HOST_LINK_LOCAL, 64).expect("valid"),
        metadata_ipv4: Ipv4Net::from(super::metadata::METADATA_IPV4),
    };
    let guest = GuestPlan {
        ipv4: Ipv4Net::new(GUEST_IPV4, TAP_PREFIX_LEN).expect("valid"),
        ipv4_gateway: GATEWAY_IPV4,
        mac: fmt_mac(GUEST_MAC),
        mtu: settings.mtu,
        mesh_ipv6: cfg.mesh_ipv6,
        ipv6_gateway: HOST_LINK_LOCAL,
    };
    let veth = cfg.mesh_ipv6.map(|_| {
        let transit = settings.transit_of(uid);
        let net = u32::from(transit.network());
        let (host_mac, peer_mac) = veth_macs(uid);
        VethPlan {
            host_name: name(p, NameKind::HostVeth, uid),
            peer_name: name(p, NameKind::PeerVeth, uid),
            mtu: settings.mtu,
            transit,
            host_ipv4: Ipv4Net::new(Ipv4Addr::from(net + 1), 30).expect("valid"),
            peer_ipv4: Ipv4Net::new(Ipv4Addr::from(net + 2), 30).expect("valid"),
            host_ipv6_link_local: Ipv6Net::new(host_veth_link_local(uid), 128).expect("valid"),
            peer_ipv6_link_local: Ipv6Net::new(PEER_LINK_LOCAL, 64).expect("valid"),
            host_mac,
            peer_mac,
        }
    });
    let nat = veth.is_some() && cfg.ipv4_via_host();
    if let Some(a) = cfg.public_ipv4
        && settings.transit_ipv4.contains(&a)
    {
        return Err(ValidationError::rule(format!(
            "vm {}: public_ipv4 {a} lies in the transit range {}",
            cfg.id, settings.transit_ipv4
        )));
    }
    let host_table = settings.host_table_base + uid;
    let (mut ns_routes, ns_rules, mut host_routes, host_rules) = match (&veth, cfg.mesh_ipv6) {
        (Some(v), Some(mesh)) => {
            route_plan(cfg, v, &tap, mesh, host_table, settings.host_rule_priority)
        }
        _ => (Vec::new(), Vec::new(), Vec::new(), Vec::new()),
    };
    let public = match (&veth, cfg.mesh_ipv6) {
        (Some(v), Some(mesh)) => public::plan(
            cfg,
            settings,
            v,
            &tap,
            mesh,
            &mut ns_routes,
            &mut host_routes,
        ),
        _ => None,
    };
    let table = names::vm_nft_table(p);
    let firewall = veth.as_ref().and_then(|v| {
        let mut guest = vec![IpNet::V4(guest.ipv4.addr().into())];
        guest.extend(cfg.mesh_ipv6.map(|m| IpNet::V6(m.into())));
        guest.extend(cfg.public_ipv6_block().map(IpNet::V6));
        super::firewall::plan(
            cfg.firewall.as_ref(),
            guest,
            super::firewall::local_addresses(GATEWAY_IPV4, v.peer_ipv4.addr()),
        )
    });
    let (nft, nft_fingerprint, nft_shape) = nft::vm_ruleset(
        &table,
        settings.mtu,
        veth.as_ref()
            .filter(|_| nat)
            .map(|v| (v.peer_name.as_str(), v.peer_ipv4.addr())),
        // Only with NAT (a public IPv4 needs its route via host, so NAT comes with it).
        veth.as_ref().filter(|_| nat).map(|v| {
            (
                v.peer_name.as_str(),
                cfg.public_ipv4.map(|_| v.peer_ipv4.addr()),
            )
        }),
        veth.as_ref()
            .zip(firewall.as_ref())
            .map(|(v, f)| (v.peer_name.as_str(), tap.name.as_str(), f)),
        settings.guard.then_some(tap.name.as_str()),
    );
    let limits = super::limits::plan_limits(
        cfg.private_network_throughput_mibps,
        cfg.public_network_throughput_mibps,
        // A public path: a route via host, IPv4 (through NAT) or IPv6.
        cfg.ipv4_via_host() || cfg.ipv6_via_host(),
        &tap.name,
        veth.as_ref().map(|v| v.peer_name.as_str()),
    );
    let activity = veth
        .as_ref()
        .filter(|_| settings.activity)
        .map(|v| super::activity::plan(&tap.name, &v.peer_name, uid));
    let guard = settings.guard.then(|| super::guard::plan(cfg, &tap.name));
    let tap_sysctls = super::sysctls::tap_sysctls(&tap.name);
    Ok(VmPlan {
        vm_id: cfg.id.clone(),
        user_id: uid,
        tenant: cfg.tenant,
        netns: name(p, NameKind::Netns, uid),
        tap,
        veth,
        guest,
        routes: cfg.network.routes.clone(),
        nat,
        ns_sysctls: super::sysctls::ns_sysctls(),
        tap_sysctls,
        ns_routes,
        ns_rules,
        host_routes,
        host_rules,
        nft,
        nft_fingerprint,
        nft_shape,
        host_table,
        name_prefix: p.to_owned(),
        limits,
        public,
        firewall,
        metadata,
        activity,
        guard,
    })
}

type RoutePlan = (
    Vec<PlannedRoute>,
    Vec<PlannedRule>,
    Vec<PlannedRoute>,
    Vec<PlannedRule>,
);

fn route_plan(
    cfg: &VmConfig,
    v: &VethPlan,
    tap: &TapPlan,
    mesh: Ipv6Addr,
    host_table: u32,
    host_rule_priority: u32,
) -> RoutePlan {
    let mesh_range = IpNet::V6(vmnet_model::vm::MESH_RANGE);
    let mesh128 = IpNet::V6(Ipv6Net::new(mesh, 128).expect("valid"));
    let to_host_v6 = |destination| PlannedRoute {
        table: MAIN_TABLE,
        destination,
        kind: RouteKind::Via {
            gateway: IpAddr::V6(v.host_ipv6_link_local.addr()),
            dev: v.peer_name.clone(),
            onlink: false,
        },
    };
    let mut ns = vec![
        PlannedRoute {
            table: MAIN_TABLE,
            destination: mesh128,
            kind: RouteKind::Dev {
                dev: tap.name.clone(),
            },
        },
        to_host_v6(mesh_range),
        PlannedRoute {
            table: names::NS_INBOUND_TABLE,
            destination: "::/0".parse().expect("valid"),
            kind: RouteKind::Via {
                gateway: IpAddr::V6(mesh),
                dev: tap.name.clone(),
                onlink: true,
            },
        },
    ];
    for r in &cfg.network.routes {
        if r.destination == mesh_range {
            continue;
        }
        ns.push(match r.destination {
            IpNet::V4(_) => PlannedRoute {
                table: MAIN_TABLE,
                destination: r.destination,
                kind: RouteKind::Via {
                    gateway: IpAddr::V4(v.host_ipv4.addr()),
                    dev: v.peer_name.clone(),
                    onlink: false,
                },
            },
            IpNet::V6(_) => to_host_v6(r.destination),
        });
    }
    let ns_rules = vec![PlannedRule {
        iif: v.peer_name.clone(),
        table: names::NS_INBOUND_TABLE,
        priority: names::NS_INBOUND_RULE_PRIORITY,
    }];
    let mut host = vec![PlannedRoute {
        table: MAIN_TABLE,
        destination: mesh128,
        kind: RouteKind::Via {
            gateway: IpAddr::V6(PEER_LINK_LOCAL),
            dev: v.host_name.clone(),
            onlink: false,
        },
    }];
    let mut host_rules = Vec::new();
    if cfg
        .network
        .routes
        .iter()
        .any(|r| matches!(r.via, Via::Mesh(_)))
    {
        for r in cfg
            .network
            .routes
            .iter()
            .filter(|r| matches!(r.destination, IpNet::V6(_)))
        {
            let kind = match r.via {
                Via::Host => RouteKind::Throw,
                Via::Mesh(g) => RouteKind::ViaMesh { mesh: g },
            };
            host.push(PlannedRoute {
                table: host_table,
                destination: r.destination,
                kind,
            });
        }
        if !cfg
            .network
            .routes
            .iter()
            .any(|r| r.destination == mesh_range)
        {
            host.push(PlannedRoute {
                table: host_table,
                destination: mesh_range,
                kind: RouteKind::Throw,
            });
        }
        host_rules.push(PlannedRule {
            iif: v.host_name.clone(),
            table: host_table,
            priority: host_rule_priority,
        });
    }
    ns.sort();
    host.sort();
    (ns, ns_rules, host, host_rules)
}
