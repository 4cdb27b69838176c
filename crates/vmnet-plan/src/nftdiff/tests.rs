//! The comparison on hand-made documents: what counts as drift and what never does.

use serde_json::{Value, json};

use super::*;

const OWNED: [(&str, &str); 2] = [("bridge", "t"), ("inet", "u")];

fn ether_type(t: &str) -> Value {
    json!({"match": {"op": "==", "left": {"payload": {"protocol": "ether", "field": "type"}}, "right": t}})
}

fn ip_saddr_drop() -> Vec<Value> {
    vec![
        json!({"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}},
            "right": {"set": ["10.0.0.1", {"prefix": {"addr": "2001:DB8::", "len": 32}}]}}}),
        json!({"drop": null}),
    ]
}

/// A batch: table `bridge t` with a base chain, a regular chain with two rules, a set and a
/// verdict map with elements.
fn planned() -> Value {
    let mut r1 = vec![ether_type("ip")];
    r1.extend(ip_saddr_drop());
    json!({"nftables": [
        {"add": {"table": {"family": "bridge", "name": "t"}}},
        {"delete": {"table": {"family": "bridge", "name": "t"}}},
        {"add": {"table": {"family": "bridge", "name": "t"}}},
        {"add": {"set": {"family": "bridge", "table": "t", "name": "s", "type": ["ifname", "ipv6_addr"]}}},
        {"add": {"map": {"family": "bridge", "table": "t", "name": "m", "type": "ifname", "map": "verdict"}}},
        {"add": {"chain": {"family": "bridge", "table": "t", "name": "c"}}},
        {"add": {"chain": {"family": "bridge", "table": "t", "name": "pre", "type": "filter",
            "hook": "prerouting", "prio": -200, "policy": "accept"}}},
        {"add": {"rule": {"family": "bridge", "table": "t", "chain": "c", "expr": r1}}},
        {"add": {"rule": {"family": "bridge", "table": "t", "chain": "c", "expr": [
            ether_type("ip"),
            {"match": {"op": "==", "left": {"payload": {"protocol": "udp", "field": "sport"}}, "right": 67}},
            {"counter": null},
            {"drop": null}]}}},
        {"add": {"element": {"family": "bridge", "table": "t", "name": "s", "elem": [
            {"concat": ["bc1n0", "2001:DB8::1"]}, {"concat": ["bc2n0", "fe80::2"]}]}}},
        {"add": {"element": {"family": "bridge", "table": "t", "name": "m", "elem": [
            ["bc1n0", {"drop": null}], ["bc2n0", {"jump": {"target": "c"}}]]}}},
        {"add": {"table": {"family": "ip", "name": "not-ours"}}},
    ]})
}

/// The same as nft lists it: handles, metainfo, no implied `ether type ip`, sorted anonymous
/// set, canonical addresses, elements in another order (one wrapped in `elem`), counter values.
fn listed() -> Value {
    json!({"nftables": [
        {"metainfo": {"version": "1.0.6", "json_schema_version": 1}},
        {"table": {"family": "ip", "name": "not-ours", "handle": 9}},
        {"table": {"family": "bridge", "name": "t", "handle": 3}},
        {"map": {"family": "bridge", "name": "m", "table": "t", "type": "ifname", "handle": 2,
            "map": "verdict", "elem": [["bc2n0", {"jump": {"target": "c"}}], ["bc1n0", {"drop": null}]]}},
        {"set": {"family": "bridge", "name": "s", "table": "t", "type": ["ifname", "ipv6_addr"], "handle": 1,
            "elem": [{"concat": ["bc2n0", "fe80::2"]}, {"elem": {"val": {"concat": ["bc1n0", "2001:db8::1"]}}}]}},
        {"chain": {"family": "bridge", "table": "t", "name": "c", "handle": 4}},
        {"chain": {"family": "bridge", "table": "t", "name": "pre", "handle": 5, "type": "filter",
            "hook": "prerouting", "prio": -200, "policy": "accept"}},
        {"rule": {"family": "bridge", "table": "t", "chain": "c", "handle": 6, "expr": [
            {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}},
                "right": {"set": [{"prefix": {"addr": "2001:db8::", "len": 32}}, "10.0.0.1"]}}},
            {"drop": null}]}},
        {"rule": {"family": "bridge", "table": "t", "chain": "c", "handle": 7, "expr": [
            ether_type("ip"),
            {"match": {"op": "==", "left": {"payload": {"protocol": "udp", "field": "sport"}}, "right": 67}},
            {"counter": {"packets": 12, "bytes": 3400}},
            {"drop": null}]}},
    ]})
}

fn differences(edit: impl FnOnce(&mut Vec<Value>)) -> Vec<String> {
    let mut l = listed();
    edit(l["nftables"].as_array_mut().unwrap());
    diff(&Tables::read(&planned(), &OWNED), &Tables::read(&l, &OWNED))
        .iter()
        .map(ToString::to_string)
        .collect()
}

fn find<'a>(items: &'a mut [Value], kind: &str, name: &str) -> &'a mut Value {
    items
        .iter_mut()
        .find(|i| i[kind]["name"] == name || i[kind]["chain"] == name)
        .map(|i| &mut i[kind])
        .unwrap()
}

#[test]
fn listing_details_are_not_drift() {
    assert_eq!(differences(|_| {}), Vec::<String>::new());
    let summary = Tables::read(&planned(), &OWNED).without_items();
    assert!(diff(&summary, &Tables::read_summary(&listed(), &OWNED)).is_empty());
    assert!(diff(&summary, &Tables::read(&listed(), &OWNED)).is_empty());
}

#[test]
fn an_element_swapped_one_for_one_is_drift_with_or_without_items() {
    let swap = |items: &mut Vec<Value>| {
        let s = find(items, "set", "s");
        s["elem"][1] = json!({"concat": ["bc1n0", "2001:db8::bad"]});
    };
    let d = differences(swap);
    assert_eq!(
        d,
        [
            "table bridge t: set s has 2 elements, 2 planned; missing bc1n0 . 2001:db8::1; \
             unexpected bc1n0 . 2001:db8::bad"
        ]
    );
    let mut l = listed();
    swap(l["nftables"].as_array_mut().unwrap());
    let summary = Tables::read(&planned(), &OWNED).without_items();
    let d = diff(&summary, &Tables::read_summary(&l, &OWNED));
    assert_eq!(
        d.iter().map(ToString::to_string).collect::<Vec<_>>(),
        ["table bridge t: set s has 2 elements, 2 planned, content differs"]
    );
    assert!(has_element_digest_only(&d));
    // A verdict swapped in a map.
    let d = differences(|items| {
        find(items, "map", "m")["elem"][0] = json!(["bc2n0", {"drop": null}]);
    });
    assert_eq!(d.len(), 1, "{d:?}");
    assert!(d[0].contains("set m") && d[0].contains("missing bc2n0 : {\"jump\""));
}

#[test]
fn chains_rules_sets_and_tables_by_content() {
    let d = differences(|items| {
        find(items, "chain", "pre")["policy"] = json!("drop");
    });
    assert_eq!(
        d,
        [
            "table bridge t: chain pre is `type filter hook prerouting prio -200 policy drop`, \
             planned `type filter hook prerouting prio -200 policy accept`"
        ]
    );
    let d = differences(|items| {
        find(items, "chain", "pre")["prio"] = json!(-300);
    });
    assert!(d[0].contains("prio -300"), "{d:?}");
    // A rule deleted, one changed, one added.
    let d = differences(|items| items.retain(|i| i["rule"]["handle"] != 7));
    assert_eq!(
        d,
        ["table bridge t: chain c has 1 rules, 2 planned, the first difference at rule 1"]
    );
    let d = differences(|items| {
        find(items, "rule", "c")["expr"][1] = json!({"accept": null});
    });
    assert!(d[0].contains("at rule 0"), "{d:?}");
    let d = differences(|items| {
        items.push(
            json!({"rule": {"family": "bridge", "table": "t", "chain": "pre", "handle": 99,
            "expr": [{"accept": null}]}}),
        );
    });
    assert_eq!(
        d,
        ["table bridge t: chain pre has 1 rules, 0 planned, the first difference at rule 0"]
    );
    // A dependency match that nothing implies is content: deleting it is drift.
    let d = differences(|items| {
        let r = items.iter_mut().find(|i| i["rule"]["handle"] == 7).unwrap();
        r["rule"]["expr"].as_array_mut().unwrap().remove(0);
    });
    assert_eq!(d.len(), 1, "{d:?}");
    // A chain deleted (with its rules), one added, a set's type changed, a table gone.
    let d = differences(|items| items.retain(|i| i["chain"]["name"] != "pre"));
    assert_eq!(d, ["table bridge t: chain pre is missing"]);
    let d = differences(|items| {
        items.push(json!({"chain": {"family": "bridge", "table": "t", "name": "x", "handle": 50}}));
        items.push(
            json!({"counter": {"family": "bridge", "table": "t", "name": "n", "handle": 51,
            "packets": 0, "bytes": 0}}),
        );
    });
    assert_eq!(
        d,
        [
            "table bridge t: chain x is present but not planned",
            "table bridge t: counter n is present but not planned"
        ]
    );
    let d = differences(|items| {
        find(items, "set", "s")["type"] = json!(["ifname", "ipv4_addr"]);
    });
    assert!(d[0].starts_with("table bridge t: set s is `set "), "{d:?}");
    let d = differences(|items| items.retain(|i| i.get("metainfo").is_some()));
    assert_eq!(d, ["table bridge t is missing"]);
    let d = differences(|items| {
        items.push(json!({"table": {"family": "inet", "name": "u", "handle": 60}}));
    });
    assert_eq!(d, ["table inet u is present but not planned"]);
}

#[test]
fn element_batches_keep_a_summary_equal_to_a_fresh_read() {
    let mut summary = Tables::read(&planned(), &OWNED).without_items();
    let batch = json!({"nftables": [
        {"delete": {"element": {"family": "bridge", "table": "t", "name": "s",
            "elem": [{"concat": ["bc2n0", "fe80::2"]}]}}},
        {"add": {"element": {"family": "bridge", "table": "t", "name": "s",
            "elem": [{"concat": ["bc3n0", "fe80::3"]}]}}},
    ]});
    summary.apply(&batch, &OWNED);
    let mut full = planned();
    full["nftables"]
        .as_array_mut()
        .unwrap()
        .extend(batch["nftables"].as_array().unwrap().iter().cloned());
    let fresh = Tables::read(&full, &OWNED);
    assert!(diff(&summary, &fresh).is_empty());
    assert_eq!(fresh.tables["bridge t"].sets["s"].elements.count, 2);
    assert!(!diff(&Tables::read(&planned(), &OWNED).without_items(), &fresh).is_empty());
    // A flushed ruleset in a batch leaves nothing.
    let mut gone = fresh.clone();
    gone.apply(&json!({"nftables": [{"flush": {"ruleset": null}}]}), &OWNED);
    assert!(gone.tables.is_empty());
}

#[test]
fn dependencies_go_only_when_implied() {
    let udp = json!({"match": {"op": "==", "left": {"payload": {"protocol": "udp", "field": "dport"}}, "right": 53}});
    let l4 = json!({"match": {"op": "==", "left": {"meta": {"key": "l4proto"}}, "right": "udp"}});
    let nf = json!({"match": {"op": "==", "left": {"meta": {"key": "nfproto"}}, "right": "ipv4"}});
    assert_eq!(
        normalize_rule(&json!([l4.clone(), udp.clone()])),
        normalize_rule(&json!([udp.clone()]))
    );
    // nfproto ipv4 is not implied by udp: it stays.
    assert_ne!(
        normalize_rule(&json!([nf, udp.clone()])),
        normalize_rule(&json!([udp.clone()]))
    );
    // Not an equality: it stays.
    let not_udp =
        json!({"match": {"op": "!=", "left": {"meta": {"key": "l4proto"}}, "right": "udp"}});
    assert_ne!(
        normalize_rule(&json!([not_udp, udp.clone()])),
        normalize_rule(&json!([udp]))
    );
}

#[test]
fn elements_have_one_spelling() {
    assert_eq!(normalize_element(&json!("2001:DB8:0::1")), "2001:db8::1");
    assert_eq!(
        normalize_element(&json!("02:AB:cd:00:00:01")),
        "02:ab:cd:00:00:01"
    );
    assert_eq!(
        normalize_element(
            &json!({"elem": {"val": {"prefix": {"addr": "10.0.0.0", "len": 8}}, "timeout": 5}})
        ),
        "10.0.0.0/8"
    );
    assert_eq!(
        normalize_element(&json!({"range": ["10.0.0.1", "10.0.0.9"]})),
        "10.0.0.1-10.0.0.9"
    );
    assert_eq!(normalize_element(&json!(7)), "7");
}
