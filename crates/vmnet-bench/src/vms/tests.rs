//! Unit tests of the VM benchmark's pure parts and, as root, of both setup methods.

use super::*;

#[test]
fn stats_median_and_p99() {
    let samples: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
    let s = stats(&samples);
    assert!((s.median - 50.5).abs() < 1e-9, "{s:?}");
    assert!((s.p99 - 99.0).abs() < 1e-9, "{s:?}");
    let s = stats(&[Duration::from_millis(3)]);
    assert!((s.median - 3.0).abs() < 1e-9 && (s.p99 - 3.0).abs() < 1e-9);
    assert_eq!(stats(&[]), Stats::default());
}

#[test]
fn shell_script_does_the_plans_work() {
    let settings = NsSettings {
        name_prefix: "bq".into(),
        ..NsSettings::default()
    };
    let plan = plan_vm(&vm_config(7).expect("cfg"), &settings).expect("plan");
    let cmds: Vec<String> = shell_setup(&plan, "hostns")
        .iter()
        .map(|c| c.join(" "))
        .collect();
    assert_eq!(cmds[0], "ip netns add bqn0007");
    assert!(
        cmds.contains(&"ip -n bqn0007 tuntap add dev bqt0007 mode tap".to_owned()),
        "{cmds:#?}"
    );
    assert!(
        cmds.contains(&"ip -n hostns link add bqh0007 address 06:01:00:00:00:07 mtu 1380 type veth peer name bqp0007 address 06:02:00:00:00:07 mtu 1380 netns bqn0007".to_owned()),
        "{cmds:#?}"
    );
    // Each side's permanent entry for the other end; no IPv6 address on the host end.
    for entry in [
        "ip -n bqn0007 -6 neigh replace fe80::1:7 lladdr 06:01:00:00:00:07 dev bqp0007 nud permanent",
        "ip -n hostns -6 neigh replace fe80::2 lladdr 06:02:00:00:00:07 dev bqh0007 nud permanent",
    ] {
        assert!(cmds.contains(&entry.to_owned()), "{entry}: {cmds:#?}");
    }
    assert!(
        !cmds.iter().any(|c| c.contains("addr add fe80::1:7")),
        "{cmds:#?}"
    );
    assert!(
        cmds.iter().any(|c| c
            .starts_with("ip -n bqn0007 -4 route replace 0.0.0.0/0 via 10.200.0.29 dev bqp0007")),
        "{cmds:#?}"
    );
    assert!(
        cmds.iter().any(|c| c
            .starts_with("ip -n hostns -6 route replace fdaa:1::7/128 via fe80::2 dev bqh0007")),
        "{cmds:#?}"
    );
    assert_eq!(
        cmds.last().map(String::as_str),
        Some("ip netns exec bqn0007 nft -j -f -")
    );
    let down: Vec<String> = shell_teardown(&plan, "hostns")
        .iter()
        .map(|c| c.join(" "))
        .collect();
    assert_eq!(
        down,
        vec!["ip -n hostns link del bqh0007", "ip netns del bqn0007"]
    );
    // The plan's routes are all expressible.
    assert!(
        plan.ns_routes
            .iter()
            .all(|r| shell::route_cmd("x", r).is_some())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn both_methods_set_up_and_tear_down_for_real() {
    vmnet_testkit::require_root();
    let sb = vmnet_sandbox::Sandbox::new("bt").expect("sandbox");
    let settings = NsSettings {
        name_prefix: sb.agent_prefix(),
        ..NsSettings::default()
    };
    let driver = Arc::new(NetlinkNsDriver::new(settings.clone(), Some(sb.host())).expect("driver"));
    let plans: Vec<VmPlan> = (1..=3)
        .map(|u| plan_vm(&vm_config(u).expect("cfg"), &settings).expect("plan"))
        .collect();
    let row = bench_netlink(&driver, &settings, 3, false, false)
        .await
        .expect("netlink");
    assert_eq!((row.setup.len(), row.teardown.len()), (3, 3));
    assert!(row.rss_kib.is_some_and(|k| k > 0));
    assert!(row.mapping.is_none());
    let public = bench_netlink(&driver, &settings, 3, true, true)
        .await
        .expect("netlink --public --firewall");
    let (add, remove) = public.mapping.as_ref().expect("mapping timed");
    let rounds = usize::try_from(public::MAPPING_ROUNDS).unwrap();
    assert_eq!((add.len(), remove.len()), (rounds, rounds));
    let (change, _, rewritten) = public.firewall.as_ref().expect("firewall timed");
    // Every change after the create is of the same shape: each one rule batch.
    assert_eq!(
        (
            change.times.len(),
            change.one.len(),
            change.batched,
            *rewritten
        ),
        (40, 40, 80, 0)
    );
    let text = render(&[public]);
    assert!(text.contains("one VM's public mapping at N=3"), "{text}");
    assert!(text.contains("firewall audit pass over 3 VMs"), "{text}");
    let host = sb.host();
    let row = tokio::task::spawn_blocking(move || bench_shell(&plans, &host))
        .await
        .expect("join")
        .expect("shell");
    assert_eq!((row.setup.len(), row.teardown.len()), (3, 3));
    // Both methods removed what they made: only the sandbox's own namespaces remain.
    let left = vmnet_sandbox::netns::list(sb.prefix());
    assert_eq!(left, vec![sb.host(), sb.inet()], "{left:?}");
    let text = render(&[row]);
    assert!(text.contains("shell"), "{text}");
}
