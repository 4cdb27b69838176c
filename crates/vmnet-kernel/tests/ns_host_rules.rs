//! The host rules of VMs (`iif <host veth> lookup <table>`) are read from memory kept by the
//! kernel's rule notifications, not dumped per VM (root required). Each change made by hand with
//! `ip rule` between two applies is seen by the next one, as a dump would see it: a deleted rule
//! is drift and is put back, a stray rule on a VM's host veth is removed, and a driver started
//! later (an agent restart) reads the rules that already exist.

mod ns_support;

use ns_support::{Env, vm_json};
use vmnet_kernel::ns::{Change, NetlinkNsDriver, NsDriver};
use vmnet_plan::ns::VmPlan;

const GW: u32 = 41;
const VM: u32 = 42;

/// The sandbox host's IPv6 rules on `plan`'s host veth, as `ip -6 rule` prints them.
fn rules_of(env: &Env, plan: &VmPlan) -> Vec<String> {
    let host_veth = &plan.veth.as_ref().expect("veth").host_name;
    env.host_ip(&["-6", "rule", "show"])
        .lines()
        .filter(|l| l.contains(&format!("iif {host_veth} ")))
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn rules_changed_by_hand_are_seen_by_the_next_apply() {
    let env = Env::new();
    let gw = env.plan(&vm_json("gw", GW, Some("fdaa::41"), &[("::/0", "host")]));
    // A route via a mesh gateway gives the VM a host table and its rule.
    let plan = env.plan(&vm_json(
        "r",
        VM,
        Some("fdaa::42"),
        &[("::/0", "host"), ("2001:db8:ff::/48", "fdaa::41")],
    ));
    env.driver.apply(&gw).await.expect("apply gw");
    env.driver.apply(&plan).await.expect("apply");
    let made = rules_of(&env, &plan);
    assert_eq!(made.len(), 1, "one rule: {made:?}");
    assert!(env.driver.drift(&plan).await.expect("drift").is_empty());

    // Deleted by hand: the next read sees it gone, and the apply puts it back.
    let host_veth = plan.veth.as_ref().unwrap().host_name.clone();
    env.host_ip(&["-6", "rule", "del", "iif", &host_veth]);
    assert!(rules_of(&env, &plan).is_empty());
    let drift = env.driver.drift(&plan).await.expect("drift");
    assert!(!drift.is_empty(), "a deleted rule is drift");
    env.driver.apply(&plan).await.expect("repair");
    assert_eq!(rules_of(&env, &plan), made, "put back");
    assert!(env.driver.drift(&plan).await.expect("drift").is_empty());

    // A stray rule on the VM's host veth (another priority, another table) is removed.
    env.host_ip(&[
        "-6", "rule", "add", "iif", &host_veth, "lookup", "4242", "pref", "4242",
    ]);
    assert_eq!(rules_of(&env, &plan).len(), 2);
    assert!(!env.driver.drift(&plan).await.expect("drift").is_empty());
    env.driver.apply(&plan).await.expect("remove stray");
    assert_eq!(rules_of(&env, &plan), made, "only the planned rule is left");

    // A driver started now (an agent restart) reads the rules that exist: nothing to do.
    let again = NetlinkNsDriver::new(env.settings.clone(), Some(env.sb.host())).expect("driver");
    assert!(again.drift(&plan).await.expect("drift").is_empty());
    // ... and sees the changes the first driver makes.
    env.driver.remove(VM).await.expect("remove");
    assert!(rules_of(&env, &plan).is_empty(), "rule removed with the VM");
    let listed = again.observe().await.expect("observe");
    assert!(
        listed
            .iter()
            .all(|v| v.user_id != VM || v.host_rules.is_empty()),
        "the restarted driver sees the rule gone: {listed:?}"
    );
    let removed = again.remove(GW).await.expect("remove gw");
    assert!(removed.contains(&Change::RemoveVm { user_id: GW }));
}
