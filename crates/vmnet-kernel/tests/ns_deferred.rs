//! Namespace mode's deferred removal (root required). `remove_deferred` answers once the VM's
//! netns is unmounted and its host rules and host table are gone; the kernel destroys the veth
//! pair (and the routes through it) afterwards. A namespace someone keeps alive (here an open
//! handle, as a VMM still running inside it would) keeps its veth pair: re-creating the same VM
//! at once deletes that stale host end and works (real traffic), and garbage collection leaves
//! such a pair to the kernel for the grace period, then deletes it.

mod ns_support;

use std::fs::File;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use ns_support::{Env, T, link_info, vm_json};
use vmnet_kernel::netns;
use vmnet_kernel::ns::{Change, TEARDOWN_GRACE};
use vmnet_plan::ns::VmPlan;
use vmnet_testkit::sandbox::{ECHO_PORT, ECHO_V4, ECHO_V6, HOST_UPLINK_V4};
use vmnet_testkit::traffic;

const GW: u32 = 0x31;
const VM: u32 = 0x32;

/// Polls `done` every 20 ms for up to 3 s.
async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(3);
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within 3 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Everything of `plan` on the host side: host veth, host rule, host table, mesh route.
fn host_objects(env: &Env, plan: &VmPlan) -> Vec<String> {
    let v = plan.veth.as_ref().unwrap();
    let mut left = Vec::new();
    if link_info(&env.sb.host(), &v.host_name).is_some() {
        left.push(format!("link {}", v.host_name));
    }
    if env.host_ip(&["-6", "rule", "show"]).contains(&v.host_name) {
        left.push("rule".into());
    }
    for fam in [4, 6] {
        if !env.host_table(fam, plan.host_table).trim().is_empty() {
            left.push(format!("table v{fam}"));
        }
    }
    // (The host table holds IPv6 routes only; an IPv4 one would be left over.)
    if env.host_ip(&["-6", "route", "show"]).contains("fdaa::32 ") {
        left.push("mesh route".into());
    }
    left
}

/// A handle on the VM's netns: keeps the namespace alive after it is unmounted.
fn hold(plan: &VmPlan) -> File {
    File::open(netns::path(&plan.netns)).expect("open netns")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn deferred_removal_recreate_and_collection() {
    let env = Env::new();
    let _echo = env.sb.start_echo().expect("echo");
    let gw = env.plan(&vm_json("gw", GW, Some("fdaa::31"), &[("::/0", "host")]));
    // A mesh-via route gives the VM a host rule and a host table too.
    let plan = env.plan(&vm_json(
        "d",
        VM,
        Some("fdaa::32"),
        &[
            ("0.0.0.0/0", "host"),
            ("::/0", "host"),
            ("2001:db8:ff::/48", "fdaa::31"),
        ],
    ));
    env.driver.apply(&gw).await.expect("apply gw");
    env.driver.apply(&plan).await.expect("apply");
    assert_eq!(
        host_objects(&env, &plan),
        [
            format!("link {}", plan.veth.as_ref().unwrap().host_name),
            "rule".to_owned(),
            "table v6".to_owned(),
            "mesh route".to_owned()
        ],
        "all host objects made"
    );

    // Nobody holds the netns: the answer comes with the netns, rule and table gone, the kernel
    // takes the veth pair and the mesh route through it soon after.
    let removed = env.driver.remove_deferred(VM).await.expect("remove");
    assert_eq!(removed, vec![Change::RemoveVm { user_id: VM }]);
    assert!(!netns::exists(&plan.netns), "netns unmounted");
    let left = host_objects(&env, &plan);
    assert!(
        left.iter()
            .all(|o| o.starts_with("link") || o == "mesh route"),
        "only the kernel's part may be left: {left:?}"
    );
    eventually("the kernel's teardown", || {
        host_objects(&env, &plan).is_empty()
    })
    .await;
    assert!(env.driver.remove_deferred(VM).await.unwrap().is_empty());

    // A held namespace keeps its veth pair; an immediate re-create replaces the stale host end
    // and carries traffic.
    env.driver.apply(&plan).await.expect("apply again");
    let held = hold(&plan);
    env.driver.remove_deferred(VM).await.expect("remove held");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        host_objects(&env, &plan),
        [
            format!("link {}", plan.veth.as_ref().unwrap().host_name),
            "mesh route".to_owned()
        ],
        "the held netns keeps its pair"
    );
    assert_eq!(
        env.driver.gc(&[GW]).await.expect("gc"),
        Vec::<u32>::new(),
        "collection leaves a fresh deferred removal to the kernel"
    );
    env.driver
        .apply(&plan)
        .await
        .expect("re-create over the stale end");
    assert!(env.driver.drift(&plan).await.unwrap().is_empty(), "in sync");
    drop(held);
    let guest = env.guest("d", &plan, &["::/0"], 1500);
    let tcp = traffic::tcp_echo(
        guest.netns(),
        SocketAddr::new(IpAddr::V4(ECHO_V4), ECHO_PORT),
        T,
    )
    .expect("tcp v4 after re-create");
    assert_eq!(tcp.peer.ip(), IpAddr::V4(HOST_UPLINK_V4));
    traffic::tcp_echo(
        guest.netns(),
        SocketAddr::new(IpAddr::V6(ECHO_V6), ECHO_PORT),
        T,
    )
    .expect("tcp v6 after re-create");
    drop(guest);
    assert!(env.driver.gc(&[GW, VM]).await.expect("gc").is_empty());

    // A namespace held past the grace period: collection deletes its pair itself.
    let held = hold(&plan);
    env.driver
        .remove_deferred(VM)
        .await
        .expect("remove held again");
    tokio::time::sleep(TEARDOWN_GRACE + Duration::from_millis(200)).await;
    assert!(!host_objects(&env, &plan).is_empty(), "still held");
    assert_eq!(env.driver.gc(&[GW]).await.expect("gc"), [VM]);
    assert!(host_objects(&env, &plan).is_empty(), "collected");
    drop(held);
    assert!(
        env.driver.drift(&gw).await.unwrap().is_empty(),
        "gw untouched"
    );
}
