use super::*;

fn spec(n: u8, mesh: u16) -> PeerSpec {
    PeerSpec {
        public_key: WgKey([n; 32]),
        endpoint: format!("[fd00:10::{n}]:51820").parse().unwrap(),
        mesh_address: Ipv6Addr::new(0xfdaa, 0, 0, 0, 0, 0, 0, mesh),
    }
}

fn rec(s: &PeerSpec) -> RecordPeer {
    RecordPeer {
        spec: s.clone(),
        leaving: false,
    }
}

fn seen_as(s: &PeerSpec) -> (WgKey, SeenPeer) {
    (
        s.public_key,
        SeenPeer {
            endpoint: Some(s.endpoint),
            allowed_ips: vec![IpNet::V6(Ipv6Net::from(s.mesh_address))],
        },
    )
}

#[test]
fn from_empty_everything_is_added() {
    let d = [spec(2, 2), spec(3, 3)];
    let p = plan(&d, &[], &BTreeMap::new(), &BTreeSet::new()).unwrap();
    assert_eq!(p.set, d);
    assert!(p.remove.is_empty() && p.routes_del.is_empty());
    assert_eq!(p.routes_add, [d[0].mesh_address, d[1].mesh_address]);
    let r = record_diff(&d, &[]);
    assert_eq!(r.upsert, d);
    assert!(r.leave.is_empty());
}

#[test]
fn an_applied_set_plans_nothing() {
    let d = [spec(2, 2), spec(3, 3)];
    let record: Vec<_> = d.iter().map(rec).collect();
    let seen: BTreeMap<_, _> = d.iter().map(seen_as).collect();
    let routes: BTreeSet<_> = d.iter().map(|s| s.mesh_address).collect();
    let p = plan(&d, &record, &seen, &routes).unwrap();
    assert!(p.is_empty(), "{p:?}");
    assert!(record_diff(&d, &record).is_empty());
}

#[test]
fn one_change_rewrites_one_peer_and_its_routes_only() {
    let old = [spec(2, 2), spec(3, 3), spec(4, 4)];
    let record: Vec<_> = old.iter().map(rec).collect();
    let seen: BTreeMap<_, _> = old.iter().map(seen_as).collect();
    let routes: BTreeSet<_> = old.iter().map(|s| s.mesh_address).collect();
    // Peer 3 moves to a new mesh address, peer 4 leaves.
    let d = [spec(2, 2), spec(3, 0x33)];
    let p = plan(&d, &record, &seen, &routes).unwrap();
    assert_eq!(p.set, [spec(3, 0x33)]);
    assert_eq!(p.remove, [WgKey([4; 32])]);
    assert_eq!(p.routes_add, [spec(3, 0x33).mesh_address]);
    assert_eq!(
        p.routes_del,
        [spec(3, 3).mesh_address, spec(4, 4).mesh_address]
    );
    let r = record_diff(&d, &record);
    assert_eq!(r.upsert, [spec(3, 0x33)]);
    assert_eq!(r.leave, [WgKey([4; 32])]);
}

#[test]
fn drift_on_wg0_is_repaired_and_missing_routes_come_back() {
    let d = [spec(2, 2), spec(3, 3)];
    let record: Vec<_> = d.iter().map(rec).collect();
    let mut seen: BTreeMap<_, _> = d.iter().map(seen_as).collect();
    // Someone widened peer 2's allowed IPs and removed peer 3; the route of peer 2 is gone.
    seen.get_mut(&WgKey([2; 32]))
        .unwrap()
        .allowed_ips
        .push("fdaa::/16".parse().unwrap());
    seen.remove(&WgKey([3; 32]));
    let routes = BTreeSet::from([d[1].mesh_address]);
    let p = plan(&d, &record, &seen, &routes).unwrap();
    assert_eq!(p.set, d);
    assert_eq!(p.routes_add, [d[0].mesh_address]);
    assert!(p.remove.is_empty() && p.routes_del.is_empty());
}

#[test]
fn foreign_peers_and_routes_are_never_touched() {
    let d = [spec(2, 2)];
    let record = [rec(&d[0])];
    let mut seen: BTreeMap<_, _> = d.iter().map(seen_as).collect();
    let foreign = spec(9, 9);
    seen.insert(foreign.public_key, seen_as(&foreign).1);
    let routes = BTreeSet::from([d[0].mesh_address, foreign.mesh_address]);
    let p = plan(&d, &record, &seen, &routes).unwrap();
    assert!(p.is_empty(), "{p:?}");
    // Even an empty set leaves the foreign peer and its route.
    let p = plan(&[], &record, &seen, &routes).unwrap();
    assert_eq!(p.remove, [d[0].public_key]);
    assert_eq!(p.routes_del, [d[0].mesh_address]);
    // A sync naming the foreign peer, or its address, is refused.
    let e = plan(std::slice::from_ref(&foreign), &record, &seen, &routes).unwrap_err();
    assert_eq!(e.code, vmnet_model::ErrorCode::Conflict);
    assert!(e.message.contains("foreign peer"), "{e}");
    let e = plan(&[spec(5, 9)], &record, &seen, &routes).unwrap_err();
    assert!(e.message.contains("allowed IP of the foreign peer"), "{e}");
}

#[test]
fn leaving_rows_are_removed_until_gone_and_can_come_back() {
    let d = [spec(2, 2)];
    let leaving = RecordPeer {
        spec: spec(3, 3),
        leaving: true,
    };
    let record = [rec(&d[0]), leaving.clone()];
    let seen: BTreeMap<_, _> = [seen_as(&d[0]), seen_as(&spec(3, 3))].into();
    let routes = BTreeSet::from([d[0].mesh_address, spec(3, 3).mesh_address]);
    let p = plan(&d, &record, &seen, &routes).unwrap();
    assert_eq!(p.remove, [WgKey([3; 32])]);
    assert_eq!(p.routes_del, [spec(3, 3).mesh_address]);
    // Back in the set: the row is written again (not leaving) and nothing is removed.
    let back = [spec(2, 2), spec(3, 3)];
    let r = record_diff(&back, &record);
    assert_eq!(r.upsert, [spec(3, 3)]);
    assert!(plan(&back, &record, &seen, &routes).unwrap().is_empty());
}
