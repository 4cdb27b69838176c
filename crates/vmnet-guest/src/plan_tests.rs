use super::*;
use crate::doc::parse;
use crate::networkd::render;

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

/// What networkd and an earlier apply leave on the interface for `g`: the guest address, its
/// prefix route and default route (the image's `.network`), the mesh address and every wanted
/// route via its gateway.
fn applied(g: &GuestNet) -> Observed {
    let mut o = Observed {
        addresses: vec![
            ("172.16.0.2".parse().unwrap(), 30),
            ("fe80::400:acff:fe10:2".parse().unwrap(), 64),
            (IpAddr::V6(g.mesh_ipv6), 128),
        ],
        routes: vec![
            KernelRoute {
                dst: net("172.16.0.0/30"),
                gateway: None,
            },
            KernelRoute {
                dst: net("0.0.0.0/0"),
                gateway: Some(IpAddr::V4(GATEWAY_V4)),
            },
        ],
    };
    for d in wanted_routes(g) {
        if !o.routes.iter().any(|r| r.dst == d) {
            o.routes.push(KernelRoute {
                dst: d,
                gateway: Some(gateway_of(d)),
            });
        }
    }
    o
}

const BASE: &str = "[Match]\nMACAddress=06:00:ac:10:00:02\n\n[Link]\nMTUBytes=1380\n\n\
    [Network]\nAddress=172.16.0.2/30\nGateway=172.16.0.1\nIPv6AcceptRA=no\n";

#[test]
fn nothing_changes_when_the_kernel_already_carries_it() {
    let g = parse("fdaa:1::7", "0.0.0.0/0\n::/0").unwrap();
    let c = plan(
        &g,
        &applied(&g),
        &file_routes(&render(&g)),
        &file_routes(BASE),
    );
    assert!(c.is_empty(), "{c}");
    assert_eq!(c.to_string(), "no kernel change");
}

#[test]
fn a_mesh_address_change_touches_only_the_addresses_new_first() {
    let old = parse("fdaa:1::8", "0.0.0.0/0\n::/0").unwrap();
    let new = parse("fdaa:1::8008", "0.0.0.0/0\n::/0").unwrap();
    let c = plan(
        &new,
        &applied(&old),
        &file_routes(&render(&old)),
        &file_routes(BASE),
    );
    assert_eq!(
        c,
        Changes {
            add_address: Some("fdaa:1::8008".parse().unwrap()),
            del_addresses: vec!["fdaa:1::8".parse().unwrap()],
            ..Changes::default()
        }
    );
    assert_eq!(
        c.to_string(),
        "+address fdaa:1::8008/128, -address fdaa:1::8/128"
    );
}

#[test]
fn a_host_routes_change_touches_only_those_routes() {
    let old = parse("fdaa:1::8", "::/0\n2001:db8:5::/48").unwrap();
    let new = parse("fdaa:1::8", "::/0\n2001:db8:6::/48").unwrap();
    let c = plan(
        &new,
        &applied(&old),
        &file_routes(&render(&old)),
        &file_routes(BASE),
    );
    assert_eq!(
        c,
        Changes {
            add_routes: vec![net("2001:db8:6::/48")],
            del_routes: vec![net("2001:db8:5::/48")],
            ..Changes::default()
        }
    );
}

#[test]
fn the_network_files_default_route_and_routes_of_others_stay() {
    // 0.0.0.0/0 leaves the host routes: the image's Gateway= still configures it.
    let old = parse("fdaa:1::8", "0.0.0.0/0\n::/0").unwrap();
    let new = parse("fdaa:1::8", "").unwrap();
    let mut seen = applied(&old);
    // A route someone else added, via our gateway: not vmnet-guest's, never deleted.
    seen.routes.push(KernelRoute {
        dst: net("2001:db8:99::/48"),
        gateway: Some(gateway_of(net("::/0"))),
    });
    let c = plan(&new, &seen, &file_routes(&render(&old)), &file_routes(BASE));
    assert_eq!(
        c,
        Changes {
            del_routes: vec![net("::/0")],
            ..Changes::default()
        }
    );
}

#[test]
fn a_fresh_interface_gets_everything_and_a_missing_route_only_itself() {
    let g = parse("fdaa:1::7", "0.0.0.0/0\n::/0").unwrap();
    let bare = Observed {
        addresses: vec![("172.16.0.2".parse().unwrap(), 30)],
        routes: vec![KernelRoute {
            dst: net("0.0.0.0/0"),
            gateway: Some(IpAddr::V4(GATEWAY_V4)),
        }],
    };
    let c = plan(&g, &bare, &[], &file_routes(BASE));
    assert_eq!(c.add_address, Some(g.mesh_ipv6));
    assert_eq!(c.add_routes, [net("fdaa::/16"), net("::/0")]);
    assert!(c.del_routes.is_empty() && c.del_addresses.is_empty());
    // One route gone behind our back: only it comes back.
    let mut seen = applied(&g);
    seen.routes.retain(|r| r.dst != net("fdaa::/16"));
    let c = plan(&g, &seen, &file_routes(&render(&g)), &file_routes(BASE));
    assert_eq!(
        c,
        Changes {
            add_routes: vec![net("fdaa::/16")],
            ..Changes::default()
        }
    );
}

#[test]
fn routes_of_a_network_file() {
    assert_eq!(file_routes(BASE), [net("0.0.0.0/0")]);
    let g = parse("fdaa:1::7", "0.0.0.0/0\n2001:db8::/32").unwrap();
    assert_eq!(
        file_routes(&render(&g)),
        [net("fdaa::/16"), net("0.0.0.0/0"), net("2001:db8::/32")]
    );
    let odd = "[Network]\nGateway=fe80::1\nGateway=bogus\n[Route]\nGateway=172.16.0.1\n\
               [Route]\n# comment\nDestination=10.1.2.3/8\nGateway=172.16.0.1\n[Route]\nDestination=nope\n";
    assert_eq!(
        file_routes(odd),
        [net("::/0"), net("0.0.0.0/0"), net("10.0.0.0/8")]
    );
    assert!(file_routes("").is_empty());
}
