//! Drift by content on a real kernel: every kind of hand edit of the three bcd tables (a rule
//! deleted, added or changed; a chain deleted or a base chain's policy flipped; a set element
//! swapped one for one, added or removed; a table deleted or switched off with `flags dormant`)
//! is found by the next audit, repaired and counted, and an unchanged ruleset is never
//! re-applied, however the instances changed
//! before. The edits that keep every count (a swapped element, a flipped policy) are proven
//! with packets too.

mod pool_support;

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use pool_support::{Lab, marker, ping_ok};
use serde_json::Value;
use vmnet_model::nic::NetworkPolicy;
use vmnet_testkit::netns as tk;
use vmnet_testkit::probe::{Capture, send_frame, udp4_frame};

fn nft(lab: &Lab, args: &[&str]) {
    let out = tk::exec(&lab.host, "nft", args, Duration::from_secs(10)).unwrap();
    assert!(
        out.status.success(),
        "nft {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The handle of rule `index` of chain `chain` of `bridge bcd_instances`.
fn rule_handle(lab: &Lab, chain: &str, index: usize) -> String {
    let out = tk::exec(
        &lab.host,
        "nft",
        &["-j", "list", "chain", "bridge", "bcd_instances", chain],
        Duration::from_secs(10),
    )
    .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|i| i.get("rule"))
        .nth(index)
        .unwrap()["handle"]
        .to_string()
}

/// One audit finds drift matching `want`, repairs it and counts it; the next finds none.
fn repaired(lab: &mut Lab, what: &str, want: &str) {
    let before = lab.pool.firewall.status().drift_repairs;
    let r = lab.pool.firewall.audit().unwrap();
    assert!(r.repaired, "{what}: {r:?}");
    assert!(
        r.drift.iter().any(|d| d.contains(want)),
        "{what}: {want:?} in {:?}",
        r.drift
    );
    assert_eq!(
        lab.pool.firewall.status().drift_repairs,
        before + 1,
        "{what}"
    );
    let again = lab.pool.firewall.audit().unwrap();
    assert!(again.drift.is_empty(), "{what}: after the repair {again:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn every_kind_of_hand_edit_is_repaired_and_counted() {
    let mut lab = Lab::nft_only("pm").await;
    let (a, b) = lab.add_public_pair().await;
    let (tap_a, ip_a, mac_a) = (
        lab.guests[a].tap.clone(),
        lab.guests[a].ip4,
        lab.guests[a].mac,
    );
    let tap_b = lab.guests[b].tap.clone();
    let elem = |tap: &str, v: &str| format!("{{ \"{tap}\" . {v} }}");
    let t = ["bridge", "bcd_instances"];

    // Rules.
    let h = rule_handle(&lab, "from_tap", 2);
    nft(
        &lab,
        &["delete", "rule", t[0], t[1], "from_tap", "handle", &h],
    );
    repaired(&mut lab, "rule deleted", "the first difference at rule 2");
    nft(&lab, &["add", "rule", t[0], t[1], "to_tap", "accept"]);
    repaired(&mut lab, "rule added", "chain to_tap has");
    let h = rule_handle(&lab, "from_tap", 0);
    let changed = ["replace", "rule", t[0], t[1], "from_tap", "handle", &h];
    let mut args = changed.to_vec();
    args.extend(["meta", "iifname", "!=", "@taps", "accept"]);
    nft(&lab, &args);
    repaired(&mut lab, "rule changed", "the first difference at rule 0");

    // Chains.
    nft(&lab, &["flush", "chain", "inet", "bcd_taps", "forward"]);
    nft(&lab, &["delete", "chain", "inet", "bcd_taps", "forward"]);
    repaired(
        &mut lab,
        "chain deleted",
        "table inet bcd_taps: chain forward is missing",
    );
    nft(
        &lab,
        &["chain", t[0], t[1], "postrouting", "{ policy drop ; }"],
    );
    repaired(&mut lab, "policy flipped", "policy drop`, planned");

    // Elements: swapped one for one, added, removed.
    nft(
        &lab,
        &[
            "delete",
            "element",
            t[0],
            t[1],
            "tap_ip4",
            &elem(&tap_a, &ip_a.to_string()),
        ],
    );
    nft(
        &lab,
        &[
            "add",
            "element",
            t[0],
            t[1],
            "tap_ip4",
            &elem(&tap_a, "10.0.0.6"),
        ],
    );
    repaired(
        &mut lab,
        "address swapped",
        &format!("missing {tap_a} . {ip_a}; unexpected {tap_a} . 10.0.0.6"),
    );
    nft(
        &lab,
        &[
            "delete",
            "element",
            t[0],
            t[1],
            "tap_mac",
            &elem(&tap_a, &mac_a.to_string()),
        ],
    );
    nft(
        &lab,
        &[
            "add",
            "element",
            t[0],
            t[1],
            "tap_mac",
            &elem(&tap_a, "02:de:ad:be:ef:01"),
        ],
    );
    repaired(&mut lab, "MAC swapped", "unexpected ");
    nft(
        &lab,
        &[
            "delete",
            "element",
            t[0],
            t[1],
            "taps",
            &format!("{{ \"{tap_b}\" }}"),
        ],
    );
    nft(
        &lab,
        &[
            "add",
            "element",
            t[0],
            t[1],
            "taps",
            "{ \"bc0123456789n0\" }",
        ],
    );
    repaired(&mut lab, "membership swapped", "unexpected bc0123456789n0");
    nft(
        &lab,
        &[
            "add",
            "element",
            t[0],
            t[1],
            "tap_ip4",
            &elem(&tap_b, "10.0.0.5"),
        ],
    );
    repaired(
        &mut lab,
        "element added",
        "set tap_ip4 has 3 elements, 2 planned",
    );
    nft(
        &lab,
        &[
            "delete",
            "element",
            t[0],
            t[1],
            "leased4",
            &format!("{{ {ip_a} }}"),
        ],
    );
    repaired(
        &mut lab,
        "element removed",
        "set leased4 has 1 elements, 2 planned",
    );

    // Tables.
    nft(&lab, &["delete", "table", "arp", "bcd_taps"]);
    repaired(&mut lab, "table deleted", "table arp bcd_taps is missing");
    nft(&lab, &["add table inet bcd_taps { flags dormant; }"]);
    repaired(
        &mut lab,
        "table switched off",
        "table inet bcd_taps: table flags is",
    );
    assert_eq!(lab.pool.firewall.status().drift_repairs, 12);
    assert!(
        ping_ok(&lab.guests[a].ns, IpAddr::V4(lab.guests[b].ip4)),
        "traffic works after the repairs"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn edits_that_keep_every_count_are_repaired_with_packets_as_proof() {
    let mut lab = Lab::nft_only("pn").await;
    let (a, b) = lab.add_public_pair().await;
    let (ga, gb) = (&lab.guests[a], &lab.guests[b]);
    let (tap_a, ip_a) = (ga.tap.clone(), ga.ip4);
    let (ns_a, ip_b) = (ga.ns.clone(), gb.ip4);
    let cap = Capture::start(&gb.ns, "eth0").unwrap();
    let (mac_a, mac_b) = (ga.mac, gb.mac);
    let from = |src: Ipv4Addr, tag: &str| {
        let m = marker(tag);
        send_frame(
            &ns_a,
            "eth0",
            &udp4_frame(mac_b, mac_a, src, ip_b, (1, 2), &m),
        )
        .unwrap();
        cap.saw(&m, Duration::from_millis(600))
    };
    let stolen = Ipv4Addr::new(10, 0, 0, 6);
    assert!(from(ip_a, "honest-before") && !from(stolen, "spoof-before"));

    // The tap's allowed address swapped for another: the spoof passes, the honest frame not.
    let set = |verb: &str, ip: Ipv4Addr| {
        let e = format!("{{ \"{tap_a}\" . {ip} }}");
        let args = [verb, "element", "bridge", "bcd_instances", "tap_ip4", &e];
        let out = tk::exec(&lab.host, "nft", &args, Duration::from_secs(10)).unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    set("delete", ip_a);
    set("add", stolen);
    assert!(
        from(stolen, "spoof-swapped"),
        "control: the swap lets the spoof through"
    );
    let r = lab.pool.firewall.audit().unwrap();
    assert!(r.repaired, "{r:?}");
    assert!(from(ip_a, "honest-after") && !from(stolen, "spoof-after"));

    // A base chain's policy flipped to drop cuts off every guest until the audit.
    nft(
        &lab,
        &[
            "chain",
            "bridge",
            "bcd_instances",
            "prerouting",
            "{ policy drop ; }",
        ],
    );
    assert!(
        !ping_ok(&ns_a, IpAddr::V4(ip_b)),
        "control: policy drop cuts the guests off"
    );
    let r = lab.pool.firewall.audit().unwrap();
    assert!(
        r.repaired && r.drift[0].contains("chain prerouting"),
        "{r:?}"
    );
    assert!(
        ping_ok(&ns_a, IpAddr::V4(ip_b)),
        "the repair restores traffic"
    );
    assert_eq!(lab.pool.firewall.status().drift_repairs, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn an_unchanged_ruleset_is_never_reapplied() {
    let mut lab = Lab::new("po").await;
    let a = lab
        .add("inst-a", "10.0.0.2", NetworkPolicy::Private, true)
        .await;
    lab.add("inst-b", "10.0.0.3", NetworkPolicy::None, false)
        .await;
    lab.add_unleased("inst-u").await;
    // An instance updated in place (new lease and policy: elements swapped in one batch), one
    // removed: the planned digests follow every element batch.
    let mut moved = lab.guests[a].inst.clone();
    moved.nics[0].addresses = vec!["10.0.0.4/29".parse().unwrap()];
    moved.policy = NetworkPolicy::Public;
    lab.pool.firewall.replace_instance(&moved).unwrap();
    let mut gone = lab.guests.pop().unwrap();
    drop(gone.relay.take());
    lab.pool.stop_instance(&gone.inst).await.unwrap();
    for pass in 0..5 {
        let r = lab.pool.firewall.audit().unwrap();
        assert!(!r.repaired && r.drift.is_empty(), "pass {pass}: {r:?}");
    }
    assert_eq!(lab.pool.firewall.status().drift_repairs, 0);
}
