//! Unit tests of the strict plan comparison ([`diff_plan`]), against listings nft 1.0.6 printed for our own
//! rulesets (`testdata/nft-1.0.6-*.json`, captured in a throwaway namespace) and hand edits of
//! them.

use serde_json::{Value, json};

use super::normalize::norm;
use super::*;
use crate::ns::nft::{FINGERPRINT_PREFIX, host_ruleset, vm_ruleset};

fn fixture(name: &str) -> Value {
    let path = format!("{}/testdata/{name}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(&path).expect(&path)).expect("fixture is JSON")
}

/// A captured listing with its fingerprint comment set to `fp` (the fixture was captured with
/// the fingerprint of its day; the content under test is the rest).
fn listing_with_fp(name: &str, fp: &str) -> Value {
    let mut v = fixture(name);
    for item in v["nftables"].as_array_mut().unwrap() {
        if let Some(c) = item.pointer_mut("/rule/comment")
            && c.as_str()
                .is_some_and(|s| s.starts_with(FINGERPRINT_PREFIX))
        {
            *c = Value::String(format!("{FINGERPRINT_PREFIX}{fp}"));
        }
    }
    v
}

fn vm_nat() -> (Value, Value) {
    let (plan, _, fp) = vm_ruleset(
        "vmn",
        1380,
        Some(("vmnp0001", "10.200.0.6".parse().unwrap())),
        None,
        None,
        None,
    );
    (plan, listing_with_fp("nft-1.0.6-vm-nat.json", &fp))
}

fn items_mut(v: &mut Value) -> &mut Vec<Value> {
    v["nftables"].as_array_mut().unwrap()
}

/// The index of the listing item of `kind` for which `pick` holds.
fn find(v: &Value, kind: &str, pick: impl Fn(&Value) -> bool) -> usize {
    v["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .position(|i| i.get(kind).is_some_and(&pick))
        .unwrap_or_else(|| panic!("no {kind} in {v}"))
}

fn one(d: &[Difference]) -> &Difference {
    assert_eq!(d.len(), 1, "{d:#?}");
    &d[0]
}

#[test]
fn our_rulesets_equal_what_nft_lists_for_them() {
    let (plan, listing) = vm_nat();
    assert_eq!(diff_plan(&plan, &listing).unwrap(), []);
    let (plan, _, fp) = vm_ruleset("vmn", 1380, None, None, None, None);
    assert_eq!(
        diff_plan(&plan, &listing_with_fp("nft-1.0.6-vm.json", &fp)).unwrap(),
        []
    );
    let (plan, fp) = host_ruleset("vmn_host", "10.200.0.0/14".parse().unwrap());
    assert_eq!(
        diff_plan(&plan, &listing_with_fp("nft-1.0.6-host.json", &fp)).unwrap(),
        []
    );
    // Sets, maps, a named counter, anonymous sets and counters, elements listed in another order.
    assert_eq!(
        diff_plan(&fixture("plan-fw.json"), &fixture("nft-1.0.6-fw.json")).unwrap(),
        []
    );
}

#[test]
fn a_deleted_rule_is_missing() {
    let (plan, mut l) = vm_nat();
    let i = find(&l, "rule", |r| r["chain"] == "postrouting");
    items_mut(&mut l).remove(i);
    let d = diff_plan(&plan, &l).unwrap();
    let d = one(&d);
    assert!(
        matches!(d, Difference::Rules { chain, missing, unexpected, .. }
            if chain == "postrouting" && missing.len() == 1 && missing[0].contains("snat")
                && unexpected.is_empty()),
        "{d:?}"
    );
    assert!(
        d.to_string()
            .starts_with("table inet vmn: chain postrouting "),
        "{d}"
    );
}

#[test]
fn an_added_rule_is_unexpected() {
    let (plan, mut l) = vm_nat();
    items_mut(&mut l).push(
        json!({"rule": {"family": "inet", "table": "vmn", "chain": "postrouting",
        "handle": 99, "expr": [{"accept": null}]}}),
    );
    let d = diff_plan(&plan, &l).unwrap();
    assert!(
        matches!(one(&d), Difference::Rules { missing, unexpected, .. }
            if missing.is_empty() && unexpected == &[r#"[{"accept":null}]"#]),
        "{d:?}"
    );
}

#[test]
fn a_changed_rule_is_one_missing_and_one_unexpected() {
    let (plan, mut l) = vm_nat();
    let i = find(&l, "rule", |r| r["chain"] == "postrouting");
    l["nftables"][i]["rule"]["expr"][2]["snat"]["addr"] = json!("10.200.0.10");
    let d = diff_plan(&plan, &l).unwrap();
    let one_each = |d: &Difference| {
        matches!(d, Difference::Rules { missing, unexpected, .. }
            if missing.len() == 1 && unexpected.len() == 1)
    };
    assert!(one_each(one(&d)), "{d:#?}");
    // A changed comment (the fingerprint) is a changed rule too.
    let (plan, mut l) = vm_nat();
    let i = find(&l, "rule", |r| r.get("comment").is_some());
    l["nftables"][i]["rule"]["comment"] = json!("vmnet:0000");
    assert!(one_each(one(&diff_plan(&plan, &l).unwrap())));
}

#[test]
fn reordered_rules_are_a_difference() {
    let (plan, mut l) = vm_nat();
    let a = find(&l, "rule", |r| r["chain"] == "mss");
    items_mut(&mut l).swap(a, a + 1);
    let d = diff_plan(&plan, &l).unwrap();
    assert!(
        matches!(one(&d), Difference::Rules { chain, missing, unexpected, .. }
            if chain == "mss" && missing.is_empty() && unexpected.is_empty()),
        "{d:?}"
    );
}

#[test]
fn a_deleted_chain_is_missing() {
    let (plan, mut l) = vm_nat();
    items_mut(&mut l).retain(|i| {
        i.pointer("/chain/name") != Some(&json!("postrouting"))
            && i.pointer("/rule/chain") != Some(&json!("postrouting"))
    });
    let d = diff_plan(&plan, &l).unwrap();
    assert_eq!(
        one(&d),
        &Difference::Object {
            table: "inet vmn".into(),
            object: "chain postrouting".into(),
            missing: true,
        }
    );
}

#[test]
fn a_flipped_policy_or_moved_hook_is_a_changed_chain() {
    for (key, value) in [
        ("policy", json!("drop")),
        ("prio", json!(0)),
        ("hook", json!("prerouting")),
        ("type", json!("route")),
    ] {
        let (plan, mut l) = vm_nat();
        let i = find(&l, "chain", |c| c["name"] == "mss");
        l["nftables"][i]["chain"][key] = value.clone();
        let d = diff_plan(&plan, &l).unwrap();
        match one(&d) {
            Difference::Declaration {
                object,
                planned,
                listed,
                ..
            } => {
                assert_eq!(object, "chain mss", "{key}");
                let attr = format!(
                    "{key} {}",
                    value.as_str().map_or(value.to_string(), str::to_owned)
                );
                assert!(listed.contains(&attr), "{key}: {listed}");
                assert!(!planned.contains(&attr), "{key}: {planned}");
            }
            d => panic!("{key}: {d:?}"),
        }
    }
}

#[test]
fn an_extra_chain_is_unexpected_and_a_deleted_table_missing() {
    let (plan, mut l) = vm_nat();
    items_mut(&mut l).push(
        json!({"chain": {"family": "inet", "table": "vmn", "name": "sneaky",
        "handle": 40, "type": "filter", "hook": "input", "prio": 0, "policy": "drop"}}),
    );
    let d = diff_plan(&plan, &l).unwrap();
    assert_eq!(
        one(&d),
        &Difference::Object {
            table: "inet vmn".into(),
            object: "chain sneaky".into(),
            missing: false
        }
    );

    let none = json!({"nftables": [{"metainfo": {"version": "1.0.6"}}]});
    let d = diff_plan(&plan, &none).unwrap();
    let missing = Difference::TableMissing {
        table: "inet vmn".into(),
    };
    assert_eq!(one(&d), &missing);
    assert_eq!(one(&d).to_string(), "table inet vmn is missing");
    // Another table of the same name in another family is not ours.
    let other = json!({"nftables": [{"table": {"family": "ip", "name": "vmn", "handle": 1}}]});
    assert_eq!(one(&diff_plan(&plan, &other).unwrap()), &missing);
}

#[test]
fn a_table_the_plan_deletes_must_be_absent() {
    let t = json!({"table": {"family": "ip", "name": "old"}});
    let plan = json!({"nftables": [{"add": t.clone()}, {"delete": t}]});
    assert_eq!(diff_plan(&plan, &json!({"nftables": []})).unwrap(), []);
    let listed = json!({"nftables": [{"table": {"family": "ip", "name": "old", "handle": 7}}]});
    assert_eq!(
        one(&diff_plan(&plan, &listed).unwrap()),
        &Difference::TableUnexpected {
            table: "ip old".into()
        }
    );
}

#[test]
fn set_elements_swapped_added_or_removed_are_differences() {
    let plan = fixture("plan-fw.json");
    let base = fixture("nft-1.0.6-fw.json");
    let peers = find(&base, "set", |s| s["name"] == "peers");
    fn elems_at(v: &mut Value, i: usize) -> &mut Vec<Value> {
        v["nftables"][i]["set"]["elem"].as_array_mut().unwrap()
    }
    // Swapped one for one: the count is the same, the content is not.
    let mut l = base.clone();
    elems_at(&mut l, peers)[0] = json!("192.0.2.66");
    let elements = |l: &Value| match one(&diff_plan(&plan, l).unwrap()) {
        Difference::Elements {
            set,
            missing,
            unexpected,
            ..
        } => (set.clone(), missing.clone(), unexpected.clone()),
        d => panic!("{d:?}"),
    };
    let (set, missing, unexpected) = elements(&l);
    assert_eq!(set, "peers");
    assert_eq!(
        (missing, unexpected),
        (vec!["192.0.2.9".to_owned()], vec!["192.0.2.66".to_owned()])
    );
    // Added, removed.
    let mut l = base.clone();
    elems_at(&mut l, peers).push(json!("192.0.2.77"));
    let (_, missing, unexpected) = elements(&l);
    assert!(missing.is_empty() && unexpected == ["192.0.2.77"]);
    let mut l = base.clone();
    elems_at(&mut l, peers).pop();
    let (_, missing, unexpected) = elements(&l);
    assert!(missing.len() == 1 && unexpected.is_empty());
    // A map's verdict changed.
    let mut l = base.clone();
    let m = find(&l, "map", |s| s["name"] == "byport");
    l["nftables"][m]["map"]["elem"][1] = json!([80, {"drop": null}]);
    let (set, missing, unexpected) = elements(&l);
    assert!(set == "byport" && missing.len() == 1 && unexpected.len() == 1);
    // A set's type changed; a named counter deleted.
    let mut l = base.clone();
    l["nftables"][peers]["set"]["flags"] = json!([]);
    assert!(
        matches!(one(&diff_plan(&plan, &l).unwrap()), Difference::Declaration { object, .. } if object == "set peers")
    );
    let mut l = base;
    let c = find(&l, "counter", |c| c["name"] == "seen");
    items_mut(&mut l).remove(c);
    assert!(
        matches!(one(&diff_plan(&plan, &l).unwrap()), Difference::Object { object, missing: true, .. } if object == "counter seen")
    );
}

#[test]
fn listing_details_are_never_differences() {
    let plan = fixture("plan-fw.json");
    let mut l = fixture("nft-1.0.6-fw.json");
    // Other handles, objects in another order, another nft version, counters that counted.
    for (n, item) in items_mut(&mut l).iter_mut().enumerate() {
        if let Some(h) = item
            .as_object_mut()
            .and_then(|o| o.values_mut().next())
            .and_then(|o| o.get_mut("handle"))
        {
            *h = json!(1000 + n);
        }
    }
    items_mut(&mut l).reverse();
    let rules: Vec<Value> = items_mut(&mut l)
        .iter()
        .filter(|i| i.get("rule").is_some())
        .cloned()
        .collect();
    items_mut(&mut l).retain(|i| i.get("rule").is_none());
    // Rules keep their order within a chain (it is content); the listing's grouping may differ.
    items_mut(&mut l).splice(0..0, rules.into_iter().rev());
    items_mut(&mut l).push(json!({"metainfo": {"version": "1.1.3", "json_schema_version": 1}}));
    let c = find(&l, "counter", |c| c["name"] == "seen");
    l["nftables"][c]["counter"]["packets"] = json!(12);
    let r = find(&l, "rule", |r| r["expr"].to_string().contains("\"seen\""));
    l["nftables"][r]["rule"]["expr"][2] = json!({"counter": {"packets": 5, "bytes": 700}});
    // Elements and anonymous set members in another order, an element with a timer.
    let s = find(&l, "set", |s| s["name"] == "peers");
    l["nftables"][s]["set"]["elem"]
        .as_array_mut()
        .unwrap()
        .reverse();
    l["nftables"][s]["set"]["elem"][0] = json!({"elem": {"val": "203.0.113.7", "expires": 1234}});
    let r = find(&l, "rule", |r| {
        r["expr"].to_string().contains("established")
    });
    l["nftables"][r]["rule"]["expr"][0]["match"]["right"] =
        json!({"set": ["related", "established"]});
    assert_eq!(diff_plan(&plan, &l).unwrap(), [], "{l}");
}

#[test]
fn version_shape_variants_are_normalized() {
    let (plan, mut l) = vm_nat();
    // A priority by name, no policy on a base chain (accept), `{}` for an argument-less
    // statement, no op, an address written long-hand, snat without its family.
    let i = find(&l, "chain", |c| c["name"] == "postrouting");
    l["nftables"][i]["chain"]["prio"] = json!("srcnat");
    l["nftables"][i]["chain"]
        .as_object_mut()
        .unwrap()
        .remove("policy");
    let r = find(&l, "rule", |r| r["chain"] == "postrouting");
    let expr = &mut l["nftables"][r]["rule"]["expr"];
    expr[0]["match"].as_object_mut().unwrap().remove("op");
    expr[1]["match"]["right"] = json!({"set": [{"prefix": {"addr": "172.16.0.0", "len": 30}}]});
    expr[2]["snat"] = json!({"addr": "10.200.0.6"});
    assert_eq!(diff_plan(&plan, &l).unwrap(), []);

    let (plan, fp) = host_ruleset("vmn_host", "10.200.0.0/14".parse().unwrap());
    let mut l = listing_with_fp("nft-1.0.6-host.json", &fp);
    let r = find(&l, "rule", |_| true);
    l["nftables"][r]["rule"]["expr"][2] = json!({"masquerade": {}});
    l["nftables"][r]["rule"]["expr"][0]["match"]["right"] = json!("10.200.0.0/14");
    assert_eq!(diff_plan(&plan, &l).unwrap(), []);
    // A /32 prefix and the bare address are the same match; IPv6 compressed or not.
    let a = norm(&json!({"prefix": {"addr": "2001:db8:0:0::1", "len": 128}}));
    assert_eq!(a, json!("2001:db8::1"));
}

#[test]
fn canonical_listings_ignore_details_and_see_content() {
    let a = fixture("nft-1.0.6-fw.json");
    let mut b = a.clone();
    // Objects in another order (rules keep theirs: it is content), elements too.
    items_mut(&mut b).sort_by_key(|i| i.get("rule").is_none());
    let s = find(&b, "set", |s| s["name"] == "ports");
    b["nftables"][s]["set"]["elem"] = json!([443, 80, 22]);
    assert_eq!(
        canonical_listing(&a).unwrap(),
        canonical_listing(&b).unwrap()
    );
    b["nftables"][s]["set"]["elem"] = json!([443, 80, 23]);
    assert_ne!(
        canonical_listing(&a).unwrap(),
        canonical_listing(&b).unwrap()
    );
}

#[test]
fn plans_and_listings_the_model_cannot_read_are_errors() {
    assert!(matches!(
        diff_plan(&json!({}), &json!({"nftables": []})),
        Err(NftCompareError::Shape(_))
    ));
    let t = json!({"family": "inet", "name": "t"});
    let positioned = json!({"nftables": [{"add": {"table": t}},
        {"add": {"chain": {"family": "inet", "table": "t", "name": "c"}}},
        {"add": {"rule": {"family": "inet", "table": "t", "chain": "c", "index": 0, "expr": []}}}]});
    assert_eq!(
        diff_plan(&positioned, &json!({"nftables": []})).unwrap_err(),
        NftCompareError::Unsupported("add rule".into())
    );
    let orphan =
        json!({"nftables": [{"add": {"chain": {"family": "inet", "table": "t", "name": "c"}}}]});
    assert!(matches!(
        diff_plan(&orphan, &json!({"nftables": []})),
        Err(NftCompareError::Shape(m)) if m.contains("did not add")
    ));
}

#[test]
fn the_plan_is_replayed_in_order() {
    let t = json!({"family": "inet", "name": "t"});
    let c = |name: &str| json!({"family": "inet", "table": "t", "name": name});
    let r = |chain: &str, verdict: &str| json!({"family": "inet", "table": "t", "chain": chain, "expr": [{verdict: null}]});
    let plan = json!({"nftables": [
        {"add": {"table": t}}, {"add": {"chain": c("a")}}, {"add": {"chain": c("gone")}},
        {"add": {"rule": r("a", "accept")}}, {"insert": {"rule": r("a", "drop")}},
        {"delete": {"chain": c("gone")}},
        {"add": {"set": {"family": "inet", "table": "t", "name": "s", "type": "ipv4_addr"}}},
        {"add": {"element": {"family": "inet", "table": "t", "name": "s", "elem": ["192.0.2.1", "192.0.2.2"]}}},
        {"delete": {"element": {"family": "inet", "table": "t", "name": "s", "elem": ["192.0.2.1"]}}}
    ]});
    let listed = json!({"nftables": [
        {"table": {"family": "inet", "name": "t", "handle": 1}},
        {"set": {"family": "inet", "table": "t", "name": "s", "type": "ipv4_addr", "handle": 2, "elem": ["192.0.2.2"]}},
        {"chain": {"family": "inet", "table": "t", "name": "a", "handle": 3}},
        {"rule": {"family": "inet", "table": "t", "chain": "a", "handle": 4, "expr": [{"drop": null}]}},
        {"rule": {"family": "inet", "table": "t", "chain": "a", "handle": 5, "expr": [{"accept": null}]}}
    ]});
    assert_eq!(diff_plan(&plan, &listed).unwrap(), []);
}

#[test]
fn a_dormant_table_differs_from_its_plan_and_flags_are_read_in_either_spelling() {
    let (plan, mut listing) = vm_nat();
    let t = find(&listing, "table", |_| true);
    items_mut(&mut listing)[t]["table"]["flags"] = json!("dormant");
    let d = diff_plan(&plan, &listing).unwrap();
    assert_eq!(
        one(&d).to_string(),
        "table inet vmn: table flags is `dormant`, planned ``"
    );
    items_mut(&mut listing)[t]["table"]["flags"] = json!(["dormant"]);
    assert_eq!(diff_plan(&plan, &listing).unwrap(), d);
    // How nft 1.0.6 lists `add table inet vmn { flags dormant; }`.
    items_mut(&mut listing)[t]["table"]["flags"] = json!("vmn");
    assert_eq!(
        one(&diff_plan(&plan, &listing).unwrap()).to_string(),
        "table inet vmn: table flags is `a flag nft listed as \"vmn\"`, planned ``"
    );
    items_mut(&mut listing)[t]["table"]["flags"] = json!([]);
    assert_eq!(diff_plan(&plan, &listing).unwrap(), []);
}
