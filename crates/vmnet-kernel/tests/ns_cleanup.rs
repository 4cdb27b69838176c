//! Namespace mode removal on a real kernel (root required): delete leaves nothing of the VM
//! behind, and the collector removes orphans while keeping every desired VM.

mod ns_support;

use ns_support::{Env, link_info, nft_ruleset, vm_json};
use vmnet_kernel::ns::Change;
use vmnet_testkit::netns;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn delete_removes_exactly_everything() {
    let env = Env::new();
    let keep = env.plan(&vm_json(
        "keep",
        0x31,
        Some("fdaa::31"),
        &[("::/0", "host")],
    ));
    let gone = env.plan(&vm_json(
        "gone",
        0x32,
        Some("fdaa::32"),
        &[("0.0.0.0/0", "host"), ("2000::/3", "fdaa::31")],
    ));
    env.driver.apply(&keep).await.unwrap();
    env.driver.apply(&gone).await.unwrap();
    let v = gone.veth.clone().unwrap();
    assert!(env.host_ip(&["-6", "rule", "show"]).contains(&v.host_name));

    let removed = env.driver.remove(gone.user_id).await.expect("remove");
    assert_eq!(removed, vec![Change::RemoveVm { user_id: 0x32 }]);
    assert!(!netns::exists(&gone.netns), "netns gone");
    assert!(
        link_info(&env.sb.host(), &v.host_name).is_none(),
        "host veth gone"
    );
    assert!(
        !env.host_ip(&["-6", "rule", "show"]).contains(&v.host_name),
        "rule gone"
    );
    assert_eq!(
        env.host_table(6, gone.host_table).trim(),
        "",
        "host table empty"
    );
    assert_eq!(
        env.host_table(4, gone.host_table).trim(),
        "",
        "host table empty"
    );
    let main6 = env.host_ip(&["-6", "route", "show"]);
    assert!(!main6.contains("fdaa::32"), "mesh route gone: {main6}");
    assert!(
        !env.host_ip(&["-4", "route", "show"])
            .contains("10.200.0.200"),
        "transit route gone"
    );
    // The other VM is untouched, and a second remove is a no-op.
    assert!(env.driver.drift(&keep).await.unwrap().is_empty());
    assert!(env.driver.remove(gone.user_id).await.unwrap().is_empty());
    let seen: Vec<u32> = env
        .driver
        .observe()
        .await
        .unwrap()
        .iter()
        .map(|o| o.user_id)
        .collect();
    assert_eq!(seen, vec![0x31]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn gc_collects_orphans_and_keeps_desired_vms() {
    let env = Env::new();
    let plans: Vec<_> = (0x41..0x44)
        .map(|u| {
            env.plan(&vm_json(
                &format!("v{u}"),
                u,
                Some(&format!("fdaa::{u:x}")),
                &[("0.0.0.0/0", "host")],
            ))
        })
        .collect();
    for p in &plans {
        env.driver.apply(p).await.unwrap();
    }
    // A stray rule and table route of a VM that no longer exists (e.g. left by a crash).
    let stray = env.settings.host_table_base + 0x99;
    let stray_if = format!("{}h0099", env.settings.name_prefix);
    env.host_ip(&[
        "-6",
        "rule",
        "add",
        "iif",
        &stray_if,
        "lookup",
        &stray.to_string(),
        "pref",
        "10000",
    ]);
    env.host_ip(&[
        "-6",
        "route",
        "add",
        "throw",
        "fdaa::/16",
        "table",
        &stray.to_string(),
    ]);

    let mut removed = env.driver.gc(&[plans[0].user_id]).await.expect("gc");
    removed.sort_unstable();
    assert_eq!(removed, vec![0x42, 0x43, 0x99]);
    let seen: Vec<u32> = env
        .driver
        .observe()
        .await
        .unwrap()
        .iter()
        .map(|o| o.user_id)
        .collect();
    assert_eq!(seen, vec![0x41]);
    assert!(!env.host_ip(&["-6", "rule", "show"]).contains(&stray_if));
    assert!(
        env.driver.drift(&plans[0]).await.unwrap().is_empty(),
        "desired VM untouched"
    );

    // With nothing desired, everything of ours goes, host masquerade table included.
    assert_eq!(env.driver.gc(&[]).await.unwrap(), vec![0x41]);
    assert!(env.driver.observe().await.unwrap().is_empty());
    assert!(!nft_ruleset(&env.sb.host()).contains(&format!("{}_host", env.settings.name_prefix)));
}
