//! Taps in the kernel: persistent, owned by the configured user and group, on the bridge as a
//! locked port with learning off; a tap that cannot be attached means the instance does not
//! start (no tap and no rules left behind).

mod pool_support;

use pool_support::{Lab, range};
use vmnet_kernel::pool::tap::TapOwner;
use vmnet_model::nic::{IfName, NetworkPolicy};
use vmnet_plan::pool::nic::instance_spec;
use vmnet_testkit::netns as tk;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tap_is_persistent_owned_and_locked_on_the_bridge() {
    let mut lab = Lab::new("pg").await;
    lab.pool.owner = TapOwner {
        uid: Some(4242),
        gid: Some(4343),
    };
    let br: IfName = "br0".parse().unwrap();
    let r = range();
    let inst = instance_spec(
        "inst-o",
        "alloc-o",
        &br,
        Some(("10.0.0.4".parse().unwrap(), &r)),
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
async fn a_tap_that_cannot_be_attached_fails_the_instance() {
    let mut lab = Lab::new("ph").await;
    let missing: IfName = "br9".parse().unwrap();
    let r = range();
    let inst = instance_spec(
        "inst-x",
        "alloc-x",
        &missing,
        Some(("10.0.0.5".parse().unwrap(), &r)),
        NetworkPolicy::Public,
        false,
    )
    .unwrap();
    let e = lab.pool.start_instance(&inst).await.unwrap_err().to_error();
    assert!(
        e.message.contains("instance inst-x") && e.message.contains("br9"),
        "{e}"
    );
    let tap = inst.tap_names().unwrap()[0].to_string();
    assert!(!lab.link_exists(&tap), "no tap left behind");
    assert!(!lab.nft_list().contains(&tap), "no rules left behind");
    assert!(lab.pool.firewall.desired().taps.is_empty());
    assert!(lab.pool.firewall.audit().unwrap().drift.is_empty());

    // A network that exists but is not a bridge: the tap is made, attaching fails, the tap goes.
    let veth: IfName = vmnet_testkit::sandbox::HOST_UPLINK_IF.parse().unwrap();
    let inst = instance_spec(
        "inst-y",
        "alloc-y",
        &veth,
        Some(("10.0.0.6".parse().unwrap(), &r)),
        NetworkPolicy::Public,
        false,
    )
    .unwrap();
    let e = lab.pool.start_instance(&inst).await.unwrap_err().to_error();
    assert!(
        e.message.contains("instance inst-y") && e.message.contains("attach"),
        "{e}"
    );
    let tap = inst.tap_names().unwrap()[0].to_string();
    assert!(
        !lab.link_exists(&tap),
        "the tap made for it is deleted again"
    );
    assert!(!lab.nft_list().contains(&tap));
    assert!(lab.pool.firewall.audit().unwrap().drift.is_empty());
}
