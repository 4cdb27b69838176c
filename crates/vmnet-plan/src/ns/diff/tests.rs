use std::collections::{BTreeMap, BTreeSet};

use super::*;

fn route(table: u32, dst: &str, kind: KKind) -> KRoute {
    KRoute::new(table, dst.parse().unwrap(), kind)
}

fn rule(iif: &str, table: u32) -> KRule {
    KRule {
        iif: iif.into(),
        table,
        priority: 100,
    }
}

struct Have {
    ns_routes: BTreeSet<KRoute>,
    ns_rules: BTreeSet<KRule>,
    host_routes: BTreeSet<KRoute>,
    host_rules: BTreeSet<KRule>,
}

impl Have {
    fn of(want: &WantRoutes) -> Self {
        Self {
            ns_routes: want.ns_routes.keys().cloned().collect(),
            ns_rules: want.ns_rules.clone(),
            host_routes: want.host_routes.keys().cloned().collect(),
            host_rules: want.host_rules.clone(),
        }
    }

    fn view(&self) -> HaveRoutes<'_> {
        HaveRoutes {
            ns_routes: &self.ns_routes,
            ns_rules: &self.ns_rules,
            host_routes: &self.host_routes,
            host_rules: &self.host_rules,
        }
    }
}

fn mesh_via(gw: &str, oif: u32) -> KKind {
    KKind::Via {
        gw: gw.parse().unwrap(),
        oif,
    }
}

fn want() -> WantRoutes {
    WantRoutes {
        ns_routes: BTreeMap::from([
            (route(254, "fdaa:1::5/128", KKind::Dev { oif: 2 }), false),
            (route(100, "::/0", mesh_via("fdaa:1::5", 2)), true),
        ]),
        ns_rules: BTreeSet::from([rule("p5", 100)]),
        host_routes: BTreeMap::from([(route(254, "fdaa:1::5/128", mesh_via("fe80::2", 9)), false)]),
        host_rules: BTreeSet::from([rule("h5", 0x0100_0005)]),
    }
}

#[test]
fn nothing_to_do_when_the_kernel_holds_the_plan() {
    let w = want();
    assert!(route_ops(&w, Have::of(&w).view()).is_empty());
}

#[test]
fn an_empty_kernel_gets_routes_then_on_link_routes_then_rules() {
    let w = want();
    let empty = Have::of(&WantRoutes::default());
    let steps = route_ops(&w, empty.view());
    assert_eq!(steps.len(), 3, "{steps:#?}");
    assert!(
        steps[0]
            .iter()
            .all(|o| matches!(o, RouteOp::AddRoute { onlink: false, .. }))
    );
    assert_eq!(steps[0].len(), 2);
    assert!(matches!(
        steps[1].as_slice(),
        [RouteOp::AddRoute {
            side: Side::Vm,
            onlink: true,
            ..
        }]
    ));
    assert_eq!(
        steps[2],
        vec![
            RouteOp::AddRule(Side::Vm, rule("p5", 100)),
            RouteOp::AddRule(Side::Host, rule("h5", 0x0100_0005)),
        ]
    );
}

#[test]
fn a_changed_route_is_deleted_before_its_replacement_and_stale_rules_go_first() {
    let w = want();
    let mut have = Have::of(&w);
    let old = route(254, "fdaa:1::5/128", mesh_via("fe80::2", 8));
    have.host_routes = BTreeSet::from([old.clone()]);
    have.ns_rules.insert(rule("old", 7));
    let steps = route_ops(&w, have.view());
    assert_eq!(
        steps,
        vec![
            vec![RouteOp::DelRule(Side::Vm, rule("old", 7))],
            vec![RouteOp::DelRoute(Side::Host, old)],
            vec![RouteOp::AddRoute {
                side: Side::Host,
                route: route(254, "fdaa:1::5/128", mesh_via("fe80::2", 9)),
                onlink: false,
            }],
        ]
    );
}

#[test]
fn a_route_differing_only_in_metric_is_another_route() {
    let w = want();
    let mut have = Have::of(&w);
    let mut guard = route(100, "::/0", KKind::Unreachable);
    guard.metric = GUARD_METRIC;
    have.ns_routes.insert(guard.clone());
    let steps = route_ops(&w, have.view());
    assert_eq!(steps, vec![vec![RouteOp::DelRoute(Side::Vm, guard)]]);
}

#[test]
fn operations_are_described_in_ip_words_with_their_side() {
    let names = HashMap::from([(9, "vmh5".to_owned())]);
    let add = RouteOp::AddRoute {
        side: Side::Host,
        route: route(254, "fdaa:1::5/128", mesh_via("fe80::2", 9)),
        onlink: false,
    };
    assert_eq!(add.side(), Side::Host);
    assert_eq!(
        add.describe(&names),
        "fdaa:1::5/128 table 254 metric 1024 via fe80::2 dev vmh5"
    );
    let del = RouteOp::DelRule(Side::Vm, rule("p5", 100));
    assert_eq!(
        (del.side(), del.describe(&names)),
        (Side::Vm, "iif p5 lookup 100 pref 100".to_owned())
    );
}
