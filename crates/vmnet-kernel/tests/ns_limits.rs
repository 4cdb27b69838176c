//! Namespace-mode throughput limits on a real kernel (root required): the HTB trees written over
//! netlink, read back by `tc` and compared, repaired in place, changed as class changes, removed;
//! the public limit waiting for a public path (a route via host); no tc objects left over by create/delete
//! cycles. The traffic measurements (iperf3) are in `ns_limits_traffic.rs`.

mod ns_support;

use ns_support::{Env, T, vm_json};
use vmnet_kernel::ns::Change;
use vmnet_testkit::netns;

/// `tc ARGS` inside `ns`, stdout.
fn tc(ns: &str, args: &[&str]) -> String {
    let out = netns::exec(ns, "tc", args, T).expect("tc");
    assert!(
        out.status.success(),
        "tc {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A VM config with limits.
fn limited(uid: u32, private: u32, public: u32, via_host: bool) -> String {
    let mesh = format!("fdaa::{uid:x}");
    let routes: &[(&str, &str)] = if via_host {
        &[("0.0.0.0/0", "host"), ("::/0", "host")]
    } else {
        // No route via host: no public path (IPv4 or IPv6).
        &[]
    };
    let base = vm_json(&format!("vm{uid}"), uid, Some(&mesh), routes);
    format!(
        "{},\"private_network_throughput_mibps\":{private},\"public_network_throughput_mibps\":{public}}}",
        base.strip_suffix('}').unwrap()
    )
}

/// (qdiscs, classes, filter lines) of `dev` in `ns`.
fn counts(ns: &str, dev: &str) -> (usize, usize, usize) {
    let q = tc(ns, &["qdisc", "show", "dev", dev]).lines().count();
    let c = tc(ns, &["class", "show", "dev", dev]).lines().count();
    let f = tc(ns, &["filter", "show", "dev", dev])
        .lines()
        .filter(|l| l.contains("flowid"))
        .count();
    (q, c, f)
}

fn tc_changes(c: &[Change]) -> Vec<String> {
    c.iter()
        .filter(|c| matches!(c, Change::Tc { .. }))
        .map(ToString::to_string)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn limits_are_written_read_back_changed_in_place_and_removed() {
    let env = Env::new();
    let plan = env.plan(&limited(0x41, 20, 2, true));
    env.driver.apply(&plan).await.expect("create");
    let peer = plan.veth.as_ref().unwrap().peer_name.clone();
    let tap = plan.tap.name.clone();
    for dev in [&tap, &peer] {
        let q = tc(&plan.netns, &["-d", "qdisc", "show", "dev", dev]);
        assert!(
            q.contains("qdisc htb 1: root") && q.contains("default 0"),
            "{q}"
        );
        assert!(
            q.contains("overhead -14"),
            "size table counts IP bytes: {q}"
        );
        let c = tc(&plan.netns, &["class", "show", "dev", dev]);
        assert!(
            c.contains("class htb 1:10 root") && c.contains("rate 167772Kbit ceil 167772Kbit"),
            "{c}"
        );
        assert!(
            c.contains("class htb 1:20 root") && c.contains("rate 16777Kbit ceil 16777Kbit"),
            "{c}"
        );
        let f = tc(&plan.netns, &["filter", "show", "dev", dev]);
        assert_eq!(f.matches("flowid 1:10").count(), 5, "{f}");
        assert_eq!(f.matches("flowid 1:20").count(), 2, "{f}");
        assert_eq!(
            f.matches("flowid 1: ").count() + f.matches("flowid 1:\n").count(),
            3,
            "{f}"
        );
    }
    // By source on the tap, by destination on the veth end: 10.0.0.0/8 = 0a000000/ff000000.
    let f = tc(&plan.netns, &["filter", "show", "dev", &tap]);
    assert!(f.contains("match 0a000000/ff000000 at 12"), "{f}");
    let f = tc(&plan.netns, &["filter", "show", "dev", &peer]);
    assert!(f.contains("match 0a000000/ff000000 at 16"), "{f}");
    assert!(f.contains("match fdaa0000/ffff0000 at 24"), "{f}");

    let again = env.driver.apply(&plan).await.expect("apply again");
    assert!(again.is_empty(), "second apply changed {again:?}");
    assert!(env.driver.drift(&plan).await.unwrap().is_empty());

    // A limit change is one class change per device, nothing else.
    let changed = env.plan(&limited(0x41, 20, 5, true));
    let changes = tc_changes(&env.driver.apply(&changed).await.expect("change"));
    assert_eq!(
        changes,
        [
            format!("vm: tc {tap}: change class Public 2.00 MiB/s -> 5.00 MiB/s"),
            format!("vm: tc {peer}: change class Public 2.00 MiB/s -> 5.00 MiB/s"),
        ]
    );
    let c = tc(&plan.netns, &["class", "show", "dev", &peer]);
    assert!(c.contains("rate 41943Kbit"), "{c}");

    // Hand edits are found by content and repaired in place.
    tc(
        &plan.netns,
        &[
            "class", "change", "dev", &tap, "parent", "1:", "classid", "1:10", "htb", "rate",
            "1mbit",
        ],
    );
    tc(
        &plan.netns,
        &[
            "filter", "del", "dev", &peer, "parent", "1:", "prio", "20", "protocol", "ipv6", "u32",
        ],
    );
    tc(
        &plan.netns,
        &[
            "class", "add", "dev", &peer, "parent", "1:", "classid", "1:99", "htb", "rate", "1mbit",
        ],
    );
    let drift: Vec<String> = tc_changes(&env.driver.drift(&changed).await.unwrap());
    // The class change, four IPv6 nodes, the stray class.
    assert_eq!(drift.len(), 6, "{drift:?}");
    let fixed = tc_changes(&env.driver.apply(&changed).await.expect("repair"));
    assert_eq!(fixed, drift);
    assert!(env.driver.apply(&changed).await.unwrap().is_empty());
    assert!(!tc(&plan.netns, &["class", "show", "dev", &peer]).contains("1:99"));
    // The root replaced by another qdisc: the whole tree is written again.
    tc(
        &plan.netns,
        &["qdisc", "replace", "dev", &tap, "root", "pfifo"],
    );
    let fixed = tc_changes(&env.driver.apply(&changed).await.expect("repair root"));
    assert!(
        fixed.iter().any(|c| c.contains("add htb root")),
        "{fixed:?}"
    );
    assert!(env.driver.drift(&changed).await.unwrap().is_empty());

    // Both limits 0: the trees go, the devices are back to the kernel's default.
    let none = env.plan(&limited(0x41, 0, 0, true));
    let changes = tc_changes(&env.driver.apply(&none).await.expect("unlimit"));
    assert_eq!(changes.len(), 2, "{changes:?}");
    for dev in [&tap, &peer] {
        assert!(!tc(&plan.netns, &["qdisc", "show", "dev", dev]).contains("htb"));
        assert_eq!(counts(&plan.netns, dev).1, 0);
    }
    assert!(env.driver.apply(&none).await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn public_limit_is_kept_until_a_route_via_host_exists() {
    let env = Env::new();
    let plan = env.plan(&limited(0x42, 0, 7, false));
    assert!(!plan.limits.public_applied);
    env.driver.apply(&plan).await.expect("create");
    assert!(!tc(&plan.netns, &["qdisc", "show", "dev", &plan.tap.name]).contains("htb"));
    let counters = env.driver.limit_counters(&plan).await.unwrap();
    assert_eq!(counters.len(), 4);
    assert!(counters.iter().all(|c| !c.applied));
    assert!(counters.iter().any(|c| c.limit_mibps == 7));
    // The route arrives: the stored limit applies in that pass.
    let routed = env.plan(&limited(0x42, 0, 7, true));
    env.driver.apply(&routed).await.expect("route added");
    let c = tc(&plan.netns, &["class", "show", "dev", &plan.tap.name]);
    assert!(
        c.contains("class htb 1:20") && c.contains("rate 58720Kbit"),
        "{c}"
    );
    let counters = env.driver.limit_counters(&routed).await.unwrap();
    let public: Vec<_> = counters.iter().filter(|c| c.applied).collect();
    assert_eq!(public.len(), 2, "{counters:?}");
    // And goes back to stored-only when the route goes.
    env.driver.apply(&plan).await.expect("route removed");
    assert!(!tc(&plan.netns, &["qdisc", "show", "dev", &plan.tap.name]).contains("htb"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn create_delete_cycles_leave_exactly_what_live_vms_need() {
    let env = Env::new();
    let live: Vec<_> = (0..3u32)
        .map(|i| env.plan(&limited(0x100 + i, 10 + i, 5, true)))
        .collect();
    for p in &live {
        env.driver.apply(p).await.expect("live vm");
    }
    let per_vm = {
        let p = &live[0];
        let peer = &p.veth.as_ref().unwrap().peer_name;
        (counts(&p.netns, &p.tap.name), counts(&p.netns, peer))
    };
    // Per device: the htb root (its leaf qdiscs are the kernel's invisible defaults), 2 classes,
    // 10 u32 nodes.
    assert_eq!(per_vm, ((1, 2, 10), (1, 2, 10)));
    for cycle in 0..100u32 {
        let p = env.plan(&limited(
            0x200 + cycle % 7,
            1 + cycle % 50,
            cycle % 3,
            cycle % 2 == 0,
        ));
        env.driver.apply(&p).await.expect("create");
        if cycle % 4 == 0 {
            let changed = env.plan(&limited(0x200 + cycle % 7, 2 + cycle % 50, 1, true));
            env.driver.apply(&changed).await.expect("change");
        }
        env.driver.remove(p.user_id).await.expect("remove");
        assert!(!netns::exists(&p.netns));
    }
    for p in &live {
        let peer = &p.veth.as_ref().unwrap().peer_name;
        assert_eq!(
            (counts(&p.netns, &p.tap.name), counts(&p.netns, peer)),
            per_vm
        );
        assert!(env.driver.drift(p).await.unwrap().is_empty());
    }
    let vm_netns: Vec<_> = netns::list(&env.settings.name_prefix)
        .into_iter()
        .filter(|n| {
            vmnet_plan::ns::parse_uid(
                &env.settings.name_prefix,
                vmnet_plan::ns::NameKind::Netns,
                n,
            )
            .is_some()
        })
        .collect();
    assert_eq!(vm_netns.len(), live.len(), "{vm_netns:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn apply_limits_changes_classes_in_place_or_falls_back_to_a_full_apply() {
    let env = Env::new();
    // No limit in force yet: nothing to change in place, so a full apply adds the trees.
    let none = env.plan(&limited(0x43, 0, 0, true));
    env.driver.apply(&none).await.expect("create");
    let first = env.plan(&limited(0x43, 30, 3, true));
    let changes = env.driver.apply_limits(&first).await.expect("first limit");
    assert!(
        changes
            .iter()
            .any(|c| c.to_string().contains("add htb root")),
        "{changes:?}"
    );
    assert!(env.driver.drift(&first).await.unwrap().is_empty());
    // A change: the four classes written in place, nothing else; the result reads back as planned.
    let second = env.plan(&limited(0x43, 30, 4, true));
    let changes = tc_changes(&env.driver.apply_limits(&second).await.expect("change"));
    assert_eq!(changes.len(), 4, "{changes:?}");
    assert!(env.driver.drift(&second).await.unwrap().is_empty());
    let c = tc(&second.netns, &["class", "show", "dev", &second.tap.name]);
    assert!(c.contains("rate 33554Kbit"), "{c}");
    // The last limit removed: a full apply deletes the trees.
    env.driver.apply_limits(&none).await.expect("unlimit");
    assert!(!tc(&none.netns, &["qdisc", "show", "dev", &none.tap.name]).contains("htb"));
    assert!(env.driver.drift(&none).await.unwrap().is_empty());
}
