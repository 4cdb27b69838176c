//! Taps in the kernel: persistent, owned by the configured user and group, on the bridge as a
//! locked port with learning off; a tap that cannot be attached means the instance does not
//! start (no tap and no rules left behind).

mod pool_support;

use pool_support::{Lab, ping_ok, range};
use vmnet_kernel::tap::TapOwner;
use vmnet_model::error::chain;
use vmnet_model::nic::{IfName, NetworkPolicy};
use vmnet_plan::pool::nic::{Leases, instance_spec};
use vmnet_testkit::netns as tk;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn tap_is_persistent_owned_and_locked_on_the_bridge() {
    let mut lab = Lab::new("pg").await;
    lab.pool.taps.owner = TapOwner {
        uid: Some(4242),
        gid: Some(4343),
    };
    let br: IfName = "br0".parse().unwrap();
    let r = range();
    let inst = instance_spec(
        "inst-o",
        "alloc-o",
        &br,
        Leases::v4(Some(("10.0.0.4".parse().unwrap(), &r))),
        NetworkPolicy::Public,
        false,
    )
    .unwrap();
    lab.pool.start_instance(&inst).await.unwrap();
    let tap = inst.tap_names().unwrap()[0].to_string();
    let d = tk::ip(&lab.host, &["-d", "link", "show", "dev", &tap]).unwrap();
    assert!(d.contains("master br0"), "{d}");
    assert!(d.contains("state UP") || d.contains(",UP"), "{d}");
    assert!(d.contains("persist on"), "{d}");
    assert!(d.contains("user 4242") && d.contains("group 4343"), "{d}");
    assert!(d.contains("learning off"), "{d}");
    assert!(d.contains("locked on"), "{d}");
    let out = tk::exec(
        &lab.host,
        "bridge",
        &["fdb", "show", "dev", &tap],
        std::time::Duration::from_secs(5),
    )
    .unwrap();
    let fdb = String::from_utf8_lossy(&out.stdout);
    assert!(
        fdb.contains(&inst.nics[0].mac.to_string()) && fdb.contains("static"),
        "{fdb}"
    );
    // An agent restart: the rules are loaded again, the existing persistent tap is reused.
    lab.pool.firewall.remove_instance(&inst.id).unwrap();
    let again = lab.pool.start_instance(&inst).await.unwrap();
    assert_eq!(again, [vmnet_kernel::pool::tap::TapAction::Reused]);
    lab.pool.stop_instance(&inst).await.unwrap();
    assert!(!lab.link_exists(&tap));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn a_tap_that_cannot_be_attached_fails_the_instance() {
    let mut lab = Lab::new("ph").await;
    let missing: IfName = "br9".parse().unwrap();
    let r = range();
    let inst = instance_spec(
        "inst-x",
        "alloc-x",
        &missing,
        Leases::v4(Some(("10.0.0.5".parse().unwrap(), &r))),
        NetworkPolicy::Public,
        false,
    )
    .unwrap();
    let e = lab.pool.start_instance(&inst).await.unwrap_err();
    assert!(
        chain(&e).contains("instance inst-x") && chain(&e).contains("br9"),
        "{e}"
    );
    let tap = inst.tap_names().unwrap()[0].to_string();
    assert!(!lab.link_exists(&tap), "no tap left behind");
    assert!(!lab.nft_list().contains(&tap), "no rules left behind");
    assert!(lab.pool.firewall.desired().taps.is_empty());
    assert!(lab.pool.firewall.audit().unwrap().drift.is_empty());

    // A network that exists but is not a bridge: refused before a tap is made.
    let veth: IfName = vmnet_testkit::sandbox::HOST_UPLINK_IF.parse().unwrap();
    let inst = instance_spec(
        "inst-y",
        "alloc-y",
        &veth,
        Leases::v4(Some(("10.0.0.6".parse().unwrap(), &r))),
        NetworkPolicy::Public,
        false,
    )
    .unwrap();
    let e = lab.pool.start_instance(&inst).await.unwrap_err();
    assert!(
        chain(&e).contains("instance inst-y") && chain(&e).contains("is not a bridge"),
        "{e}"
    );
    let tap = inst.tap_names().unwrap()[0].to_string();
    assert!(!lab.link_exists(&tap), "no tap is left");
    assert!(!lab.nft_list().contains(&tap));
    assert!(lab.pool.firewall.audit().unwrap().drift.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn a_failed_start_never_removes_a_tap_that_existed_before() {
    let mut lab = Lab::new("pp").await;
    let a = lab
        .add("inst-a", "10.0.0.2", NetworkPolicy::Public, false)
        .await;
    let b = lab
        .add("inst-b", "10.0.0.3", NetworkPolicy::Public, false)
        .await;
    let (tap_a, ns_a) = (lab.guests[a].tap.clone(), lab.guests[a].ns.clone());
    let ip_b = std::net::IpAddr::V4(lab.guests[b].ip4);
    // The VMM (the relay) holds tap a open throughout.
    let guard = lab.pool.taps.guard.clone().unwrap();
    let intact = |lab: &Lab, what: &str| {
        assert!(lab.link_exists(&tap_a), "{what}: the tap is still there");
        assert!(lab.nft_list().contains(&tap_a), "{what}: its elements stay");
        assert!(
            guard.taps().iter().any(|t| t.as_str() == tap_a),
            "{what}: its guard entry stays"
        );
        assert!(
            ping_ok(&ns_a, ip_b),
            "{what}: the guest still has its network"
        );
    };
    // An agent restarted with a network that is not a bridge: ensuring the existing tap fails.
    let mut wrong = lab.guests[a].inst.clone();
    wrong.nics[0].network = Some(vmnet_testkit::sandbox::HOST_UPLINK_IF.parse().unwrap());
    let e = lab.pool.start_instance(&wrong).await.unwrap_err();
    assert!(chain(&e).contains("instance inst-a"), "{e}");
    intact(&lab, "elements held before");
    // The same with no elements held before the attempt (loaded by nobody yet).
    lab.pool.firewall.remove_instance("inst-a").unwrap();
    let e = lab.pool.start_instance(&wrong).await.unwrap_err();
    assert!(chain(&e).contains("is not a bridge"), "{e}");
    intact(&lab, "nothing held before");
    assert!(lab.pool.firewall.audit().unwrap().drift.is_empty());

    // A new two-NIC instance whose second tap fails: the first, made by this attempt, goes,
    // and with it the elements it loaded.
    let mut two = instance_spec(
        "inst-t",
        "alloc-t",
        &"br0".parse().unwrap(),
        Leases::v4(Some(("10.0.0.4".parse().unwrap(), &range()))),
        NetworkPolicy::Public,
        false,
    )
    .unwrap();
    let mut second = two.nics[0].clone();
    second.mac = vmnet_model::nic::MacAddr([0x02, 0, 0, 0, 0, 0x77]);
    second.network = Some("br9".parse().unwrap());
    second.addresses.clear();
    second.gateway = None;
    second.nameservers.clear();
    two.nics.push(second);
    let e = lab.pool.start_instance(&two).await.unwrap_err();
    assert!(chain(&e).contains("br9"), "{e}");
    for tap in two.tap_names().unwrap() {
        assert!(
            !lab.link_exists(tap.as_str()),
            "{tap} made by the attempt is gone"
        );
        assert!(
            !lab.nft_list().contains(tap.as_str()),
            "{tap}: no elements left"
        );
    }
    intact(&lab, "after another instance failed");
    assert!(lab.pool.firewall.audit().unwrap().drift.is_empty());
}
