//! Namespace mode nft drift, compared by content (root required): each kind of hand edit of a
//! VM's netns table and of the host table (rule deleted, added, changed; chain deleted; policy
//! flipped; table deleted; table switched off with `flags dormant`) is reported, repaired by one apply (the host table by one
//! `repair_host`), and the guest's IPv4 through NAT works again; a table in sync is never
//! re-applied.

mod ns_support;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use ns_support::{Env, T, vm_json};
use vmnet_kernel::ns::Change;
use vmnet_plan::ns::VmPlan;
use vmnet_testkit::guest::SimGuest;
use vmnet_testkit::nft::{Edit, Target};
use vmnet_testkit::sandbox::{ECHO_PORT, ECHO_V4, HOST_UPLINK_V4};
use vmnet_testkit::traffic;

fn nat_vm(env: &Env, uid: u32) -> VmPlan {
    env.plan(&vm_json(
        "n",
        uid,
        Some(&format!("fdaa:3::{uid:x}")),
        &[("0.0.0.0/0", "host")],
    ))
}

/// The guest reaches the fake internet over IPv4, masqueraded to the sandbox uplink.
fn reaches(guest: &SimGuest, when: &str) {
    let echo = SocketAddr::new(IpAddr::V4(ECHO_V4), ECHO_PORT);
    let r = traffic::udp_echo(guest.netns(), echo, T).unwrap_or_else(|e| panic!("{when}: {e}"));
    assert_eq!(r.peer.ip(), IpAddr::V4(HOST_UPLINK_V4), "{when}");
}

/// Whether the guest's IPv4 is cut off (no answer, or not through the host's masquerade).
fn cut_off(guest: &SimGuest) -> bool {
    let echo = SocketAddr::new(IpAddr::V4(ECHO_V4), ECHO_PORT);
    traffic::try_udp_echo(guest.netns(), echo, Duration::from_millis(500))
        .unwrap()
        .is_none_or(|r| r.peer.ip() != IpAddr::V4(HOST_UPLINK_V4))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn every_hand_edit_of_a_vm_table_is_seen_and_repaired_by_one_apply() {
    let env = Env::new();
    let plan = nat_vm(&env, 0x33);
    env.driver.apply(&plan).await.unwrap();
    let _echo = env.sb.start_echo().unwrap();
    let guest = env.guest("n", &plan, &[], 1380);
    reaches(&guest, "before");
    let peer = &plan.veth.as_ref().unwrap().peer_name;
    let target = Target {
        netns: plan.netns.clone(),
        family: "inet".into(),
        table: env.settings.name_prefix.clone(),
        chain: "postrouting".into(),
        changed_rule: format!("oifname {peer} ip saddr 172.16.0.0/30 snat ip to 10.200.0.99"),
        policy_chain: "mss".into(),
    };
    for edit in Edit::ALL {
        target.apply(edit).unwrap();
        if matches!(edit, Edit::RuleDeleted | Edit::TableDormant) {
            assert!(
                cut_off(&guest),
                "{edit:?}: without the NAT rule the guest loses IPv4"
            );
        }
        let drift = env.driver.drift(&plan).await.unwrap();
        assert!(
            matches!(drift.as_slice(), [Change::ReplaceNft { .. }]),
            "{edit:?}: {drift:?}"
        );
        let fixed = env.driver.apply(&plan).await.unwrap();
        assert!(
            matches!(fixed.as_slice(), [Change::ReplaceNft { .. }]),
            "{edit:?}: {fixed:?}"
        );
        assert!(
            env.driver.drift(&plan).await.unwrap().is_empty(),
            "{edit:?}"
        );
        for _ in 0..3 {
            let again = env.driver.apply(&plan).await.unwrap();
            assert!(again.is_empty(), "{edit:?}: re-applied in sync: {again:?}");
        }
        reaches(&guest, &format!("after repairing {edit:?}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn every_hand_edit_of_the_host_table_is_seen_and_repaired_by_one_host_repair() {
    let env = Env::new();
    let plan = nat_vm(&env, 0x34);
    env.driver.apply(&plan).await.unwrap();
    let _echo = env.sb.start_echo().unwrap();
    let guest = env.guest("h", &plan, &[], 1380);
    reaches(&guest, "before");
    let table = format!("{}_host", env.settings.name_prefix);
    let target = Target {
        netns: env.sb.host(),
        family: "ip".into(),
        table: table.clone(),
        chain: "postrouting".into(),
        changed_rule: "ip saddr 10.200.0.0/14 ip daddr 192.0.2.0/24 masquerade".into(),
        policy_chain: "postrouting".into(),
    };
    assert!(
        env.driver.repair_host().await.unwrap().is_empty(),
        "in sync"
    );
    for edit in Edit::ALL {
        target.apply(edit).unwrap();
        if edit == Edit::RuleChanged {
            assert!(
                cut_off(&guest),
                "the changed rule masquerades nothing we send"
            );
        }
        let drift = env.driver.drift(&plan).await.unwrap();
        assert!(
            drift
                .iter()
                .any(|c| matches!(c, Change::Repair { what } if what.contains(&table))),
            "{edit:?}: {drift:?}"
        );
        let fixed = env.driver.repair_host().await.unwrap();
        assert!(
            matches!(fixed.as_slice(), [Change::Repair { .. }]),
            "{edit:?}: {fixed:?}"
        );
        assert!(
            env.driver.drift(&plan).await.unwrap().is_empty(),
            "{edit:?}"
        );
        for _ in 0..3 {
            let again = env.driver.repair_host().await.unwrap();
            assert!(again.is_empty(), "{edit:?}: re-applied in sync: {again:?}");
        }
        reaches(&guest, &format!("after repairing {edit:?}"));
    }
    // The last VM gone, gc removes the host table, and later reconcile passes leave the empty
    // host alone (a table made on every pass only to be removed again was a found defect).
    drop(guest);
    env.driver.remove(plan.user_id).await.unwrap();
    env.driver.gc(&[]).await.unwrap();
    let list = || vmnet_testkit::nft::nft(&env.sb.host(), &["list", "tables"]).unwrap();
    assert!(!list().contains(&table), "gc removed the host table");
    for _ in 0..2 {
        assert!(env.driver.repair_host().await.unwrap().is_empty());
        assert!(!list().contains(&table), "an idle host stays without it");
    }
    env.driver.apply(&plan).await.unwrap();
    assert!(list().contains(&table), "the next VM brings it back");
}
