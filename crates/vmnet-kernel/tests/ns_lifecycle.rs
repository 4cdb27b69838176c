//! Namespace mode lifecycle on a real kernel (root required): apply twice is a no-op, a route
//! change keeps the veth (same ifindex), a mesh address change converges in place, a failed
//! apply keeps the previous good state, a VM without a mesh address has no veth pair, applies of
//! different VMs (new or in place) run concurrently. Removal is in `ns_cleanup.rs`, drift in `ns_repair.rs`.

mod ns_support;

use std::net::{IpAddr, SocketAddr};

use ns_support::{Env, T, link_info, nft_ruleset, v6, vm_json};
use vmnet_kernel::ns::Change;
use vmnet_testkit::echo::EchoService;
use vmnet_testkit::sandbox::{ECHO_PORT, ECHO_V4};
use vmnet_testkit::{netns, traffic};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn apply_twice_is_a_noop_and_a_route_change_keeps_the_veth() {
    let env = Env::new();
    let plan = env.plan(&vm_json("a", 0x21, Some("fdaa::21"), &[("::/0", "host")]));
    let first = env.driver.apply(&plan).await.expect("apply");
    assert!(
        matches!(first.as_slice(), [Change::CreateVm { .. }]),
        "{first:?}"
    );
    let again = env.driver.apply(&plan).await.expect("apply again");
    assert!(again.is_empty(), "second apply changed {again:?}");
    assert!(env.driver.drift(&plan).await.unwrap().is_empty());

    let v = plan.veth.clone().unwrap();
    let (_, host_index) = link_info(&env.sb.host(), &v.host_name).unwrap();
    let (_, peer_index) = link_info(&plan.netns, &v.peer_name).unwrap();
    assert_eq!(
        (host_index, peer_index),
        (0x3000_0021, 0x3800_0021),
        "derived ifindexes"
    );
    assert!(!nft_ruleset(&plan.netns).contains("snat"));

    // Add IPv4 via host and a gateway route: NAT appears, the VM gets its host table, veth stays.
    let _gwvm = env.plan(&vm_json("gw", 0x22, Some("fdaa::22"), &[("::/0", "host")]));
    env.driver.apply(&_gwvm).await.expect("gateway vm");
    let changed = env.plan(&vm_json(
        "a",
        0x21,
        Some("fdaa::21"),
        &[
            ("0.0.0.0/0", "host"),
            ("::/0", "host"),
            ("2000::/3", "fdaa::22"),
        ],
    ));
    let changes = env.driver.apply(&changed).await.expect("apply change");
    assert!(
        changes
            .iter()
            .any(|c| matches!(c, Change::ReplaceNft { .. })),
        "{changes:?}"
    );
    assert!(
        changes.iter().any(|c| matches!(c, Change::AddRule(..))),
        "{changes:?}"
    );
    assert!(
        !changes
            .iter()
            .any(|c| matches!(c, Change::CreateVm { .. } | Change::Repair { .. })),
        "{changes:?}"
    );
    assert_eq!(
        link_info(&env.sb.host(), &v.host_name).unwrap().1,
        host_index,
        "host veth kept"
    );
    assert_eq!(
        link_info(&plan.netns, &v.peer_name).unwrap().1,
        peer_index,
        "peer veth kept"
    );
    assert!(nft_ruleset(&plan.netns).contains("snat ip to"));
    let table = env.host_table(6, changed.host_table);
    assert!(
        table.contains("2000::/3 via fe80::2 dev") && table.contains("throw default"),
        "{table}"
    );
    assert!(
        env.driver.apply(&changed).await.unwrap().is_empty(),
        "converged"
    );

    // The gateway VM goes away: its veth (and the kernel's route through it) disappear, and the
    // client's 2000::/3 stays unreachable rather than falling through to the uplink.
    env.driver.remove(0x22).await.unwrap();
    let get = std::process::Command::new("ip")
        .args([
            "-n",
            &env.sb.host(),
            "-6",
            "route",
            "get",
            "2001:db8::1",
            "from",
            "fdaa::21",
            "iif",
            &v.host_name,
        ])
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&get.stdout),
        String::from_utf8_lossy(&get.stderr)
    );
    assert!(
        !said.contains("uplink"),
        "must not leave through the uplink: {said}"
    );
    assert!(
        said.contains("No route to host") || said.contains("unreachable"),
        "{said}"
    );
    let drift = env.driver.drift(&changed).await.unwrap();
    assert!(!drift.is_empty(), "the lost gateway shows as drift");
    env.driver.apply(&changed).await.unwrap();
    assert!(env.driver.drift(&changed).await.unwrap().is_empty());

    // And back: the table and rule go, NAT goes.
    let changes = env.driver.apply(&plan).await.expect("apply back");
    assert!(
        changes.iter().any(|c| matches!(c, Change::DelRule(..))),
        "{changes:?}"
    );
    assert!(!nft_ruleset(&plan.netns).contains("snat"));
    assert!(
        env.host_ip(&["-6", "rule", "show"])
            .lines()
            .all(|l| !l.contains(&v.host_name))
    );
    assert_eq!(
        link_info(&env.sb.host(), &v.host_name).unwrap().1,
        host_index
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn a_mesh_address_change_converges_in_place() {
    let env = Env::new();
    let peer = env.plan(&vm_json("mp", 0x41, Some("fdaa:4::41"), &[]));
    let old = env.plan(&vm_json("mc", 0x42, Some("fdaa:4::1"), &[("::/0", "host")]));
    env.driver.apply(&peer).await.expect("apply peer");
    env.driver.apply(&old).await.expect("apply old mesh");
    let v = old.veth.clone().unwrap();
    let host_index = link_info(&env.sb.host(), &v.host_name).unwrap().1;
    let peer_index = link_info(&old.netns, &v.peer_name).unwrap().1;
    let tap_index = link_info(&old.netns, &old.tap.name).unwrap().1;

    let new = env.plan(&vm_json("mc", 0x42, Some("fdaa:4::2"), &[("::/0", "host")]));
    let changes = env
        .driver
        .apply(&new)
        .await
        .expect("change the mesh address");
    assert!(
        !changes
            .iter()
            .any(|c| matches!(c, Change::CreateVm { .. } | Change::Repair { .. })),
        "converged in place, not rebuilt: {changes:?}"
    );
    assert_eq!(
        (
            link_info(&env.sb.host(), &v.host_name).unwrap().1,
            link_info(&new.netns, &v.peer_name).unwrap().1,
            link_info(&new.netns, &new.tap.name).unwrap().1,
        ),
        (host_index, peer_index, tap_index),
        "veth and tap kept"
    );
    assert!(
        env.driver.apply(&new).await.unwrap().is_empty(),
        "converged"
    );
    assert!(env.driver.drift(&new).await.unwrap().is_empty());

    // The routes: the new address everywhere, the old one nowhere.
    let host6 = env.host_ip(&["-6", "route", "show"]);
    assert!(
        host6
            .lines()
            .any(|l| l.starts_with("fdaa:4::2 ") && l.contains(&v.host_name)),
        "{host6}"
    );
    assert!(
        !host6.contains("fdaa:4::1 "),
        "old host route gone: {host6}"
    );
    let ns6 = netns::ip(&new.netns, &["-6", "route", "show", "table", "all"]).unwrap();
    assert!(
        ns6.lines()
            .any(|l| l.starts_with("fdaa:4::2 dev ") && l.contains(&new.tap.name)),
        "{ns6}"
    );
    assert!(
        ns6.lines()
            .any(|l| l.starts_with("default via fdaa:4::2 dev ")
                && l.contains("table 100")
                && l.contains("onlink")),
        "{ns6}"
    );
    assert!(!ns6.contains("fdaa:4::1"), "old netns routes gone: {ns6}");

    // Real packets: the peer's guest reaches the guest on its new mesh address, not the old one.
    let g_peer = env.guest("mp", &peer, &["fdaa::/16"], 1380);
    let g_new = env.guest("mc", &new, &["::/0"], 1380);
    let svc = EchoService::start(
        g_new.netns(),
        &[SocketAddr::new(IpAddr::V6(v6("fdaa:4::2")), 7)],
    )
    .unwrap();
    let r = traffic::udp_echo(
        g_peer.netns(),
        SocketAddr::new(IpAddr::V6(v6("fdaa:4::2")), 7),
        T,
    )
    .expect("peer → new mesh address");
    assert_eq!(r.peer.ip(), IpAddr::V6(v6("fdaa:4::41")));
    let stale = traffic::try_udp_echo(
        g_peer.netns(),
        SocketAddr::new(IpAddr::V6(v6("fdaa:4::1")), 7),
        std::time::Duration::from_millis(500),
    )
    .unwrap();
    assert!(stale.is_none(), "the old mesh address answers: {stale:?}");
    drop(svc);

    // And back to the old address, in place again.
    let back = env.driver.apply(&old).await.expect("change back");
    assert!(
        !back
            .iter()
            .any(|c| matches!(c, Change::CreateVm { .. } | Change::Repair { .. })),
        "{back:?}"
    );
    assert_eq!(
        link_info(&env.sb.host(), &v.host_name).unwrap().1,
        host_index
    );
    let host6 = env.host_ip(&["-6", "route", "show"]);
    assert!(
        host6.contains("fdaa:4::1 ") && !host6.contains("fdaa:4::2 "),
        "{host6}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn failed_apply_keeps_the_previous_good_state() {
    let env = Env::new();
    let good = env.plan(&vm_json(
        "f",
        0x51,
        Some("fdaa::51"),
        &[("0.0.0.0/0", "host")],
    ));
    env.driver.apply(&good).await.unwrap();
    let _echo = env.sb.start_echo().unwrap();
    let guest = env.guest("f", &good, &["fdaa::/16"], 1380);
    let echo = SocketAddr::new(IpAddr::V4(ECHO_V4), ECHO_PORT);
    traffic::tcp_echo(guest.netns(), echo, T).expect("reachable before");

    // A new config whose nft transaction the kernel refuses (after the route changes were made).
    let mut bad = env.plan(&vm_json(
        "f",
        0x51,
        Some("fdaa::51"),
        &[("10.0.0.0/8", "host"), ("::/0", "host")],
    ));
    bad.nft["nftables"][3]["add"]["chain"]["hook"] = serde_json::json!("no-such-hook");
    bad.nft_fingerprint = "broken".into();
    let err = env.driver.apply(&bad).await.expect_err("must fail");
    assert!(err.to_string().contains("nft in"), "{err}");
    assert!(
        env.driver.drift(&good).await.unwrap().is_empty(),
        "previous state restored"
    );
    traffic::tcp_echo(guest.netns(), echo, T).expect("still reachable after the failed apply");

    // A failing create leaves nothing: the host veth name is taken by a foreign link.
    let other = env.plan(&vm_json("g", 0x52, Some("fdaa::52"), &[]));
    let taken = other.veth.as_ref().unwrap().host_name.clone();
    env.host_ip(&[
        "link", "add", &taken, "type", "veth", "peer", "name", "taken0",
    ]);
    env.driver.apply(&other).await.expect_err("name taken");
    assert!(!netns::exists(&other.netns), "partial create rolled back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn vm_without_mesh_has_tap_but_no_veth_and_its_own_sysctls() {
    let env = Env::with(|s| {
        s.tap_owner_uid = Some(4242);
        s.tap_owner_gid = Some(4243);
    });
    let plan = env.plan(&vm_json("capture", 0x61, None, &[]));
    env.driver.apply(&plan).await.unwrap();
    assert!(netns::exists(&plan.netns));
    let links = netns::ip(&plan.netns, &["-o", "link", "show"]).unwrap();
    assert!(links.contains(&plan.tap.name), "{links}");
    assert_eq!(links.lines().count(), 2, "only lo and the tap: {links}");
    let host_links = env.host_ip(&["-o", "link", "show"]);
    assert!(
        !host_links.contains(&format!("{}h0061", env.settings.name_prefix)),
        "{host_links}"
    );
    assert!(env.driver.apply(&plan).await.unwrap().is_empty());
    // The tap is persistent, owned as configured (`ip netns exec` mounts the netns's sysfs).
    let sys = |f: &str| {
        let out = netns::exec(
            &plan.netns,
            "cat",
            &[&format!("/sys/class/net/{}/{f}", plan.tap.name)],
            T,
        )
        .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    assert_eq!(sys("owner"), "4242");
    assert_eq!(sys("group"), "4243");
    // Forwarding is on inside the VM netns only: another fresh namespace still has it off.
    assert_eq!(
        netns::sysctl_get(&plan.netns, "net/ipv4/ip_forward").unwrap(),
        "1"
    );
    assert_eq!(
        netns::sysctl_get(&plan.netns, "net/ipv6/conf/all/forwarding").unwrap(),
        "1"
    );
    let probe = env.sb.add_netns("probe").unwrap();
    assert_eq!(
        netns::sysctl_get(&probe, "net/ipv4/ip_forward").unwrap(),
        "0"
    );
    assert_eq!(
        netns::sysctl_get(&probe, "net/ipv6/conf/all/forwarding").unwrap(),
        "0"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn concurrent_applies_of_different_vms() {
    let env = Env::new();
    let plans: Vec<_> = (0x81..0x8b)
        .map(|u| {
            let mesh = format!("fdaa::{u:x}");
            let routes: &[(&str, &str)] = if u == 0x81 {
                &[("0.0.0.0/0", "host"), ("::/0", "host")]
            } else {
                &[("0.0.0.0/0", "host"), ("2000::/3", "fdaa::81")]
            };
            env.plan(&vm_json(&format!("c{u}"), u, Some(&mesh), routes))
        })
        .collect();
    let results = futures::future::join_all(plans.iter().map(|p| env.driver.apply(p))).await;
    for r in results {
        r.expect("concurrent apply");
    }
    // Gateway routes resolved while the gateway VM was being created may be unreachable; one
    // more pass (what the agent's reconcile does) converges everything.
    for p in &plans {
        env.driver.apply(p).await.unwrap();
    }
    for p in &plans {
        assert!(env.driver.drift(p).await.unwrap().is_empty(), "{}", p.vm_id);
    }
    assert_eq!(env.driver.observe().await.unwrap().len(), plans.len());
    // Applies of VMs in place at once (what a reconcile pass runs): each observes its host side
    // over the driver's one host socket, which runs one dump at a time.
    for round in 0..5 {
        let again = futures::future::join_all(plans.iter().map(|p| env.driver.apply(p))).await;
        for (p, r) in plans.iter().zip(again) {
            let changes = r.unwrap_or_else(|e| panic!("round {round}, {}: {e}", p.vm_id));
            assert!(
                changes.is_empty(),
                "round {round}, {}: {changes:?}",
                p.vm_id
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root: builds network namespaces (scripts/test.sh runs it)"]
async fn a_taken_ifindex_falls_back_to_a_second_derived_pair_then_the_kernels() {
    let env = Env::new();
    let squat = |index: u32, name: &str| {
        let (index, peer) = (index.to_string(), format!("{name}p"));
        env.host_ip(&[
            "link", "add", name, "index", &index, "type", "veth", "peer", "name", &peer,
        ]);
    };
    // The first derived host index taken: the second pair, both ends derived.
    let plan = env.plan(&vm_json(
        "x",
        0x91,
        Some("fdaa::91"),
        &[("0.0.0.0/0", "host")],
    ));
    squat(0x3000_0000 + 0x91, "squat0");
    env.driver.apply(&plan).await.expect("apply");
    let v = plan.veth.as_ref().unwrap();
    let (_, index) = link_info(&env.sb.host(), &v.host_name).unwrap();
    let (_, peer_index) = link_info(&plan.netns, &v.peer_name).unwrap();
    assert_eq!(
        (index, peer_index),
        (0x3400_0000 + 0x91, 0x3c00_0000 + 0x91)
    );
    let drift = env.driver.drift(&plan).await.unwrap();
    assert!(drift.is_empty(), "{drift:?}");
    assert!(env.driver.apply(&plan).await.unwrap().is_empty());

    // Both derived host indexes taken: the kernel picks both (it takes the VM end's only with
    // the host end's); they still differ, so the kernel treats the pair as stacked.
    let plan = env.plan(&vm_json(
        "y",
        0x92,
        Some("fdaa::92"),
        &[("0.0.0.0/0", "host")],
    ));
    squat(0x3000_0000 + 0x92, "squat1");
    squat(0x3400_0000 + 0x92, "squat2");
    env.driver.apply(&plan).await.expect("apply");
    let v = plan.veth.as_ref().unwrap();
    let (_, index) = link_info(&env.sb.host(), &v.host_name).unwrap();
    assert!(
        ![0x3000_0000 + 0x92, 0x3400_0000 + 0x92].contains(&index),
        "{index:#x}"
    );
    let (_, peer_index) = link_info(&plan.netns, &v.peer_name).unwrap();
    assert_ne!(peer_index, index);
    assert!(env.driver.drift(&plan).await.unwrap().is_empty());
    assert!(env.driver.apply(&plan).await.unwrap().is_empty());
}
