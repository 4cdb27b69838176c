//! The nf_tables generation check of the VM's netns table (root required). Once a table was
//! found as planned, audits and observes read the netns's generation over a kept socket and
//! skip the listing while it has not moved; these tests edit the table by hand *after* it was
//! recorded in sync (a rule deleted, a rule edited, a chain policy flipped, an
//! accept-all rule added) and check each edit is still found and replaced, that a netns made
//! again under the same name is never taken for the old one, and that the kept socket does
//! not keep a deleted VM's netns (and with it the host veth end) alive.

mod ns_support;

use std::time::{Duration, Instant};

use ns_support::{Env, link_info};
use serde_json::json;
use vmnet_kernel::netns;
use vmnet_plan::ns::VmPlan;
use vmnet_testkit::nft::{last_rule_handle, nft};

fn fw_vm(env: &Env, uid: u32, inbound: &str) -> VmPlan {
    let v = json!({"id": format!("g{uid:x}"), "user_id": uid, "tenant": 1,
        "mesh_ipv6": format!("fdaa:3::{uid:x}"),
        "network": {"routes": [{"destination": "0.0.0.0/0", "via": "host"}]},
        "firewall": {"enabled": true,
            "inbound": [{"protocol": "any", "prefixes": [inbound]},
                        {"protocol": "tcp", "ports": "22", "prefixes": ["2001:db8::/32"]}],
            "outbound": [{"protocol": "any", "prefixes": ["0.0.0.0/0", "::/0"]}]}});
    env.plan(&v.to_string())
}

/// Polls until the host link `name` is gone; fails after `within`.
async fn gone_within(env: &Env, name: &str, within: Duration) -> Duration {
    let t0 = Instant::now();
    while link_info(&env.sb.host(), name).is_some() {
        assert!(
            t0.elapsed() < within,
            "host veth {name} still there after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    t0.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn a_table_edited_after_it_was_found_in_sync_is_still_repaired() {
    let env = Env::new();
    let plan = fw_vm(&env, 0x61, "198.51.100.0/24");
    env.driver.apply(&plan).await.unwrap();
    let ns = plan.netns.clone();
    let t = env.settings.name_prefix.clone();
    // The first audit lists and records the table; the next ones find the generation unmoved.
    for i in 0..3 {
        assert_eq!(env.driver.audit_table(&plan).await.unwrap(), None, "{i}");
    }
    let policy = format!(
        "add chain inet {t} filter {{ type filter hook forward priority 0; policy drop; }}"
    );
    let accept_all = format!("insert rule inet {t} filter accept");
    for what in [
        "rule deleted",
        "rule edited",
        "policy flipped",
        "accept-all added",
    ] {
        // In sync and recorded (by the previous audit, or by the repair's own commit).
        assert_eq!(env.driver.audit_table(&plan).await.unwrap(), None, "{what}");
        match what {
            "rule deleted" => {
                let h = last_rule_handle(&ns, &t, "fw_in").unwrap().to_string();
                nft(&ns, &["delete", "rule", "inet", &t, "fw_in", "handle", &h]).unwrap();
            }
            "rule edited" => {
                // The chain's closing drop made an accept.
                let h = last_rule_handle(&ns, &t, "fw_in").unwrap().to_string();
                nft(
                    &ns,
                    &[
                        "replace", "rule", "inet", &t, "fw_in", "handle", &h, "accept",
                    ],
                )
                .unwrap();
            }
            "policy flipped" => {
                nft(&ns, &[&policy]).unwrap();
            }
            _ => {
                nft(&ns, &[&accept_all]).unwrap();
            }
        }
        let diffs = env.driver.audit_table(&plan).await.unwrap();
        assert!(
            diffs.as_ref().is_some_and(|d| !d.is_empty()),
            "{what}: the audit must find it: {diffs:?}"
        );
        assert_eq!(
            env.driver.audit_table(&plan).await.unwrap(),
            None,
            "{what}: repaired"
        );
        assert!(env.driver.drift(&plan).await.unwrap().is_empty(), "{what}");
    }
    // The same through observe: an edit after a drift report found the table in sync.
    assert!(env.driver.drift(&plan).await.unwrap().is_empty());
    nft(&ns, &[&accept_all]).unwrap();
    assert!(
        !env.driver.drift(&plan).await.unwrap().is_empty(),
        "observe must find the edit"
    );
    assert!(
        !env.driver.apply(&plan).await.unwrap().is_empty(),
        "repaired"
    );
    assert!(env.driver.apply(&plan).await.unwrap().is_empty(), "in sync");
    assert_eq!(env.driver.audit_table(&plan).await.unwrap(), None);
    // A changed firewall is a new plan: its table is compared, never taken as the old one's.
    let other = fw_vm(&env, 0x61, "203.0.113.0/24");
    env.driver.apply_table(&other).await.unwrap();
    assert_eq!(env.driver.audit_table(&other).await.unwrap(), None);
    assert!(
        env.driver.audit_table(&plan).await.unwrap().is_some(),
        "the old plan differs from the table now"
    );
    env.driver.remove(plan.user_id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn a_netns_made_again_under_the_same_name_is_listed_and_the_old_one_let_go() {
    let env = Env::new();
    let plan = fw_vm(&env, 0x62, "198.51.100.0/24");
    env.driver.apply(&plan).await.unwrap();
    assert_eq!(env.driver.audit_table(&plan).await.unwrap(), None);
    assert_eq!(env.driver.audit_table(&plan).await.unwrap(), None);
    // By hand: the netns deleted and made again with a table of that name (one commit, as
    // the agent's own create makes one: the generation may well read the same number).
    netns::delete(&plan.netns).unwrap();
    netns::create(&plan.netns).unwrap();
    let t = env.settings.name_prefix.clone();
    nft(&plan.netns, &["add", "table", "inet", &t]).unwrap();
    let diffs = env.driver.audit_table(&plan).await.unwrap();
    assert!(
        diffs.is_some_and(|d| !d.is_empty()),
        "another namespace's table is compared"
    );
    assert_eq!(env.driver.audit_table(&plan).await.unwrap(), None);
    // The old namespace is no longer held: its veth pair goes with it.
    let host = plan.veth.as_ref().unwrap().host_name.clone();
    gone_within(&env, &host, Duration::from_secs(1)).await;
    env.driver.remove(plan.user_id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn a_deleted_vms_netns_and_host_veth_are_gone_within_a_second() {
    let env = Env::new();
    let mut plans = Vec::new();
    for uid in 0x63..0x67 {
        let p = fw_vm(&env, uid, "198.51.100.0/24");
        env.driver.apply(&p).await.unwrap();
        // Audit and observe: each keeps its generation socket in the VM's netns.
        assert_eq!(env.driver.audit_table(&p).await.unwrap(), None);
        assert!(env.driver.drift(&p).await.unwrap().is_empty());
        plans.push(p);
    }
    // One VM removed right after its firewall changed (a commit that released objects).
    let changed = fw_vm(&env, 0x63, "203.0.113.0/24");
    env.driver.apply_table(&changed).await.unwrap();
    for p in &plans {
        let t0 = Instant::now();
        env.driver.remove_deferred(p.user_id).await.unwrap();
        let took = t0.elapsed();
        assert!(!netns::exists(&p.netns), "netns unmounted");
        let host = p.veth.as_ref().unwrap().host_name.clone();
        let after = gone_within(&env, &host, Duration::from_secs(1)).await;
        eprintln!(
            "{}: removal {:.2} ms, host veth gone {:.0} ms after",
            p.netns,
            took.as_secs_f64() * 1e3,
            after.as_secs_f64() * 1e3
        );
    }
}
