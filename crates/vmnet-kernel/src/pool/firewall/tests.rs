//! The firewall's decisions without a kernel: a fake executor that keeps every applied batch and
//! lists them back as one document (read by content, deletes applied as the kernel would).

use std::sync::Mutex;

use serde_json::Value;
use vmnet_model::nic::{InstanceSpec, MacAddr, NetworkPolicy, NicSpec};
use vmnet_plan::pool::nft::{Firewall, HostAddrs};

use super::*;

#[derive(Default)]
struct Fake {
    applied: Mutex<Vec<Value>>,
    batches: Mutex<Vec<String>>,
    refuse: Mutex<bool>,
}

impl NftExec for Fake {
    fn apply(&self, batch: &str) -> Result<(), FirewallError> {
        if *self.refuse.lock().unwrap() {
            return Err(FirewallError::Helper("refused by the fake".into()));
        }
        let v: Value = serde_json::from_str(batch).unwrap();
        self.applied
            .lock()
            .unwrap()
            .extend(v["nftables"].as_array().unwrap().iter().cloned());
        self.batches.lock().unwrap().push(batch.to_owned());
        Ok(())
    }

    fn list(&self) -> Result<String, FirewallError> {
        Ok(serde_json::json!({ "nftables": *self.applied.lock().unwrap() }).to_string())
    }
}

fn inst(id: &str, ip: &str) -> InstanceSpec {
    InstanceSpec {
        id: id.into(),
        allocation_id: format!("a-{id}"),
        policy: NetworkPolicy::Public,
        sandbox: false,
        nics: vec![NicSpec {
            network: Some("br0".parse().unwrap()),
            mac: MacAddr::for_instance(id),
            addresses: vec![format!("{ip}/24").parse().unwrap()],
            gateway: None,
            gateway6: None,
            nameservers: vec![],
        }],
    }
}

fn loaded() -> PoolFirewall<Fake> {
    let mut fw = PoolFirewall::new(Fake::default());
    fw.replace(Firewall {
        taps: vec![],
        host: HostAddrs::default(),
    })
    .unwrap();
    fw
}

#[test]
fn first_and_last_tap_are_full_replaces_others_are_element_batches() {
    let mut fw = loaded();
    fw.add_instance(&inst("i-1", "10.0.0.2")).unwrap();
    fw.add_instance(&inst("i-2", "10.0.0.3")).unwrap();
    let batches = fw.exec().batches.lock().unwrap().clone();
    assert_eq!(batches.len(), 3);
    assert!(
        batches[1].contains("bcd_taps"),
        "first tap loads the backstop"
    );
    assert!(
        !batches[2].contains("\"table\":{"),
        "second tap is elements only: {}",
        batches[2]
    );
    assert!(batches[2].len() < 1500);
    fw.remove_instance("i-1").unwrap();
    fw.remove_instance("i-2").unwrap();
    let batches = fw.exec().batches.lock().unwrap().clone();
    assert!(
        batches[3].starts_with(r#"{"nftables":[{"delete":{"element""#),
        "{}",
        batches[3]
    );
    assert!(batches[4].contains("bcd_instances") && batches[4].contains("\"delete\""));
    assert!(fw.audit().unwrap().drift.is_empty());
}

#[test]
fn refused_changes_keep_the_previous_state() {
    let mut fw = loaded();
    fw.add_instance(&inst("i-1", "10.0.0.2")).unwrap();
    let before = fw.desired().clone();
    *fw.exec().refuse.lock().unwrap() = true;
    assert!(fw.add_instance(&inst("i-2", "10.0.0.3")).is_err());
    assert!(fw.remove_instance("i-1").is_err());
    assert_eq!(fw.desired(), &before);
    *fw.exec().refuse.lock().unwrap() = false;
    assert!(fw.audit().unwrap().drift.is_empty());
}

#[test]
fn duplicate_instance_is_a_conflict() {
    let mut fw = loaded();
    fw.add_instance(&inst("i-1", "10.0.0.2")).unwrap();
    let e = fw.add_instance(&inst("i-1", "10.0.0.2")).unwrap_err();
    assert!(
        matches!(&e, FirewallError::Duplicate(id) if id == "i-1"),
        "{e:?}"
    );
}

#[test]
fn a_lost_ruleset_is_drift_and_is_repaired_and_counted() {
    let mut fw = loaded();
    fw.add_instance(&inst("i-1", "10.0.0.2")).unwrap();
    fw.exec().applied.lock().unwrap().clear();
    let r = fw.audit().unwrap();
    assert!(
        r.repaired && r.drift.iter().any(|d| d.contains("missing")),
        "{r:?}"
    );
    assert_eq!(fw.status().drift_repairs, 1);
    assert_eq!(fw.status().taps, 1);
    assert!(fw.audit().unwrap().drift.is_empty());
}

/// The commands of batch `i` as `verb set elements…` lines.
fn commands(fw: &PoolFirewall<Fake>, i: usize) -> Vec<String> {
    let v: Value = serde_json::from_str(&fw.exec().batches.lock().unwrap()[i]).unwrap();
    v["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let (verb, body) = c.as_object().unwrap().iter().next().unwrap();
            let e = &body["element"];
            format!("{verb} {} {}", e["name"].as_str().unwrap(), e["elem"])
        })
        .collect()
}

#[test]
fn replace_instance_swaps_only_the_changed_elements_in_one_batch() {
    let mut fw = loaded();
    fw.add_instance(&inst("i-1", "10.0.0.2")).unwrap();
    fw.add_instance(&inst("i-2", "10.0.0.3")).unwrap();
    let n = fw.exec().batches.lock().unwrap().len();

    // A new lease and policy: one batch, the old address and verdicts out, the new ones in.
    let mut moved = inst("i-1", "10.0.0.5");
    moved.policy = NetworkPolicy::Private;
    fw.replace_instance(&moved).unwrap();
    assert_eq!(fw.exec().batches.lock().unwrap().len(), n + 1);
    let tap = moved.tap_names().unwrap()[0].to_string();
    let cmds = commands(&fw, n);
    let heads: Vec<String> = cmds
        .iter()
        .map(|c| c.split(' ').take(2).collect::<Vec<_>>().join(" "))
        .collect();
    for want in [
        "delete tap_ip4",
        "add tap_ip4",
        "add in_policy",
        "add out_policy",
    ] {
        assert!(heads.iter().any(|h| h == want), "{want}: {cmds:#?}");
    }
    // Elements that stay (the tap, its MAC, its IPv6 link-local) are not touched.
    for kept in [
        "taps",
        "tap_mac",
        "tap_ip6",
        "ip4_unchecked",
        "sandbox_taps",
    ] {
        assert!(
            !heads.iter().any(|h| h.ends_with(&format!(" {kept}"))),
            "{kept}: {cmds:#?}"
        );
    }
    let first_add = heads.iter().position(|h| h.starts_with("add ")).unwrap();
    assert!(
        heads[first_add..].iter().all(|h| h.starts_with("add ")),
        "deletes first: {cmds:#?}"
    );
    let find = |h: &str| &cmds[heads.iter().position(|x| x == h).unwrap()];
    assert!(
        find("delete tap_ip4").contains("10.0.0.2") && find("delete tap_ip4").contains(&tap),
        "{cmds:?}"
    );
    assert!(find("add tap_ip4").contains("10.0.0.5"), "{cmds:?}");
    assert!(find("add in_policy").contains("private_out"), "{cmds:?}");
    assert!(
        !cmds.iter().any(|c| c.contains("10.0.0.3")),
        "i-2 untouched"
    );
    let entry = fw
        .desired()
        .taps
        .iter()
        .find(|t| t.tap.as_str() == tap)
        .unwrap();
    assert_eq!(
        entry.ip4,
        vec!["10.0.0.5".parse::<std::net::Ipv4Addr>().unwrap()]
    );
    assert_eq!(fw.desired().taps.len(), 2);
    // The planned content followed: no drift, and the elements are those of the new spec.
    assert!(fw.audit().unwrap().drift.is_empty());
    let elements = fw.observe().unwrap().element_counts();
    assert_eq!(elements["bridge bcd_instances tap_ip4"], 2, "{elements:?}");
    assert_eq!(
        elements["bridge bcd_instances in_policy"], 1,
        "{elements:?}"
    );

    // Back to public: the verdicts go, nothing is added.
    let back = inst("i-1", "10.0.0.5");
    fw.replace_instance(&back).unwrap();
    let cmds = commands(&fw, n + 1);
    assert_eq!(cmds.len(), 2, "{cmds:?}");
    assert!(
        cmds.iter()
            .all(|c| c.starts_with("delete ") && c.contains("_policy "))
    );
    assert!(fw.audit().unwrap().drift.is_empty());

    // Only the nameservers and the gateway change: no element does, nothing is applied.
    let mut dns = back.clone();
    dns.nics[0].nameservers = vec!["10.0.0.1".parse().unwrap()];
    dns.nics[0].gateway = Some("10.0.0.1".parse().unwrap());
    fw.replace_instance(&dns).unwrap();
    assert_eq!(fw.exec().batches.lock().unwrap().len(), n + 2);
    assert!(fw.audit().unwrap().drift.is_empty());
}

#[test]
fn replace_instance_is_an_add_when_nothing_is_held_and_a_full_replace_for_the_first_tap() {
    let mut fw = loaded();
    // First tap on the host: the backstop tables come with it.
    fw.replace_instance(&inst("i-1", "10.0.0.2")).unwrap();
    let batches = fw.exec().batches.lock().unwrap().clone();
    assert_eq!(batches.len(), 2);
    assert!(batches[1].contains("bcd_taps"));
    // Another instance: an element add; the same spec again changes nothing.
    fw.replace_instance(&inst("i-2", "10.0.0.3")).unwrap();
    fw.replace_instance(&inst("i-2", "10.0.0.3")).unwrap();
    let batches = fw.exec().batches.lock().unwrap().clone();
    assert_eq!(batches.len(), 3);
    assert!(
        batches[2].starts_with(r#"{"nftables":[{"add":{"element""#),
        "{}",
        batches[2]
    );
    assert_eq!(fw.desired().taps.len(), 2);
    assert!(fw.audit().unwrap().drift.is_empty());
}

#[test]
fn a_refused_replace_instance_keeps_the_old_entries() {
    let mut fw = loaded();
    fw.add_instance(&inst("i-1", "10.0.0.2")).unwrap();
    fw.add_instance(&inst("i-2", "10.0.0.3")).unwrap();
    let before = fw.desired().clone();
    *fw.exec().refuse.lock().unwrap() = true;
    assert!(fw.replace_instance(&inst("i-1", "10.0.0.4")).is_err());
    assert_eq!(fw.desired(), &before);
    *fw.exec().refuse.lock().unwrap() = false;
    assert!(fw.audit().unwrap().drift.is_empty());
}

#[test]
fn retain_taps_removes_the_others_in_one_batch_and_the_last_with_the_backstop() {
    let mut fw = loaded();
    fw.add_instance(&inst("i-1", "10.0.0.2")).unwrap();
    fw.add_instance(&inst("i-2", "10.0.0.3")).unwrap();
    let keep = inst("i-2", "10.0.0.3").tap_names().unwrap()[0].clone();
    let gone = inst("i-1", "10.0.0.2").tap_names().unwrap()[0].clone();
    assert_eq!(fw.retain_taps(|t| *t == keep).unwrap(), vec![gone]);
    assert!(
        fw.retain_taps(|t| *t == keep).unwrap().is_empty(),
        "nothing more"
    );
    let batches = fw.exec().batches.lock().unwrap().clone();
    assert_eq!(batches.len(), 4);
    assert!(batches[3].starts_with(r#"{"nftables":[{"delete":{"element""#));
    assert!(fw.audit().unwrap().drift.is_empty());
    assert_eq!(fw.retain_taps(|_| false).unwrap(), vec![keep]);
    let batches = fw.exec().batches.lock().unwrap().clone();
    assert!(batches[4].contains("bcd_taps") && batches[4].contains("\"delete\""));
    assert!(fw.desired().taps.is_empty());
    assert!(fw.audit().unwrap().drift.is_empty());
}

#[test]
fn a_swapped_element_is_drift_named_repaired_and_an_unchanged_ruleset_is_never_reapplied() {
    let mut fw = loaded();
    fw.add_instance(&inst("i-1", "10.0.0.2")).unwrap();
    fw.add_instance(&inst("i-2", "10.0.0.3")).unwrap();
    let n = fw.exec().batches.lock().unwrap().len();
    for _ in 0..5 {
        assert_eq!(fw.audit().unwrap(), AuditReport::default());
    }
    assert_eq!(
        fw.exec().batches.lock().unwrap().len(),
        n,
        "nothing applied"
    );
    assert_eq!(fw.status().drift_repairs, 0);

    // i-1's address swapped for an attacker's: the count stays the same.
    let tap = inst("i-1", "10.0.0.2").tap_names().unwrap()[0].to_string();
    let elem = |ip: &str| {
        serde_json::json!({"family": "bridge", "table": "bcd_instances", "name": "tap_ip4",
            "elem": [{"concat": [tap, ip]}]})
    };
    fw.exec().applied.lock().unwrap().extend([
        serde_json::json!({"delete": {"element": elem("10.0.0.2")}}),
        serde_json::json!({"add": {"element": elem("10.0.0.66")}}),
    ]);
    let r = fw.audit().unwrap();
    assert!(r.repaired, "{r:?}");
    assert_eq!(
        r.drift,
        [format!(
            "table bridge bcd_instances: set tap_ip4 has 2 elements, 2 planned; missing {tap} . \
             10.0.0.2; unexpected {tap} . 10.0.0.66"
        )]
    );
    assert_eq!(fw.status().drift_repairs, 1);
    assert!(fw.audit().unwrap().drift.is_empty());
    assert_eq!(fw.status().drift_repairs, 1);
}
