//! Property test (fuzz) of the root helper's validator: every ruleset the planner renders is
//! accepted; every mutation that names another table or family, adds a forbidden command, verb,
//! object kind or key is refused; arbitrary input never panics.

use proptest::prelude::*;
use serde_json::{Value, json};
use vmnet_model::nic::{InstanceSpec, MacAddr, NetworkPolicy, NicSpec, NodeSpec};
use vmnet_plan::pool::nft::{
    Change, HostAddrs, OWNED_TABLES, plan, render_full, render_instance, tap_entries,
};
use vmnet_plan::pool::validate::validate;

fn policy(i: u8) -> NetworkPolicy {
    match i % 3 {
        0 => NetworkPolicy::Public,
        1 => NetworkPolicy::Private,
        _ => NetworkPolicy::None,
    }
}

fn node(spec: &[(u8, bool, bool)]) -> NodeSpec {
    NodeSpec {
        instances: spec
            .iter()
            .enumerate()
            .map(|(i, (p, sandbox, lease))| {
                let id = format!("inst-{i}");
                InstanceSpec {
                    allocation_id: format!("a-{i}"),
                    policy: policy(*p),
                    sandbox: *sandbox,
                    nics: vec![NicSpec {
                        network: Some("br0".parse().unwrap()),
                        mac: MacAddr::for_instance(&id),
                        addresses: if *lease {
                            vec![format!("10.0.0.{}/24", i + 2).parse().unwrap()]
                        } else {
                            vec![]
                        },
                        gateway: lease.then(|| "10.0.0.1".parse().unwrap()),
                        gateway6: None,
                        nameservers: vec![],
                    }],
                    id,
                }
            })
            .collect(),
    }
}

fn rendered(spec: &[(u8, bool, bool)]) -> Vec<Value> {
    let host = HostAddrs {
        own: vec!["10.0.0.1".parse().unwrap(), "192.0.2.1".parse().unwrap()],
        gateways: vec![],
    };
    let n = node(spec);
    let mut docs = vec![render_full(&plan(&n, &host).unwrap())];
    for inst in &n.instances {
        let e = tap_entries(inst).unwrap();
        docs.push(render_instance(&e, Change::Add));
        docs.push(render_instance(&e, Change::Remove));
    }
    docs.retain(|d| !d["nftables"].as_array().unwrap().is_empty());
    docs
}

fn forbidden() -> Vec<Value> {
    vec![
        json!({"flush": {"ruleset": null}}),
        json!({"add": {"table": {"family": "ip", "name": "filter"}}}),
        json!({"delete": {"table": {"family": "inet", "name": "firewalld"}}}),
        json!({"include": "/etc/nftables.conf"}),
        json!({"list": {"ruleset": null}}),
        json!({"replace": {"rule": {"family": "bridge", "table": "bcd_instances", "chain": "from_tap", "handle": 1, "expr": []}}}),
        json!({"add": {"flowtable": {"family": "inet", "table": "bcd_taps", "name": "ft"}}}),
        json!({"add": {"ct helper": {"family": "inet", "table": "bcd_taps", "name": "h"}}}),
        json!({"metainfo": {"json_schema_version": 1}}),
        json!({"add": {"chain": {"family": "inet", "table": "bcd_taps", "name": "x", "type": "filter", "hook": "prerouting", "prio": 0}}}),
        json!({"add": {"rule": {"family": "bridge", "table": "bcd_instances", "chain": "from_tap", "expr": [{"masquerade": null}]}}}),
    ]
}

fn owned(family: &str, table: &str) -> bool {
    OWNED_TABLES
        .iter()
        .any(|(f, t)| *f == family && *t == table)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn rendered_rulesets_are_accepted(spec in prop::collection::vec((0u8..3, any::<bool>(), any::<bool>()), 0..6)) {
        for d in rendered(&spec) {
            prop_assert!(validate(&d.to_string()).is_ok(), "{}", d);
        }
    }

    #[test]
    fn another_table_is_refused(
        spec in prop::collection::vec((0u8..3, any::<bool>(), any::<bool>()), 1..4),
        pick in any::<prop::sample::Index>(),
        name in "[a-z_]{1,16}",
        family in prop::sample::select(vec!["ip", "ip6", "inet", "arp", "bridge", "netdev"]),
    ) {
        let mut d = rendered(&spec).remove(0);
        let cmds = d["nftables"].as_array_mut().unwrap();
        let i = pick.index(cmds.len());
        let body = cmds[i].as_object_mut().unwrap().values_mut().next().unwrap();
        let (kind, obj) = body.as_object_mut().unwrap().iter_mut().next().unwrap();
        let key = if kind == "table" { "name" } else { "table" };
        let obj = obj.as_object_mut().unwrap();
        let old_table = obj[key].as_str().unwrap().to_owned();
        let table = if name == old_table { format!("{name}x") } else { name };
        let fam = family.to_string();
        prop_assume!(!owned(&fam, &table));
        if i % 2 == 0 {
            obj.insert(key.into(), json!(table));
        } else {
            prop_assume!(!owned(&fam, &old_table));
            obj.insert("family".into(), json!(fam));
        }
        prop_assert!(validate(&d.to_string()).is_err(), "{}", d);
    }

    #[test]
    fn forbidden_commands_are_refused(
        spec in prop::collection::vec((0u8..3, any::<bool>(), any::<bool>()), 0..4),
        which in any::<prop::sample::Index>(),
        at in any::<prop::sample::Index>(),
    ) {
        let mut d = rendered(&spec).remove(0);
        let f = forbidden();
        let cmds = d["nftables"].as_array_mut().unwrap();
        let pos = at.index(cmds.len() + 1);
        cmds.insert(pos, f[which.index(f.len())].clone());
        let e = validate(&d.to_string()).unwrap_err();
        let expected = format!("command {pos}:");
        prop_assert!(e.0.contains(&expected), "{}", e);
    }

    #[test]
    fn extra_keys_and_verbs_are_refused(
        spec in prop::collection::vec((0u8..3, any::<bool>(), any::<bool>()), 0..3),
        at in any::<prop::sample::Index>(),
        verb in "[a-z]{2,8}",
        extra in "[a-z]{1,8}",
        mode in 0u8..2,
    ) {
        let mut d = rendered(&spec).remove(0);
        let cmds = d["nftables"].as_array_mut().unwrap();
        let i = at.index(cmds.len());
        let o = cmds[i].as_object_mut().unwrap();
        if mode == 0 {
            prop_assume!(verb != "add" && verb != "delete");
            let (_, body) = o.iter().next().map(|(k, v)| (k.clone(), v.clone())).unwrap();
            o.clear();
            o.insert(verb, body);
        } else {
            o.insert(extra, json!(null));
        }
        prop_assert!(validate(&d.to_string()).is_err(), "{}", d);
    }

    #[test]
    fn arbitrary_input_never_panics(s in "\\PC{0,200}") {
        let _ = validate(&s);
        let wrapped = format!("{{\"nftables\":[{s}]}}");
        let _ = validate(&wrapped);
    }
}
