//! The firewall's decisions without a kernel: a fake executor that keeps every applied batch and
//! lists them back as one document (the census reads deletes as the kernel would).

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
    let e = fw
        .add_instance(&inst("i-1", "10.0.0.2"))
        .unwrap_err()
        .to_error();
    assert_eq!(e.code, vmnet_model::ErrorCode::Conflict);
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
